"""Programmatic dependent launch (PDL) for the Triton kernels (on; the `pdl` switch: off).

Why: a B=1 decode step is ~660 kernels, most of them 1–5 µs long (kb/0029 §4): each pays its
launch, block scheduling and first loads after the previous kernel has drained. With PDL
(Hopper, CUDA programming guide §4.5 "Programmatic Dependent Launch and Synchronization";
PTX `griddepcontrol`), a kernel launched with the programmatic-serialization attribute may
start once every block of the kernel before it has executed `griddepcontrol.launch_dependents`;
its `griddepcontrol.wait` then blocks until that kernel has completed and its memory is
visible. CUDA graph capture keeps these as programmatic edges.

The rule here, simple enough to hold for every kernel: a kernel launched with PDL executes
`enter()` first, in every program — wait for the previous kernel, then let the next one
launch. Only the kernel launched just before can still run when a kernel starts (that one
has itself waited for everything before it), so a kernel may read before its wait what that
kernel does not write; everything else is read after the wait and the stream order of
memory effects is unchanged. What overlaps is the next kernel's launch and scheduling, and
two kernels' first loads (kb/0040): the GEMV's weights (never written while serving) and the
GDN recurrent state (never written by the kernel launched before `_recurrent_kernel`; its
comment says why).
Kernels launched without PDL (cuBLAS, torch) keep full stream serialization, and since every
PDL kernel completes only after its wait, ordering stays transitive across the whole step.

`launch(t)` gives a launch's keyword arguments: `PDL` (the kernels' constexpr) and Triton's
`launch_pdl` launch option, on for CUDA tensors of an sm_90+ device unless the `pdl` switch is off;
`{"PDL": False}` otherwise (the interpreter never sees the PTX). Read at each launch: a bench
can flip `PDL` and re-capture its graphs. Reference: Triton's tutorial
`11-programmatic-dependent-launch.py` (its `gdc_wait` / `gdc_launch_dependents` emit the same
two instructions).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tailored import flags
from tailored.kernels import interpreted

@triton.jit
def enter():
    """Wait for the previous kernel's completion and memory, then allow the next launch.

    Our own inline PTX rather than `tl.extra.cuda.gdc_*`: some Triton releases declared the
    launch_dependents helper pure, so with its dummy result unused the compiler may drop it
    (then the next kernel launches only when this one ends). Both are side effects here."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _on_sm90(t: torch.Tensor) -> bool:
    """t lives on a GPU with PDL (compute capability 9.0 or newer), and the kernels compile:
    Triton's interpreter (TRITON_INTERPRET=1) has no inline PTX, so an interpreted run on a GPU
    machine launches without PDL."""
    if not t.is_cuda or interpreted():
        return False
    return _sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for launching a kernel that takes the `PDL` constexpr on t's device:
    {"PDL": True, "launch_pdl": True} on sm_90+ (unless the `pdl` switch is off or Triton's interpreter runs),
    else {"PDL": False}."""
    if flags.current().pdl and _on_sm90(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
