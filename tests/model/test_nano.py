"""The packaged nano checkpoint (tailored/data/nano, trained by lab/train_nano.py, issue 5).

It is an ordinary HF checkpoint of the Qwen3.6 architecture (≤ 8 MB, official tensor names incl.
mtp.*) that loads through the serving stack, matches transformers in fp32, has a working
byte-level BPE tokenizer with the Qwen added tokens and the ChatML template, and completes
`def fibonacci(n):` deterministically. CPU only; a few seconds.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tailored
from tailored.config import ModelConfig
from tailored.engine.types import SamplingParams
from tailored.stack import build_stack, embedded_checkpoint
from tailored.synth import tensor_specs
from tailored.tokenizer import ADDED_TOKENS, NON_SPECIAL, load_tokenizer

NANO = Path(tailored.__file__).parent / "data" / "nano"
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors", "training_manifest.json"]
FIB = "def fibonacci(n):"
CODE = '''import os


class Reader:
    """Read lines from a file."""

    def __init__(self, path, encoding="utf-8"):
        self.path = os.fspath(path)
        self.encoding = encoding

    def lines(self):
        with open(self.path, encoding=self.encoding) as f:
            for line in f:
                yield line.rstrip("\\n")
'''


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def stack():
    return build_stack(NANO, device="cpu", dtype="float32", progress=False, max_model_len=1024,
                       max_num_seqs=4)


@pytest.fixture(scope="module")
def manifest():
    return json.loads((NANO / "training_manifest.json").read_text())


def test_files_size_and_config(manifest):
    for f in FILES:
        assert (NANO / f).is_file(), f
    total = sum(p.stat().st_size for p in NANO.iterdir() if p.is_file())
    assert total <= 8_000_000, total
    cfg = json.loads((NANO / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe"
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]
    assert text["mtp_num_hidden_layers"] == 1 and text["tie_word_embeddings"] is False
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["num_experts_per_tok"] < text["num_experts"]
    assert text["shared_expert_intermediate_size"] > 0
    mc = ModelConfig.from_dict(cfg)
    assert mc.rotary_dim == text["head_dim"] // 4
    for key in ("kind", "seed", "corpus", "tokenizer", "training", "loss_curve", "eval", "versions"):
        assert key in manifest, key
    assert len(manifest["corpus"]["sha256"]) == 64
    assert manifest["loss_curve"]["points"]
    ev = manifest["eval"]
    assert ev["heldout"]["ppl"] > 1
    assert set(ev["mtp_acceptance"]["spec_decode"]) == {"1", "2", "3"}
    assert 0 <= ev["mtp_acceptance"]["acceptance_rate_1"] <= 1


def test_official_tensor_names_bf16():
    cfg = ModelConfig.from_dir(NANO)
    want = dict(tensor_specs(cfg))
    with safe_open(str(NANO / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        got = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        dtypes = {f.get_slice(k).get_dtype() for k in names}
    assert got == want
    assert dtypes == {"BF16"}
    assert any(k.startswith("mtp.layers.0.mlp.experts.") for k in got)
    assert "mtp.fc.weight" in got and "model.language_model.embed_tokens.weight" in got


def test_engine_matches_transformers_fp32(stack):
    transformers = pytest.importorskip("transformers")
    from tailored.gate.reference import reference_from_files
    from tailored.model.batch import ForwardBatch
    from tailored.worker.cache import HybridCache

    ids = stack.tokenizer.encode(CODE)
    assert len(ids) > 64  # crosses a GDN chunk boundary
    cfg, model = stack.model_config, stack.engine.runner.model
    cache = HybridCache(cfg, num_pages=len(ids) // 16 + 3, page_size=16, num_slots=2,
                        dtype=torch.float32, device="cpu")
    b = ForwardBatch.build([(ids, 0, 1, True, list(range(1, len(ids) // 16 + 2)))],
                           range(len(ids)), "cpu")
    with torch.no_grad():
        ours = model.compute_logits(model(b, cache))
    hf = reference_from_files(NANO)  # raises on a missing or left-over tensor
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(ours, ref) <= 1e-4
    # and the ordinary HF loading path (config.json + model.language_model.* names, mtp.* ignored)
    auto = transformers.AutoModelForCausalLM.from_pretrained(NANO, dtype=torch.float32).eval()
    assert type(auto).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        assert rel_err(ours, auto(torch.tensor([ids])).logits[0]) <= 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(NANO)
    assert hf_tok.encode(CODE) == ids


def test_tokenizer_round_trip_and_special_tokens():
    tok = load_tokenizer(NANO)
    cfg = ModelConfig.from_dir(NANO)
    assert tok.backend == "hf"
    assert tok.vocab_size <= cfg.vocab_size
    for text in [CODE, FIB, "naïve café — ünïcödé ✓ 数字 123", "  \t\n\n  x  ", "<|im_start|>user\nhi"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    first = tok.token_to_id("<|endoftext|>")
    for i, t in enumerate(ADDED_TOKENS):  # same order and flags as Qwen3.6, shifted ids
        assert tok.token_to_id(t) == first + i
        assert tok.is_special(first + i) == (t not in NON_SPECIAL)
        assert tok.encode(t) == [first + i]
    assert tok.encode("<|im_start|>", allow_special=False) != [first + 1]
    gen = json.loads((NANO / "generation_config.json").read_text())
    assert tok.eos_token_ids == tuple(gen["eos_token_id"])
    assert set(tok.eos_token_ids) == {tok.token_to_id("<|im_end|>"), first}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<think>") in ids
    assert tok.token_bytes(cfg.vocab_size - 1) == b""  # padded embedding row: no token
    assert tok.token_bytes(ord("a")) != b""


_ids = itertools.count()


def _greedy(stack, prompt, n):
    eng = stack.engine
    eng.add_request(f"greedy-{next(_ids)}", stack.tokenizer.encode(prompt),
                    SamplingParams(max_tokens=n, temperature=0.0))
    ids, text = [], ""
    while eng.has_unfinished():
        for o in eng.step():
            ids += o.delta_token_ids
            text += o.delta_text
    return ids, text


def test_greedy_fibonacci_deterministic(stack):
    a = _greedy(stack, FIB, 24)
    b = _greedy(stack, FIB, 24)
    assert a == b and a[0]
    fixture = NANO / "nano_eval.json"
    if fixture.is_file():  # recorded by the training script through the same stack (CPU fp32)
        item = next(i for i in json.loads(fixture.read_text())["items"] if i["prompt"] == FIB)
        assert a[0] == item["completion_ids"][: len(a[0])]


def test_embedded_default_is_nano():
    assert embedded_checkpoint().resolve() == NANO.resolve()


def test_mtp_draft_chain_matches_brute_force():
    """lab/nano/evaluate.py's chained drafts (spec §8.2) equal running the MTP layer over an
    explicitly extended row sequence, on the packaged weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab"))
    from nano import evaluate as ev
    from nano import model as nm

    from tailored.model.loader import load_checkpoint
    from tailored.synth import build_empty_model

    cfg = ModelConfig.from_dir(NANO)
    m = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(m, NANO, progress=False)
    seq = torch.tensor([load_tokenizer(NANO).encode(CODE)[:40]])
    with torch.no_grad():
        drafts, _ = ev.mtp_drafts(m, seq, 3)
        h, _ = nm.forward_hidden(m, seq, sdpa=False)
        c = nm.mtp_input(m, h[:, :-1], seq[:, 1:])
        g_tf, _ = nm.forward_mtp(m, h[:, :-1], seq[:, 1:], sdpa=False)
        assert torch.equal(nm.logits(m, g_tf).argmax(-1), drafts[..., 0])
        for t in (0, 17, 35):
            rows, g, d = c[:, : t + 1], g_tf[:, t], drafts[:, t, 0]
            for j in (2, 3):
                rows = torch.cat([rows, nm.mtp_input(m, g[:, None], d[:, None])], 1)
                cos, sin = nm.rope(rows.shape[1], cfg, "cpu")
                out, _ = nm.decoder_layer(m.mtp.layers[0], rows, cos, sin, cfg, sdpa=False)
                g = nm.rms1p(out[:, -1], m.mtp.norm.weight, cfg.rms_norm_eps)
                d = nm.logits(m, g).argmax(-1)
                assert torch.equal(d, drafts[:, t, j - 1])
