"""The kernel path with the NVFP4 W4A16 grouped GEMM on (`nvfp4_grouped_from`,
kernels/nvfp4_grouped.py, kb/0067) against the plain path (the experts dequantized), on the CPU
through Triton's interpreter in fp32 over the 4-layer tiny NVFP4 checkpoint: a 40-token prefill
takes the grouped GEMM in every layer instead of the bf16 scratch and matches the plain path
within the NVFP4 kernel path's tolerance; below the threshold the scratch comes back. And the
warm-up reaches the grouped GEMM's launch classes."""

from __future__ import annotations

import pytest
import torch
from helpers import load_cpu_fp32, new_cache, rel_err

from tailored import kernels
from tailored.model.batch import ForwardBatch

pytest.importorskip("triton")  # the kernel modules import it (the CPU suite runs without)
from tailored.kernels import moe_w8a8, nvfp4_grouped  # noqa: E402
from tailored.model import kernel_moe_w4  # noqa: E402
from tailored.model.kernel_model import KernelModel  # noqa: E402
from tailored.worker.kernel_forward import KernelForward  # noqa: E402

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no GPU or interpreter"),
              pytest.mark.usefixtures("one_thread")]


@pytest.mark.skipif(not kernels.interpreted(),
                    reason="CPU tensors through Triton's interpreter; on the GPU the kernel's "
                           "full-size tests (tests/kernels/test_nvfp4_grouped.py) cover it")
def test_prefill_with_the_grouped_gemm_matches_the_plain_path(tiny4_nvfp4_ckpt, switches,
                                                               monkeypatch):
    plain, m = load_cpu_fp32(tiny4_nvfp4_ckpt), load_cpu_fp32(tiny4_nvfp4_ckpt)
    fcache, pcache = new_cache(m.config), new_cache(plain.config)
    kf = KernelForward(KernelModel(m, fcache), max_batch=4, max_pages=12, use_graphs=False)
    calls, fills = [], []
    real = nvfp4_grouped.nvfp4_grouped_experts_sorted
    monkeypatch.setattr(nvfp4_grouped, "nvfp4_grouped_experts_sorted",
                        lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    real_fill = kernel_moe_w4.Scratch.fill
    monkeypatch.setattr(kernel_moe_w4.Scratch, "fill",
                        lambda self, *a: fills.append(1) or real_fill(self, *a))
    ids = torch.randint(0, 248044, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    layout = [(ids, 0, 1, True, [1, 2, 3])]
    rows = list(range(len(ids)))
    hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
    lp = plain.compute_logits(hp[-2:])

    switches(nvfp4_gemv_up_to=16, nvfp4_grouped_from=33)  # the 40-row step takes it
    hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
    layers = plain.config.num_hidden_layers
    assert calls == [40] * layers and fills == []  # every layer's experts, no scratch
    print(f"NVFP4 grouped kernel path vs plain: hidden rel {rel_err(hf, hp):.2e}")
    assert rel_err(hf, hp) < 1e-4
    assert rel_err(m.compute_logits(hf[-2:]), lp) < 1e-4

    # below the threshold the step dequantizes into the scratch again
    switches(nvfp4_gemv_up_to=16, nvfp4_grouped_from=41)
    for t in (fcache.conv, fcache.rec):
        t.zero_()
    hf2 = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
    assert calls == [40] * layers and len(fills) == layers
    assert rel_err(hf2, hp) < 1e-4


def test_the_switch_stays_off_in_graph_bodies_and_at_gemv_rows(switches, monkeypatch):
    """`use_w4_grouped`: the threshold, above the GEMV rows only, never in a prefill graph
    body or its warm-up (`fused_only`); in a decode graph's capture it applies (no host
    sync in the grouped GEMM; the scratch would be refilled every layer of every step)."""
    from types import SimpleNamespace

    from tailored.model.kernel_moe import MoEBlocks

    blocks = MoEBlocks([], SimpleNamespace(), {}, {}, {}, {}, {})
    x = SimpleNamespace(shape=(100, 8), device=torch.device("cpu"))
    switches(nvfp4_grouped_from=0)
    assert not blocks.use_w4_grouped(x)  # off by default
    switches(nvfp4_grouped_from=100, nvfp4_gemv_up_to=64)
    assert blocks.use_w4_grouped(x)
    blocks.fused_only = True
    assert not blocks.use_w4_grouped(x)
    blocks.fused_only = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert blocks.use_w4_grouped(SimpleNamespace(shape=(100, 8), device=torch.device("cuda")))
    switches(nvfp4_grouped_from=1, nvfp4_gemv_up_to=128)
    assert not blocks.use_w4_grouped(x)  # the GEMVs take these rows


@pytest.mark.parametrize("start", [1, 1024, 3000])
def test_warmup_reaches_every_grouped_launch_class(start, switches):
    """With NVFP4 experts and `nvfp4_grouped_from` on, the warm-up's lengths reach every
    (gate_up, down) BLOCK_M pair that eager steps from the threshold (or the first row past
    the GEMVs) to the step budget launch: each is an autotuner key, tuned at start."""
    from types import SimpleNamespace

    from tailored.worker.warmup import warmup_lengths

    switches(nvfp4_grouped_from=start)
    E, k, bt = 256, 8, 8192
    fake = SimpleNamespace(cfg=SimpleNamespace(num_experts=E, num_experts_per_tok=k),
                           dtype=torch.bfloat16, device=torch.device("cuda"),
                           moe=SimpleNamespace(experts={}, w4={0: None}))
    lengths = warmup_lengths(fake, bt)
    first = max(start, 65)  # nvfp4_gemv_up_to's default is 64
    warmed = {moe_w8a8.block_ms(n * k, E) for n in lengths if n >= first}
    needed = {moe_w8a8.block_ms(T * k, E) for T in range(first, bt + 1)}
    assert needed <= warmed, needed - warmed
    assert first in lengths
