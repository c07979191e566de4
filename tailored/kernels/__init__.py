"""Fused Triton kernels for the H200 kernel path.

Each kernel has a plain-PyTorch twin in `tailored.ops.reference` and a test that compares them on
fresh random inputs (tests/kernels/test_kernels.py). On a machine without a GPU the tests run the same
kernels in Triton's interpreter (TRITON_INTERPRET=1, fp32 only: its bf16 `tl.dot` is wrong).

`available()` says whether the kernels can run here; the model falls back to the reference ops
when they cannot.
"""

from __future__ import annotations

import os


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, Triton's own switch,
    set before triton is imported: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """True when Triton imports and either a CUDA GPU or the interpreter is there."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or interpreted()


def unavailable_reason(device_type: str, dtype) -> str | None:
    """Why the kernel path cannot run on this device/dtype (None = it can). On the CPU it needs
    Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) and fp32."""
    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA GPU is available"
    if not interpreted():
        return ("on the CPU the kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "(slow; meant for tests)")
    if dtype != torch.float32:
        return "Triton's interpreter computes bf16/fp16 dots wrongly: use --dtype float32 on the CPU"
    return None


def autotune_enabled(dtype=None) -> bool:
    """Autotuned launch configs on CUDA (default). The `autotune` switch off uses the fixed
    configs the interpreter uses: the GPU kernel tests turn it off, because tuning every odd
    test shape took longer than the tests; the served path keeps tuning.

    fp32 activations never tune: fp32 is the reference/test dtype (exact "ieee" dots, which
    ptxas compiles slowly), and tuning one fp32 FP8 linear took over 4 minutes of compiles on
    the H200."""
    import torch

    from tailored import flags

    if dtype == torch.float32:
        return False
    return flags.current().autotune


def dot_precision(dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (no silent TF32)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"
