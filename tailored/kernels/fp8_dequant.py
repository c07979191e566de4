"""Block-FP8 weight → bf16, one pass, for the prefill GEMMs of an FP8 checkpoint (kb/0026).

A prefill of hundreds of rows is compute bound: there the W8A16 Triton GEMM (`fp8_linear`)
lost 2.6× to cuBLAS bf16 at M = 1024 (204.7 vs 77.7 µs on the GDN input projection, kb/0009).
Converting the weight to bf16 first costs one read of 1 byte and one write of 2 bytes per
weight (~25 µs for that 12288×2048 projection at ~3 TB/s), then cuBLAS runs the bf16 GEMM.
kb/0009 measured this idea with torch ops (several elementwise passes over an fp32 copy: 323
µs); this kernel does it in one pass.

The rounding is the reference's (`tailored.model.fp8.dequantize_block`): q · scale in fp32,
rounded once to the output dtype, so the GEMM that follows computes exactly what the plain
PyTorch path of an FP8 checkpoint computes. Tests: tests/test_fp8_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.fp8_linear import SCALE_BLOCK


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_yn,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one [BLOCK_N, BLOCK_K] tile; BLOCK_K divides 128, so the tile's rows share one K block
    # and each row needs one scale
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    n_ok = n < N
    mask = n_ok[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + n.to(tl.int64) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
    y = w.to(tl.float32) * s[:, None]
    tl.store(y_ptr + n[:, None].to(tl.int64) * stride_yn + k[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize_rows(weight: torch.Tensor, scale_rows: torch.Tensor,
                    out: torch.Tensor | None = None, dtype=torch.bfloat16) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn (unit column stride), scale_rows [N, ceil(K/128)] fp32
    (`fp8.row_scales`) → [N, K] in `dtype` (or written into `out`, a [N, K] tensor of any
    float dtype with a unit column stride): weight · scale rounded once, bitwise
    `fp8.dequantize_block` of the block scales.

    Raises ValueError on mismatched shapes, dtypes or strides."""
    N, K = weight.shape
    if weight.dtype != torch.float8_e4m3fn or scale_rows.shape != (N, triton.cdiv(K, SCALE_BLOCK)):
        raise ValueError(f"dequantize_rows: weight{tuple(weight.shape)} {weight.dtype} "
                         f"scale_rows{tuple(scale_rows.shape)}: need a float8_e4m3fn weight "
                         f"[N, K] and scale_rows [N, ceil(K/128)]")
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=weight.device)
    if out.shape != (N, K) or out.stride(1) != 1 or weight.stride(1) != 1 \
            or scale_rows.stride(1) != 1 or scale_rows.dtype != torch.float32:
        raise ValueError(f"dequantize_rows: out{tuple(out.shape)} stride {out.stride()}, weight "
                         f"stride {weight.stride()}, scale_rows {scale_rows.dtype} stride "
                         f"{scale_rows.stride()}: need [N, K] and unit column strides, fp32 scales")
    if N and K:
        # 64 rows x 128 columns: 8 KB of FP8 in, 16 KB of bf16 out per program; memory bound,
        # nothing to tune (one config: no start-up tuning, kb/0020)
        bn, bk = 64, min(128, max(16, triton.next_power_of_2(K)))
        _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
            weight, scale_rows, out, N, K, weight.stride(0), scale_rows.stride(0), out.stride(0),
            BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


class Scratch:
    """One bf16 buffer that every FP8 projection of a model dequantizes into before its prefill
    GEMM (the projections run one after another on one stream, so one buffer serves them all;
    the largest, the GDN input projection 12288×2048, is 48 MiB).

    `reserve` sizes it before CUDA graph capture; `view` hands out [N, K] views and grows the
    buffer only outside a capture: a graph keeps the address it captured, so replacing the
    buffer after a capture would leave that graph writing into freed memory. Raises
    RuntimeError for a view larger than the buffer during a capture."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def _fits(self, numel: int, dtype, device) -> bool:
        return (self.buf is not None and self.buf.numel() >= numel and self.buf.dtype == dtype
                and self.buf.device == _device(device))

    def reserve(self, numel: int, dtype, device) -> None:
        if not self._fits(numel, dtype, device):
            if _capturing(_device(device)):
                raise RuntimeError(f"fp8_dequant.Scratch: {numel} elements during CUDA graph "
                                   "capture: reserve() them before the capture")
            self.buf = torch.empty(numel, dtype=dtype, device=_device(device))

    def view(self, N: int, K: int, dtype, device) -> torch.Tensor:
        self.reserve(N * K, dtype, device)
        return self.buf[:N * K].view(N, K)


def _device(device) -> torch.device:
    """torch.device with its index ("cuda" → cuda:<current>), comparable to a tensor's."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
