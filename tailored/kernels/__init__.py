"""Fused Triton kernels for the H200 fast path.

Each kernel has a plain-PyTorch twin in `tailored.ops.reference` and a test that compares them on
fresh random inputs (tests/kernels/test_kernels.py). On a machine without a GPU the tests run the same
kernels in Triton's interpreter (TRITON_INTERPRET=1, fp32 only: its bf16 `tl.dot` is wrong).

`available()` says whether the kernels can run here; the model falls back to the reference ops
when they cannot.
"""

from __future__ import annotations

import os


def available() -> bool:
    """True when Triton imports and either a CUDA GPU or the interpreter is there."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


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
    if os.environ.get("TRITON_INTERPRET") != "1":
        return ("on the CPU the kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "(slow; meant for tests)")
    if dtype != torch.float32:
        return "Triton's interpreter computes bf16/fp16 dots wrongly: use --dtype float32 on the CPU"
    return None


def autotune_enabled(dtype=None) -> bool:
    """Autotuned launch configs on CUDA (default). TAILORED_AUTOTUNE=0 uses the fixed configs
    the interpreter uses: the GPU kernel tests set it, because tuning every odd test shape took
    longer than the tests (logs/gpu/2026-11-29-s5/run1); the served path keeps tuning.

    fp32 activations never tune: fp32 is the reference/test dtype (exact "ieee" dots, which
    ptxas compiles slowly), and tuning one fp32 FP8 linear took over 4 minutes of compiles on
    the H200 (logs/gpu/2026-11-30-s6/run3/fp8fp32.log)."""
    import torch

    if dtype == torch.float32:
        return False
    return os.environ.get("TAILORED_AUTOTUNE", "1") != "0"


def dot_precision(dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (no silent TF32)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def env_flag(name: str, default: bool) -> bool:
    """An on/off kernel switch from the environment: "1" on, "0" off, default when unset.
    Raises ValueError naming the variable for anything else ("true", "yes", a typo): a
    switch that silently stays at its default is an A/B that measured nothing."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return raw == "1"


def env_int(name: str, default: int, lo: int, hi: int, power_of_2: bool = False) -> int:
    """An integer kernel switch from the environment (kb/0019–0023), default when unset.
    Raises ValueError naming the variable for a non-integer, out-of-range or (power_of_2)
    non-power-of-2 value: a typo must not start a server on some other setting."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = None
    if v is None or not lo <= v <= hi or (power_of_2 and v & (v - 1)):
        kind = "a power of 2" if power_of_2 else "an integer"
        raise ValueError(f"{name}={raw!r}: expected {kind} in [{lo}, {hi}]")
    return v
