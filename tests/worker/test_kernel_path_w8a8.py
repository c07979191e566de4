"""The kernel path with the W8A8 FP8 experts on (`moe_w8a8_from`, kernels/moe_w8a8.py, kb/0061)
against the plain path (FP8 weights dequantized, activations unrounded), on the CPU through
Triton's interpreter in fp32 over the 4-layer tiny FP8 checkpoint: a prefill step takes the
W8A8 experts in every layer, and its hidden rows and next-token logits stay at the e4m3
activation rounding's distance from the plain path (the FP8 gate on the GPU decides whether that
distance is acceptable at full size)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_cpu_fp32, new_cache, rel_err

from tailored import flags, kernels
from tailored.kernels import moe_w8a8
from tailored.model.batch import ForwardBatch
from tailored.model.kernel_model import KernelModel
from tailored.worker.kernel_forward import KernelForward

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]


@pytest.mark.skipif(not kernels.interpreted(),
                    reason="CPU tensors through Triton's interpreter; on the GPU the kernel's "
                           "full-size tests (tests/kernels/test_moe_w8a8.py) and the FP8 gate "
                           "with TAILORED_MOE_W8A8_FROM cover it")
def test_prefill_with_w8a8_experts_matches_plain_path(tiny4_fp8_ckpt, switches, monkeypatch):
    with flags.override(fp8_dense_dequant=False):
        plain, m = load_cpu_fp32(tiny4_fp8_ckpt), load_cpu_fp32(tiny4_fp8_ckpt)
        fcache = new_cache(m.config)
        kf = KernelForward(KernelModel(m, fcache), max_batch=4, max_pages=12, use_graphs=False)
    pcache = new_cache(plain.config)
    calls = []
    real = moe_w8a8.w8a8_experts_sorted
    monkeypatch.setattr(moe_w8a8, "w8a8_experts_sorted",
                        lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    ids = torch.randint(0, 248044, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    layout = [(ids, 0, 1, True, [1, 2, 3])]
    rows = list(range(len(ids)))
    hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
    lp = plain.compute_logits(hp)

    switches(moe_w8a8_from=33)  # the 40-row step takes it; fewer rows keep fused_moe
    hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
    lf = m.compute_logits(hf)
    layers = plain.config.num_hidden_layers
    assert calls == [40] * layers  # every layer's routed experts, W8A8
    err, top1 = rel_err(hf, hp), (lf.argmax(-1) == lp.argmax(-1)).float().mean().item()
    print(f"W8A8 kernel path vs plain: hidden rel {err:.2e}, logits rel "
          f"{rel_err(lf, lp):.2e}, top-1 agreement {top1:.3f}")
    assert err < 0.1 and top1 >= 0.8  # tiny random model: near-tied logits flip

    # below the threshold the step is fused_moe's again: the W8A16 path's tolerance
    switches(moe_w8a8_from=41)
    for t in (fcache.conv, fcache.rec):
        t.zero_()
    hf2 = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
    assert calls == [40] * layers and rel_err(hf2, hp) < 1e-4


@pytest.mark.parametrize("start", [1024, 3000, 6144])
def test_warmup_reaches_every_w8a8_launch_class(start, switches):
    """With FP8 experts and `moe_w8a8_from` on, the warm-up's lengths reach every (gate_up,
    down) BLOCK_M pair that eager steps from the threshold to the step budget launch (each is
    an autotuner key: tuned at start, never inside a served step), and those lengths run a
    second, eager forward (`warmup_prefill`)."""
    from types import SimpleNamespace

    from tailored.worker.warmup import warmup_lengths

    switches(moe_w8a8_from=start)
    E, k, bt = 256, 8, 8192
    fake = SimpleNamespace(cfg=SimpleNamespace(num_experts=E, num_experts_per_tok=k),
                           dtype=torch.bfloat16, device=torch.device("cuda"),
                           moe=SimpleNamespace(experts={0: None}))
    lengths = warmup_lengths(fake, bt)
    warmed = {moe_w8a8.block_ms(n * k, E) for n in lengths if n >= start}
    needed = {moe_w8a8.block_ms(T * k, E) for T in range(start, bt + 1)}
    assert needed <= warmed, needed - warmed
    fake.moe = SimpleNamespace(experts={})  # bf16 experts: no W8A8 lengths
    with_bf16 = warmup_lengths(fake, bt)
    switches(moe_w8a8_from=0)
    assert with_bf16 == warmup_lengths(fake, bt)
