// C entry points into FlashAttention-3's Hopper forward kernel (flash-attention's `hopper/`
// sources, built by lab/build_fa3.sh; docs/prefill-attention.md): the causal attention of one
// prompt chunk's queries over its keys, bf16, head dim 256, grouped-query heads, no torch
// headers, so the library loads under any torch through ctypes (kernels/fa3.py).
//
// tailored_fa3_fwd: keys and values in one strided tensor each.
//   q [seqlen_q, h, 256], k/v [seqlen_k, h_k, 256], out [seqlen_q, h, 256] (written),
//   lse [h, seqlen_q] float32 (written), semaphore: one int32 on the device (zeroed here; the
//   causal kernel's tile counter: one per call, two launches in flight must not share it).
//   seqlen_q <= seqlen_k: the queries are the last seqlen_q positions of the keys' sequence
//   (bottom-right causal mask, FlashAttention's convention).
// tailored_fa3_fwd_paged: keys and values in the KV cache's pages, lengths on the device (what
//   a CUDA graph replays for any context: worker/ctx_graphs.py).
//   k/v cache [num_pages, page_size, h_k, 256], page_table int32 [max_pages] (the sequence's),
//   seqused_q / seqused_k: int32 [1] on the device, the chunk's real rows T (<= seqlen_q, the
//   rest of q and out are pads: out rows past T are not written) and its keys (the context
//   and the chunk: the queries are their last T positions), meta: int32 [META_INTS] scratch of
//   the varlen scheduler (filled here, on the device).
// Both return 0, or a nonzero code that tailored_fa3_error() describes; the kernel's own launch
// errors end the process (FlashAttention's CHECK_CUDA), which only a broken device does.

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cutlass/numeric_types.h"
#include "flash.h"

namespace {
thread_local char error_text[256] = "";
constexpr int kMetaInts = 17;  // batch 1 rounded to 4: 4 vectors of 4 ints, then the counter

int refuse(const char* why) {
    std::snprintf(error_text, sizeof(error_text), "%s", why);
    return 1;
}

// TMA reads and writes: 16-byte aligned bases, strides of 8 bf16 elements (a misaligned
// descriptor is not refused by CUTLASS in a release build: the kernel faults)
int check_layout(std::initializer_list<void*> ptrs, std::initializer_list<long long> strides) {
    for (void* ptr : ptrs) {
        if (!ptr) return refuse("null pointer");
        if (reinterpret_cast<uintptr_t>(ptr) % 16) return refuse("a base pointer is not 16-byte aligned");
    }
    for (long long st : strides)
        if (st <= 0 || st % 8) return refuse("a row or head stride is not a positive multiple of 8 elements");
    return 0;
}

int check_heads(int h, int h_k, int head_dim) {
    if (head_dim != 256) return refuse("this build holds head dim 256 only");
    if (h <= 0 || h_k <= 0 || h % h_k != 0) return refuse("query heads must be a multiple of key heads");
    return 0;
}

// The fields both entries set alike (flash_api.cpp's set_params_fprop for one sequence).
void fill_common(Flash_fwd_params& p, void* q, void* k, void* v, void* out, float* lse,
                 int seqlen_q, int seqlen_k, int h, int h_k,
                 long long q_row, long long q_head, long long k_row, long long k_head,
                 long long v_row, long long v_head, long long o_row, long long o_head,
                 float scale, bool causal, int num_sm) {
    std::memset(&p, 0, sizeof(p));
    p.is_bf16 = true;
    p.q_ptr = q; p.k_ptr = k; p.v_ptr = v; p.o_ptr = out;
    p.q_row_stride = q_row; p.q_head_stride = q_head;
    p.k_row_stride = k_row; p.k_head_stride = k_head;
    p.v_row_stride = v_row; p.v_head_stride = v_head; p.v_dim_stride = 1;
    p.o_row_stride = o_row; p.o_head_stride = o_head;
    p.q_batch_stride = q_row * seqlen_q;  // batch 1: only the sizes matter
    p.o_batch_stride = o_row * seqlen_q;
    p.softmax_lse_ptr = lse;
    p.b = 1; p.b_k = 1; p.h = h; p.h_k = h_k;
    p.seqlen_q = seqlen_q; p.seqlen_k = seqlen_k;
    p.total_q = seqlen_q;
    p.seqlen_q_rounded = (seqlen_q + 127) / 128 * 128;
    p.seqlen_k_rounded = (seqlen_k + 127) / 128 * 128;
    p.d = p.d_rounded = p.dv = p.dv_rounded = 256;
    p.scale_softmax = scale;
    p.p_dropout = 1.f; p.rp_dropout = 1.f; p.p_dropout_in_uint8_t = 255;
    // causal: nothing to the right of the diagonal, everything to its left
    p.is_causal = causal;
    p.window_size_left = seqlen_k - 1;
    p.window_size_right = causal ? 0 : seqlen_q - 1;
    p.num_splits = 1;
    p.head_swizzle = causal;
    p.varlen_sort_batches = true;
    p.arch = 90;
    p.num_sm = num_sm;
}

// Run `launch` with `device` current (this library's CUDA runtime is its own, static), then
// give the caller's current device back.
template <typename F>
int on_device(int device, F launch) {
    int before = 0;
    cudaError_t e = cudaGetDevice(&before);
    if (e != cudaSuccess) return refuse(cudaGetErrorString(e));
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return refuse(cudaGetErrorString(e));
    e = launch();
    cudaSetDevice(before);
    if (e != cudaSuccess) return refuse(cudaGetErrorString(e));
    return 0;
}
}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT const char* tailored_fa3_error() { return error_text; }

