// One C entry point into FlashAttention-3's Hopper forward kernel (flash-attention's `hopper/`
// sources, built by lab/build_fa3.sh; docs/prefill-attention.md): the causal attention of one
// prompt chunk's queries over its keys, bf16, head dim 256, grouped-query heads, no torch
// headers, so the library loads under any torch through ctypes (kernels/fa3.py).
//
// Shapes, all bf16 with a unit stride on the last dim (strides in elements):
//   q [seqlen_q, h, 256], k/v [seqlen_k, h_k, 256], out [seqlen_q, h, 256] (written),
//   lse [h, seqlen_q] float32 (written), semaphore: one int32 on the device (zeroed here; the
//   causal kernel's tile counter: one per call, two launches in flight must not share it).
// seqlen_q <= seqlen_k: the queries are the last seqlen_q positions of the keys' sequence
// (bottom-right causal mask, FlashAttention's convention). Returns 0, or a nonzero code that
// fa3_error() describes; the kernel's own launch errors end the process (FlashAttention's
// CHECK_CUDA), which only a broken device does.

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cutlass/numeric_types.h"
#include "flash.h"

namespace {
thread_local char error_text[256] = "";

int refuse(const char* why) {
    std::snprintf(error_text, sizeof(error_text), "%s", why);
    return 1;
}
}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT const char* tailored_fa3_error() { return error_text; }

EXPORT int tailored_fa3_fwd(void* q, void* k, void* v, void* out, float* lse, int* semaphore,
                                int seqlen_q, int seqlen_k, int h, int h_k, int head_dim,
                                long long q_row_stride, long long q_head_stride,
                                long long k_row_stride, long long k_head_stride,
                                long long v_row_stride, long long v_head_stride,
                                long long o_row_stride, long long o_head_stride,
                                float softmax_scale, int causal, int num_sm, int device,
                                void* stream_ptr) {
    if (head_dim != 256) return refuse("this build holds head dim 256 only");
    if (h <= 0 || h_k <= 0 || h % h_k != 0) return refuse("query heads must be a multiple of key heads");
    if (seqlen_q <= 0 || seqlen_k < seqlen_q) return refuse("need 0 < seqlen_q <= seqlen_k");
    if (!q || !k || !v || !out || !lse || !semaphore) return refuse("null pointer");
    // TMA reads and writes: 16-byte aligned bases, row and head strides of 8 bf16 elements
    // (a misaligned descriptor is not refused by CUTLASS in a release build: it faults)
    for (void* ptr : {q, k, v, out})
        if (reinterpret_cast<uintptr_t>(ptr) % 16) return refuse("a base pointer is not 16-byte aligned");
    for (long long st : {q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride,
                         v_head_stride, o_row_stride, o_head_stride})
        if (st <= 0 || st % 8) return refuse("a row or head stride is not a positive multiple of 8 elements");
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    // this library's CUDA runtime is its own (static): make torch's device its current one for
    // the call, and give the caller's back after it
    int before = 0;
    cudaError_t e = cudaGetDevice(&before);
    if (e != cudaSuccess) return refuse(cudaGetErrorString(e));
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return refuse(cudaGetErrorString(e));

    Flash_fwd_params p;
    std::memset(&p, 0, sizeof(p));
    p.is_bf16 = true;
    p.q_ptr = q; p.k_ptr = k; p.v_ptr = v; p.o_ptr = out;
    p.q_row_stride = q_row_stride; p.q_head_stride = q_head_stride;
    p.k_row_stride = k_row_stride; p.k_head_stride = k_head_stride;
    p.v_row_stride = v_row_stride; p.v_head_stride = v_head_stride; p.v_dim_stride = 1;
    p.o_row_stride = o_row_stride; p.o_head_stride = o_head_stride;
    // one sequence: the batch strides span the whole tensors
    p.q_batch_stride = q_row_stride * seqlen_q;
    p.o_batch_stride = o_row_stride * seqlen_q;
    p.k_batch_stride = k_row_stride * seqlen_k;
    p.v_batch_stride = v_row_stride * seqlen_k;
    p.softmax_lse_ptr = lse;
    p.b = 1; p.b_k = 1; p.h = h; p.h_k = h_k;
    p.seqlen_q = seqlen_q; p.seqlen_k = seqlen_k;
    p.total_q = seqlen_q; p.total_k = seqlen_k;
    p.seqlen_q_rounded = (seqlen_q + 127) / 128 * 128;
    p.seqlen_k_rounded = (seqlen_k + 127) / 128 * 128;
    p.d = p.d_rounded = p.dv = p.dv_rounded = 256;
    p.scale_softmax = softmax_scale;
    p.p_dropout = 1.f; p.rp_dropout = 1.f; p.p_dropout_in_uint8_t = 255;
    // causal: nothing to the right of the diagonal, everything to its left
    p.is_causal = causal != 0;
    p.window_size_left = seqlen_k - 1;
    p.window_size_right = causal ? 0 : seqlen_q - 1;
    p.num_splits = 1;
    p.pack_gqa = false;
    p.head_swizzle = p.is_causal;
    p.arch = 90;
    p.num_sm = num_sm;
    // the causal kernel's persistent scheduler hands out tiles through this counter
    e = cudaMemsetAsync(semaphore, 0, sizeof(int), stream);
    if (e == cudaSuccess) {
        p.tile_count_semaphore = semaphore;
        run_mha_fwd_<90, cutlass::bfloat16_t, 256, 256, false, false, false, false>(p, stream);
        e = cudaGetLastError();
    }
    cudaSetDevice(before);
    if (e != cudaSuccess) return refuse(cudaGetErrorString(e));
    return 0;
}
