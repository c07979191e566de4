"""NaN-poisoned output buffers for kernel tests: inside `nan_empty()`, every floating-point
`torch.empty` a wrapper allocates comes back filled with NaN, so an output element the
kernel never writes shows up as NaN instead of passing on a lucky zero."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def nan_empty():
    real = torch.empty

    def poisoned(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = real