EXPORT int tailored_fa3_meta_ints() { return kMetaInts; }

EXPORT int tailored_fa3_fwd(void* q, void* k, void* v, void* out, float* lse, int* semaphore,
                            int seqlen_q, int seqlen_k, int h, int h_k, int head_dim,
                            long long q_row_stride, long long q_head_stride,
                            long long k_row_stride, long long k_head_stride,
                            long long v_row_stride, long long v_head_stride,
                            long long o_row_stride, long long o_head_stride,
                            float softmax_scale, int causal, int num_sm, int device,
                            void* stream_ptr) {
    if (check_heads(h, h_k, head_dim)) return 1;
    if (seqlen_q <= 0 || seqlen_k < seqlen_q) return refuse("need 0 < seqlen_q <= seqlen_k");
    if (!lse || !semaphore) return refuse("null pointer");
    if (check_layout({q, k, v, out}, {q_row_stride, q_head_stride, k_row_stride, k_head_stride,
                                      v_row_stride, v_head_stride, o_row_stride, o_head_stride}))
        return 1;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    Flash_fwd_params p;
    fill_common(p, q, k, v, out, lse, seqlen_q, seqlen_k, h, h_k, q_row_stride, q_head_stride,
                k_row_stride, k_head_stride, v_row_stride, v_head_stride, o_row_stride,
                o_head_stride, softmax_scale, causal != 0, num_sm);
    p.k_batch_stride = k_row_stride * seqlen_k;
    p.v_batch_stride = v_row_stride * seqlen_k;
    p.total_k = seqlen_k;
    p.pack_gqa = false;
    return on_device(device, [&]() {
        // the causal kernel's persistent scheduler hands out tiles through this counter
        cudaError_t e = cudaMemsetAsync(semaphore, 0, sizeof(int), stream);
        if (e != cudaSuccess) return e;
        p.tile_count_semaphore = semaphore;
        run_mha_fwd_<90, cutlass::bfloat16_t, 256, 256, false, false, false, false>(p, stream);
        return cudaGetLastError();
    });
}

EXPORT int tailored_fa3_fwd_paged(void* q, void* k_cache, void* v_cache, void* out, float* lse,
                                  int* meta, int* page_table, int* seqused_q, int* seqused_k,
                                  int seqlen_q, int max_pages, int page_size, int num_pages,
                                  int h, int h_k, int head_dim,
                                  long long q_row_stride, long long q_head_stride,
                                  long long k_row_stride, long long k_head_stride,
                                  long long k_page_stride, long long v_row_stride,
                                  long long v_head_stride, long long v_page_stride,
                                  long long o_row_stride, long long o_head_stride,
                                  float softmax_scale, int num_sm, int device, void* stream_ptr) {
    if (check_heads(h, h_k, head_dim)) return 1;
    if (seqlen_q <= 0 || max_pages <= 0 || page_size <= 0 || num_pages <= 0)
        return refuse("need positive seqlen_q, max_pages, page_size and num_pages");
    if (!lse || !meta || !page_table || !seqused_q || !seqused_k) return refuse("null pointer");
    if (check_layout({q, k_cache, v_cache, out},
                     {q_row_stride, q_head_stride, k_row_stride, k_head_stride, k_page_stride,
                      v_row_stride, v_head_stride, v_page_stride, o_row_stride, o_head_stride}))
        return 1;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    int const seqlen_k = max_pages * page_size;  // the page table's reach; seqused_k the keys
    Flash_fwd_params p;
    fill_common(p, q, k_cache, v_cache, out, lse, seqlen_q, seqlen_k, h, h_k, q_row_stride,
                q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
                o_row_stride, o_head_stride, softmax_scale, true, num_sm);
    p.k_batch_stride = k_page_stride;  // paged: a "batch" of the cache tensor is a page
    p.v_batch_stride = v_page_stride;
    p.total_k = page_size;  // mha_fwd's batch x k.size(1) for a paged cache
    p.page_table = page_table;
    p.page_table_batch_stride = max_pages;
    p.page_size = page_size;
    p.num_pages = num_pages;
    p.pagedkv_tma = false;  // pages of 16 tokens: not a multiple of the key tile
    p.pack_gqa = true;      // what mha_fwd picks for paged keys without TMA
    p.seqused_q = seqused_q;
    p.seqused_k = seqused_k;
    // the varlen scheduler's vectors (batch 1 rounded to 4 ints each), then its tile counter;
    // the prepare kernel fills them and zeroes the counter on the stream
    p.num_splits_dynamic_ptr = meta;
    p.num_m_blocks_ptr = meta + 4;
    p.varlen_batch_idx_ptr = meta + 8;
    p.num_nheads_in_l2_ptr = meta + 12;
    p.tile_count_semaphore = meta + 16;
    p.tile_count_semaphore_offset = 16;
    p.prepare_varlen_pdl = true;
    return on_device(device, [&]() {
        run_mha_fwd_<90, cutlass::bfloat16_t, 256, 256, false, true, false, true>(p, stream);
        return cudaGetLastError();
    });
}
