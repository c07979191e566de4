"""model/moe_stack.py: the routed experts grow by the shared expert without a second copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tailored.model.moe_stack import append_expert


def test_append_expert_grows_the_parameter_storage_in_place():
    p = nn.Parameter(torch.randn(4, 3, 5), requires_grad=False)
    before = p.data.clone()
    extra = torch.randn(3, 5)
    out = append_expert(p, extra)
    assert out.shape == (5, 3, 5) and out.is_contiguous()
    assert p.data_ptr() == out.data_ptr() and p.shape == (4, 3, 5)  # the parameter is the head
    assert torch.equal(out[:4], before) and torch.equal(out[4], extra)
    out[0, 0, 0] = 123.0  # one storage: the parameter sees writes to the stack
    assert p[0, 0, 0] == 123.0


def test_append_expert_copies_a_view_and_repoints_the_parameter():
    base = torch.randn(6, 3, 5)
    p = nn.Parameter(base[1:5], requires_grad=False)  # a view: its storage is not its own
    extra = torch.randn(3, 5)
    out = append_expert(p, extra)
    assert torch.equal(out[:4], base[1:5]) and torch.equal(out[4], extra)
    assert p.data_ptr() == out.data_ptr()
    assert base.shape == (6, 3, 5)  # the other tensor is untouched


def test_append_expert_rejects_a_wrong_shape_or_dtype():
    p = nn.Parameter(torch.randn(4, 3, 5), requires_grad=False)
    with pytest.raises(ValueError):
        append_expert(p, torch.randn(3, 4))
    with pytest.raises(ValueError):
        append_expert(p, torch.randn(3, 5, dtype=torch.float64))
