"""The kernel path over an NVFP4 checkpoint (ModelOpt's layout: NVFP4 experts, shared expert
and lm_head, per-tensor FP8 GDN / attention projections) against the plain path, which
dequantizes, on the CPU through Triton's interpreter in fp32 over the 4-layer tiny preset:
decode rows through the W4A16 GEMVs (experts and lm_head), a prefill past them through the
experts' bf16 scratch, and the engine's greedy tokens with kernels on and off."""

from __future__ import annotations

import pytest
import torch
from helpers import load_cpu_fp32, new_cache, rel_err

from tailored import flags, kernels
from tailored.model.batch import ForwardBatch
from tailored.model.nvfp4 import Nvfp4Linear

pytest.importorskip("triton")  # the kernel modules import it (the CPU suite runs without)
from tailored.kernels import nvfp4_gemv, nvfp4_moe  # noqa: E402
from tailored.model.kernel_model import KernelModel  # noqa: E402
from tailored.worker.kernel_forward import KernelForward  # noqa: E402

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no GPU or interpreter"),
              pytest.mark.usefixtures("one_thread")]


def _ids(T, seed):
    return torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def _counting(monkeypatch, module, name, calls):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda x, *a, **kw: calls.append(x.shape[0]) or
                        real(x, *a, **kw))


@pytest.mark.parametrize("gemv_up_to", [16, 0])
def test_prefill_and_decode_match_the_plain_path(tiny4_nvfp4_ckpt, gemv_up_to, switches,
                                                 monkeypatch):
    plain, m = load_cpu_fp32(tiny4_nvfp4_ckpt), load_cpu_fp32(tiny4_nvfp4_ckpt)
    fcache, pcache = new_cache(m.config), new_cache(plain.config)
    kf = KernelForward(KernelModel(m, fcache), max_batch=4, max_pages=12, use_graphs=False)
    assert isinstance(m.lm_head, Nvfp4Linear) and m.lm_head.fast is not None
    assert isinstance(plain.lm_head, Nvfp4Linear) and plain.lm_head.fast is None
    switches(nvfp4_gemv_up_to=gemv_up_to)
    pairs, lm = [], []
    _counting(monkeypatch, nvfp4_moe, "nvfp4_moe_pairs", pairs)
    import tailored.model.kernel_moe_w4 as w4

    monkeypatch.setattr(w4, "nvfp4_moe_pairs", nvfp4_moe.nvfp4_moe_pairs)
    _counting(monkeypatch, nvfp4_gemv, "nvfp4_gemv", lm)
    a, b = _ids(33, 1), _ids(3, 2)
    steps = [[(a, 0, 1, True, [1, 2, 3]), (b, 0, 2, True, [4])]]  # 36 rows: the scratch
    decode = 3 if gemv_up_to else 1  # (fused_moe in the interpreter is slow)
    steps += [[([7 + i], 33 + i, 1, False, [1, 2, 3]), ([9 + i], 3 + i, 2, False, [4])]
              for i in range(decode)]  # 2-row decode steps: the GEMVs
    for layout in steps:
        rows = list(range(sum(len(t[0]) for t in layout)))
        hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
        hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
        assert rel_err(hf, hp) < 1e-4
        lf, lp = m.compute_logits(hf[-2:]), plain.compute_logits(hp[-2:])
        assert rel_err(lf, lp) < 1e-4
    layers = m.config.num_hidden_layers
    assert pairs == ([2] * decode * layers if gemv_up_to else [])
    assert lm == ([2] * (decode + 1) if gemv_up_to else [])


@pytest.mark.slow  # ~65 s in Triton's interpreter; the layer-level test above covers both paths
def test_engine_greedy_same_with_kernels_on_and_off(tiny4_nvfp4_ckpt):
    """The engine (its memory plan with the NVFP4 reserve, warm-up, async scheduling) with the
    kernel path against the plain path: the same greedy tokens."""
    from tailored.gate.engine_side import engine_greedy
    from tailored.stack import build_stack

    prompts = {f"r{i}": _ids(T, 50 + i) for i, T in enumerate((5, 20, 9))}
    outs = {}
    for mode in ("off", "on"):
        eng = build_stack(tiny4_nvfp4_ckpt, device="cpu", dtype="float32", progress=False,
                          kernels=mode, max_model_len=128, max_num_seqs=4, num_pages=40).engine
        assert (eng.runner.kernel is not None) == (mode == "on")
        outs[mode] = engine_greedy(eng, prompts, 5, capture=True)
    (t_off, h_off), (t_on, h_on) = outs["off"], outs["on"]
    assert t_on == t_off and all(len(t) == 5 for t in t_on.values())
    for r in prompts:
        assert rel_err(h_on[r], h_off[r]) < 1e-4, r


def test_nvfp4_reserve_counts_the_scratch_and_the_dense_copies(tiny4_nvfp4_ckpt):
    from tailored.model.kernel_moe import moe_grouped_reserve_bytes
    from tailored.model.projections import dense_dequant_bytes

    m = load_cpu_fp32(tiny4_nvfp4_ckpt)
    cfg = m.config
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert moe_grouped_reserve_bytes(m, torch.float32, 16) == E * 3 * inter * H * 4
    with flags.override(fp8_dense_dequant=False):  # NVFP4 groups are held dequantized anyway
        n = dense_dequant_bytes(m, torch.float32)
    Is = cfg.shared_expert_intermediate_size
    per_layer = (E + 1 + 2 * Is) * H + (-(E + 1 + 2 * Is) % 64) * H + H * Is
    assert n == cfg.num_hidden_layers * per_layer * 4
