"""GPU checks (skipped without CUDA): the same model code on the device vs the CPU and vs transformers.

Run on the H200 by scripts/gpu_issue2.sh.
"""

from __future__ import annotations

import pytest
import torch

from conftest import new_cache, rel_err, run_seq
from tailored.config import ModelConfig
from tailored.model.batch import ForwardBatch, HybridCache
from tailored.synth import build_empty_model, init_dummy_weights, preset_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _on(model, device, dtype):
    m = build_empty_model(model.config, device, dtype)
    m.load_state_dict(model.state_dict())
    return m


def _run(model, ids, device, dtype):
    cache = HybridCache(model.config, 64, 16, 4, dtype, device)
    T = len(ids)
    b = ForwardBatch.build([(ids, 0, 1, True, list(range(1, 2 + T // 16)))], list(range(T)), device)
    return model.compute_logits(model(b, cache)).cpu()


@pytest.mark.parametrize("T", [1, 65, 129])
def test_tiny_cuda_fp32_matches_cpu(tiny_model, T):
    ids = torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    cpu = run_seq(tiny_model, new_cache(tiny_model.config), ids, 0, 1, list(range(1, 2 + T // 16)))
    gpu = _run(_on(tiny_model, "cuda", torch.float32), ids, "cuda", torch.float32)
    assert rel_err(gpu, cpu) <= 1e-4


@pytest.mark.parametrize("layer", [0, 3])
def test_tiny_cuda_bf16_layer_close_to_fp32(tiny_model, layer):
    """One GDN layer and one attention layer in bf16 on the GPU vs fp32, same input.

    Whole-model bf16-vs-fp32 error of the random-weight tiny model is dominated by chaotic
    amplification across layers (transformers' own bf16 path shows the same growth: kb/0001),
    so precision is checked per layer; exactness is checked end to end in fp32.
    """
    from tailored.ops import reference as ref

    T = 100
    x = torch.randn(T, tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(layer))
    b = ForwardBatch.build([(list(range(T)), 0, 1, True, list(range(1, 9)))], [], "cpu")
    cos, sin = ref.rope_cos_sin(b.positions, tiny_model.config.rotary_dim, tiny_model.config.rope_theta,
                                torch.float32)
    with torch.no_grad():
        want = tiny_model.model.layers[layer](x, cos, sin, b, new_cache(tiny_model.config), layer)
        m16 = _on(tiny_model, "cuda", torch.bfloat16)
        bg = ForwardBatch.build([(list(range(T)), 0, 1, True, list(range(1, 9)))], [], "cuda")
        cache = HybridCache(tiny_model.config, 64, 16, 4, torch.bfloat16, "cuda")
        got = m16.model.layers[layer](x.cuda().bfloat16(), cos.cuda().bfloat16(), sin.cuda().bfloat16(),
                                      bg, cache, layer)
    assert torch.isfinite(got).all()
    # per token: a near-tie in the router can pick another expert for a few tokens in bf16
    # (a discrete flip, seen on the H200 for the attention layer: whole-tensor error 0.045),
    # so bound the median token and 90% of tokens rather than the whole tensor
    err = (got.cpu().float() - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.median() <= 1e-2
    assert (err <= 2e-2).float().mean() >= 0.9


def test_full_width_4_layers_matches_transformers():
    """Published dimensions, 4 layers (3 GDN + 1 attention), dummy weights, fp32 on the GPU."""
    transformers = pytest.importorskip("transformers")
    cfg_dict = preset_config("full", num_layers=4)
    cfg = ModelConfig.from_dict(cfg_dict)
    ours = build_empty_model(cfg, "cuda", torch.float32, with_mtp=False)
    init_dummy_weights(ours, seed=1)
    hcfg = transformers.Qwen3_5MoeTextConfig(**cfg_dict["text_config"])
    hcfg._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = transformers.Qwen3_5MoeForCausalLM(hcfg).float().eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    T = 130
    ids = torch.randint(0, 248044, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits[0].float().cpu()
    del hf
    cache = HybridCache(cfg, 64, 16, 4, torch.float32, "cuda")
    pages = list(range(1, 2 + T // 16))
    b = ForwardBatch.build([(ids[0, :-1].tolist(), 0, 1, True, pages)], [T - 2], "cuda")
    pre = ours.compute_logits(ours(b, cache)[b.logits_rows]).cpu()
    b2 = ForwardBatch.build([(ids[0, -1:].tolist(), T - 1, 1, False, pages)], [0], "cuda")
    dec = ours.compute_logits(ours(b2, cache)[b2.logits_rows]).cpu()
    assert torch.isfinite(pre).all()
    assert rel_err(pre[0], ref[T - 2]) <= 1e-4
    assert rel_err(dec[0], ref[T - 1]) <= 1e-4
