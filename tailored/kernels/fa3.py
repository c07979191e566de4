"""FlashAttention-3's Hopper forward kernel for a prompt chunk's causal attention, through ctypes.

The library is flash-attention's `hopper/` kernel for this model's one shape (bf16, head dim
256, grouped-query heads, causal, one sequence a call) with tailored's C entry point
(`fa3_entry.cu`), built by `lab/build_fa3.sh` into `.fa3/libtailored_fa3.so`
(docs/prefill-attention.md). It holds no torch code, so one build serves any torch; the CPU
suite never needs it. Chosen by `TAILORED_PREFILL_ATTENTION=fa3`; `TAILORED_FA3_LIB` names
another build.

`attention(q, k, v)`: q [L, Hq, 256], k/v [S, Hkv, 256] (S >= L; the queries are the last L
positions of the keys' sequence: bottom-right causal, as `causal_attention_reference`), a unit
stride on the last dim (strided rows and heads are read in place: the q|k|v projection's views
need no copy; 16-byte aligned, as the C entry checks). Returns [L, Hq, 256] bf16.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tailored import flags

HEAD_DIM = 256
DEFAULT_LIB = Path(__file__).resolve().parents[2] / ".fa3" / "libtailored_fa3.so"


class FA3Unavailable(RuntimeError):
    """The FA3 library cannot be used here (not built, not loadable, no Hopper GPU)."""


def library_path() -> Path:
    return Path(flags.current().fa3_lib or DEFAULT_LIB)


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    if not Path(path).is_file():
        raise FA3Unavailable(
            f"TAILORED_PREFILL_ATTENTION=fa3 needs FlashAttention-3's library at {path}: build "
            "it with `bash lab/build_fa3.sh` (nvcc >= 12.3; docs/prefill-attention.md) or point "
            "TAILORED_FA3_LIB at a build")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise FA3Unavailable(f"FlashAttention-3's library at {path} does not load: {e}; "
                             "rebuild it here with `bash lab/build_fa3.sh`, or run "
                             "TAILORED_PREFILL_ATTENTION=sdpa") from e
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.tailored_fa3_fwd.argtypes = [p] * 6 + [i] * 5 + [ll] * 8 + [ctypes.c_float, i, i, i, p]
    lib.tailored_fa3_fwd.restype = i
    lib.tailored_fa3_fwd_paged.argtypes = [p] * 9 + [i] * 7 + [ll] * 10 + [ctypes.c_float, i, i, p]
    lib.tailored_fa3_fwd_paged.restype = i
    lib.tailored_fa3_meta_ints.argtypes = []
    lib.tailored_fa3_meta_ints.restype = i
    lib.tailored_fa3_error.argtypes = []
    lib.tailored_fa3_error.restype = ctypes.c_char_p
    return lib


def load(device: torch.device | None = None) -> ctypes.CDLL:
    """The library at `library_path()`, loaded once; raises FA3Unavailable with what to do
    where it cannot run on `device` (default: the current CUDA device)."""
    if not torch.cuda.is_available():
        raise FA3Unavailable("TAILORED_PREFILL_ATTENTION=fa3 needs a CUDA device (Hopper)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise FA3Unavailable(f"FlashAttention-3's kernel is built for sm_90 (Hopper); this GPU is "
                             f"sm_{major}{minor}: run TAILORED_PREFILL_ATTENTION=sdpa or flash")
    return _load(str(library_path()))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _need_bf16(q: torch.Tensor, **tensors: torch.Tensor) -> None:
    """ValueError naming the first of q and `tensors` that is not bf16 on q's CUDA device with
    a unit last stride (the kernels' operands)."""
    for name, t in (("q", q), *tensors.items()):
        if t.dtype != torch.bfloat16 or t.device != q.device or not t.is_cuda \
                or t.stride(-1) != 1:
            raise ValueError(f"fa3: {name} must be bf16 on q's CUDA device with a unit last "
                             "stride")


def _run(lib: ctypes.CDLL, entry, q: torch.Tensor, *args) -> None:
    """Call C entry `entry` with `args` and the launch's multiprocessor count, device index and
    stream (q's), the entries' last three arguments; RuntimeError with its reason if it
    refuses."""
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if entry(*args, _multiprocessors(index), index,
             torch.cuda.current_stream(q.device).cuda_stream):
        raise RuntimeError(f"fa3: {lib.tailored_fa3_error().decode()}")


def check(device: torch.device) -> None:
    """Tiny calls of both kernels on `device` at start, outside any graph capture: a library
    that loads but cannot run there (a driver older than its CUDA runtime, another GPU) is
    refused before serving, not at a prompt or inside a capture (FlashAttention ends the
    process on a failed launch)."""
    load(device)
    x = torch.zeros(1, 16, HEAD_DIM, dtype=torch.bfloat16, device=device)
    y = torch.zeros(1, 2, HEAD_DIM, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(1, 16, 2, HEAD_DIM, dtype=torch.bfloat16, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    try:
        attention(x, y, y)
        paged_attention(x, cache, cache, torch.zeros(1, dtype=torch.int32, device=device),
                        one, one)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        raise FA3Unavailable(f"FlashAttention-3's library at {library_path()} does not run "
                             f"on {device}: {e}; rebuild it here with `bash lab/build_fa3.sh` "
                             "(a driver older than its CUDA runtime needs a build with an "
                             "older nvcc), or run TAILORED_PREFILL_ATTENTION=sdpa") from e


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              out: torch.Tensor | None = None) -> torch.Tensor:
    L, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    if D != HEAD_DIM or k.shape[2] != D or v.shape != k.shape:
        raise ValueError(f"fa3: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         f"head dim {HEAD_DIM} and k, v of one shape expected")
    if Hq % Hkv or not 0 < L <= S:
        raise ValueError(f"fa3: {Hq} query heads over {Hkv} key heads, {L} queries over {S} "
                         "keys: heads must divide and 0 < L <= S")
    if out is None:
        out = torch.empty(L, Hq, D, dtype=torch.bfloat16, device=q.device)
    elif out.shape != q.shape:
        raise ValueError(f"fa3: out {tuple(out.shape)} for q {tuple(q.shape)}")
    _need_bf16(q, k=k, v=v, out=out)
    lse = torch.empty(Hq, L, dtype=torch.float32, device=q.device)
    # the causal kernel's tile counter, one a call (zeroed by the call, inside a graph too):
    # launches in flight together must not hand each other's tiles out
    semaphore = torch.empty(1, dtype=torch.int32, device=q.device)
    lib = load(q.device)
    _run(lib, lib.tailored_fa3_fwd, q,
         q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
         semaphore.data_ptr(), L, S, Hq, Hkv, D,
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         out.stride(0), out.stride(1), 1.0 / math.sqrt(D), int(causal))
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, used_q: torch.Tensor, used_k: torch.Tensor
                    ) -> torch.Tensor:
    """A chunk's causal attention over its sequence's pages, with its lengths on the device (a
    CUDA graph replays it for any context): q [n, Hq, 256] whose first used_q[0] rows are the
    chunk (the rest pads), over the first used_k[0] keys of the sequence (its cached context and
    the chunk, stored already) through page_table int32 [max_pages] (or [1, max_pages]);
    k_cache, v_cache [num_pages, page_size, Hkv, 256]. Returns [n, Hq, 256] bf16; rows past
    used_q[0] are NOT written (the caller masks them). The caller keeps used_q[0] <= n and
    used_k[0] <= max_pages * page_size on the device: nothing on the host can see them."""
    n, Hq, D = q.shape
    num_pages, page_size, Hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if D != HEAD_DIM or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"fa3: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}: head dim "
                         f"{HEAD_DIM} and k, v caches of one shape expected")
    if Hq % Hkv:
        raise ValueError(f"fa3: {Hq} query heads over {Hkv} key heads: heads must divide")
    if page_table.dim() == 2 and page_table.shape[0] == 1:
        page_table = page_table[0]
    if page_table.dim() != 1 or used_q.numel() != 1 or used_k.numel() != 1:
        raise ValueError(f"fa3: one sequence's page table [max_pages] and one-element lengths "
                         f"expected, got {tuple(page_table.shape)}, {tuple(used_q.shape)}, "
                         f"{tuple(used_k.shape)}")
    _need_bf16(q, k_cache=k_cache, v_cache=v_cache)
    for name, t in (("page_table", page_table), ("used_q", used_q), ("used_k", used_k)):
        if t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"fa3: {name} must be contiguous int32 on q's device")
    lib = load(q.device)
    out = torch.empty(n, Hq, D, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(Hq, n, dtype=torch.float32, device=q.device)
    meta = torch.empty(lib.tailored_fa3_meta_ints(), dtype=torch.int32, device=q.device)
    _run(lib, lib.tailored_fa3_fwd_paged, q,
         q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse.data_ptr(),
         meta.data_ptr(), page_table.data_ptr(), used_q.data_ptr(), used_k.data_ptr(),
         n, page_table.numel(), page_size, num_pages, Hq, Hkv, D,
         q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), k_cache.stride(0),
         v_cache.stride(1), v_cache.stride(2), v_cache.stride(0), out.stride(0), out.stride(1),
         1.0 / math.sqrt(D))
    return out


def main() -> int:
    """`python -m tailored.kernels.fa3`: exit 0 when the library loads and runs on this GPU (the
    start-up check), else say why and exit 1: a device call's "build it if it does not"."""
    try:
        check(torch.device("cuda"))
    except FA3Unavailable as e:
        print(e)
        return 1
    print(f"FlashAttention-3 runs here: {library_path()}")
    return 0


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain fp32 reference: q [L, Hq, D] over k, v [S, Hkv, D], the queries the last L
    positions (bottom-right causal mask), grouped heads repeated. Returns [L, Hq, D] fp32."""
    L, S, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask).transpose(0, 1)


if __name__ == "__main__":
    raise SystemExit(main())
