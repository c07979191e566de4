"""`tailored gate` on the tiny preset (CPU, fp32): it passes, writes its report, and fails on a
perturbed engine. Plus the pieces it rests on: the frozen prompt set, the shared-weight
reference, the metrics' tie and breach logic."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from helpers import rel_err

from tailored.gate import metrics as M
from tailored.gate.prompts import DEFAULT_PROMPTS, REPO, load_prompts, sha256_file

pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread, gate_presets):  # conftest's, for every test of this module
    yield


def gate_args(*argv: str) -> argparse.Namespace:
    from tailored.gate.run import add_parser

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="command"))
    return ap.parse_args(["gate", *argv])


def test_gate_tiny_passes_and_writes_report(tmp_path):
    from tailored.gate.run import run

    out = tmp_path / "gate.json"
    assert run(gate_args("--preset", "tiny", "--report", str(out))) == 0
    r = json.loads(out.read_text())
    assert r["passed"] and not r["breaches"] and r["thresholds"]["section"] == "float32"
    o = r["overall"]
    assert o["top1"] == 1.0 and o["max_logit_err"] <= 1e-3 and o["greedy_match"] == o["prompts"] == 7
    m = r["manifest"]
    for k in ("commit", "torch", "transformers", "device", "checkpoint", "prompt_set", "dtype"):
        assert k in m
    assert m["dtype"] == "float32" and len(m["checkpoint"]["sha256"]) == 64
    assert m["prompt_set"]["sha256"] == sha256_file(DEFAULT_PROMPTS)
    longest = max(r["prompts"], key=lambda p: p["prompt_tokens"])
    assert longest["prompt_tokens"] >= 8192 and longest["greedy"]["match_len"] == 64


def test_gate_fails_on_a_nudged_weight(monkeypatch, tmp_path):
    """One weight of the engine's model changed after loading (the reference loads the
    checkpoint again) → a breach and exit code 1."""
    import tailored.stack
    from tailored.gate.run import run

    real = tailored.stack.build_stack

    def nudged(*a, **kw):
        stack = real(*a, **kw)
        with torch.no_grad():
            stack.engine.runner.model.model.layers[3].self_attn.o_proj.weight[0, 0] += 0.05
        return stack

    monkeypatch.setattr(tailored.stack, "build_stack", nudged)
    out = tmp_path / "gate.json"
    rc = run(gate_args("--preset", "tiny", "--only", "code,chinese", "--max-new-tokens", "16",
                       "--report", str(out)))
    r = json.loads(out.read_text())
    assert rc == 1 and not r["passed"]
    assert any("max_logit_err" in b for b in r["breaches"]), r["breaches"]


def test_gate_tiny_fp8_against_dequantized_and_bf16_references(tmp_path):
    """The FP8 twin of the tiny preset: exact (fp32) against its own dequantized weights, and
    the second comparison, against the bf16 weights it was quantized from, reported."""
    from tailored.gate.run import run

    out = tmp_path / "gate-fp8.json"
    assert run(gate_args("--preset", "tiny-fp8", "--only", "code,multi_turn",
                         "--max-new-tokens", "16", "--report", str(out))) == 0
    r = json.loads(out.read_text())
    assert r["manifest"]["precision"] == "fp8" and r["thresholds"]["section"] == "float32"
    assert r["overall"]["top1"] == 1.0 and r["overall"]["greedy_match"] == 2
    vb = r["vs_bf16_reference"]
    assert vb["source"].endswith("tiny-seed0") and len(vb["prompts"]) == 2
    assert vb["overall"]["max_logit_err"] > 1e-2  # FP8 rounding shows against the bf16 weights


def test_fp8_gate_with_shared_weights_consumes_the_engine_and_still_passes(tmp_path):
    """--reference-weights shared (the GPU default): the engine's cache, kernel path and FP8
    weights are released before the reference is built, and the verdict is the same."""
    from tailored.gate.run import run

    out = tmp_path / "gate-fp8-shared.json"
    assert run(gate_args("--preset", "tiny-fp8", "--only", "code", "--max-new-tokens", "8",
                         "--reference-weights", "shared", "--report", str(out))) == 0
    r = json.loads(out.read_text())
    assert r["manifest"]["reference_weights"] == "shared"
    assert r["overall"]["top1"] == 1.0 and r["overall"]["greedy_match"] == 1
    assert r["vs_bf16_reference"]["overall"]["max_logit_err"] > 1e-2


@pytest.mark.parametrize("preset", ["tiny-nvfp4", "tiny-nvfp4-ct"])
def test_gate_tiny_nvfp4_against_dequantized_and_bf16_references(preset, tmp_path):
    """The NVFP4 twins of the tiny preset (ModelOpt's and compressed-tensors' layouts): exact
    (fp32) against their own dequantized weights, and within the committed bound of
    thresholds.json's nvfp4-float32 section against the bf16 weights they came from."""
    from tailored.gate.run import run

    out = tmp_path / "gate-nvfp4.json"
    assert run(gate_args("--preset", preset, "--only", "code,multi_turn",
                         "--max-new-tokens", "16", "--report", str(out))) == 0
    r = json.loads(out.read_text())
    assert r["manifest"]["precision"] == "nvfp4" and r["thresholds"]["section"] == "nvfp4-float32"
    assert r["overall"]["top1"] == 1.0 and r["overall"]["greedy_match"] == 2
    vb = r["vs_bf16_reference"]
    assert vb["source"].endswith("tiny-seed0") and not vb["breaches"]
    assert vb["thresholds"]["max_kl_mean"] and vb["thresholds"]["min_top1"]  # enforced
    assert vb["overall"]["kl_mean"] > 0.1  # 4-bit rounding shows against the bf16 weights


def test_gate_nvfp4_bound_fails_a_wrong_layout(monkeypatch, tmp_path):
    """Nibbles read in the wrong order (and the pre-run check of the bf16 source skipped):
    the vs-bf16 bound of the nvfp4-float32 section breaches, exit code 1."""
    import tailored.gate.sources
    from tailored.gate.run import run
    from tailored.model import nvfp4

    real = nvfp4.unpack
    monkeypatch.setattr(nvfp4, "unpack",
                        lambda p: real(p).reshape(*p.shape, 2).flip(-1).flatten(-2))
    monkeypatch.setattr(tailored.gate.sources, "check_quantized_from", lambda *a: None)
    out = tmp_path / "gate.json"
    assert run(gate_args("--preset", "tiny-nvfp4", "--only", "code", "--max-new-tokens", "8",
                         "--report", str(out))) == 1
    r = json.loads(out.read_text())
    assert r["overall"]["top1"] == 1.0  # engine and dequantized reference agree, both wrong
    assert any(b.startswith("vs bf16 reference") for b in r["breaches"]), r["breaches"]


def test_gate_one_at_a_time_runs_each_prompt_alone(monkeypatch, tmp_path, capsys):
    """--one-at-a-time (kb/0042): each prompt goes through the engine alone, so every decode
    step has one row (the c=1 path); the gate still passes on the tiny preset and records the
    option in its manifest."""
    from tailored.gate import run as gate_run

    calls = []
    real = gate_run.engine_greedy

    def counting(engine, prompts, *a, **kw):
        calls.append(sorted(prompts))
        return real(engine, prompts, *a, **kw)

    monkeypatch.setattr(gate_run, "engine_greedy", counting)
    out = tmp_path / "gate.json"
    assert gate_run.run(gate_args("--preset", "tiny", "--only", "code,chinese",
                                  "--max-new-tokens", "8", "--one-at-a-time",
                                  "--report", str(out))) == 0
    assert calls == [["code"], ["chinese"]]
    # bad input stops before the engine is built, naming the flag (a fresh user's findings)
    for argv, msg in ((("--max-new-tokens", "0"), "--max-new-tokens"),
                      (("--only", ","), "names no prompt"),
                      (("--only", "code,chinese,code"), "names code more than once")):
        with pytest.raises(ValueError, match=msg):
            gate_run.run(gate_args("--preset", "tiny", "--one-at-a-time", *argv))
    r = json.loads(out.read_text())
    assert r["passed"] and r["overall"]["greedy_match"] == 2
    assert r["manifest"]["options"]["one_at_a_time"] is True
    gate_run._print_summary(r)  # the terminal says which mode ran, not only the report
    assert "gate PASSED (prompts one at a time)" in capsys.readouterr().out


def test_bf16_reference_is_checked_before_the_run(tmp_path, tiny_fp8_ckpt, monkeypatch):
    """A wrong --bf16-reference fails in seconds, before the engine is built: not a directory,
    an FP8 checkpoint, another seed's weights (not what the FP8 ones were quantized from), or
    given for a bf16 checkpoint."""
    import tailored.stack
    from tailored.gate.run import preset_checkpoint, run
    from tailored.synth import write_synthetic_checkpoint

    def no_build(*a, **kw):
        raise AssertionError("the engine was built before the reference was checked")

    monkeypatch.setattr(tailored.stack, "build_stack", no_build)
    other = write_synthetic_checkpoint(tmp_path / "seed1", "tiny", seed=1, progress=False)
    fp8 = str(preset_checkpoint("tiny-fp8"))
    for argv, msg in [((fp8, "--bf16-reference", str(tmp_path / "nope")), "no such checkpoint dir"),
                      ((fp8, "--bf16-reference", str(tiny_fp8_ckpt)), "itself an FP8"),
                      ((str(preset_checkpoint("tiny-nvfp4")), "--bf16-reference", str(other)),
                       "not what the NVFP4 weights"),
                      ((fp8, "--bf16-reference", str(other)), "not what the FP8 weights"),
                      ((str(preset_checkpoint("tiny")), "--bf16-reference", str(other)),
                       "FP8 and NVFP4 checkpoints only")]:
        with pytest.raises(ValueError, match=msg):
            run(gate_args(*argv))


def test_bf16_gate_measures_the_noise_floor(tmp_path):
    """bf16 sections compare transformers with itself (SDPA vs eager) in the same run and judge
    the engine relative to that floor; the tie gap used is at least the floor's max error. (The
    tiny random model in bf16 on the CPU plain path is far above its floor, kb/0001 and kb/0008:
    only the mechanics are checked here; the bf16 verdict is the H200 run's.)"""
    from tailored.gate.run import run

    out = tmp_path / "gate-bf16.json"
    rc = run(gate_args("--preset", "tiny", "--dtype", "bfloat16", "--only", "chinese",
                       "--max-new-tokens", "4", "--report", str(out)))
    r = json.loads(out.read_text())
    f = r["noise_floor"]
    assert rc in (0, 1) and f["implementation"] == "transformers attn sdpa vs eager"
    assert 0.5 < f["top1"] <= 1 and f["kl_mean"] > 0 and f["positions"] == r["overall"]["positions"]
    assert r["thresholds"]["tie_logit_gap"] >= f["max_logit_err"]
    assert r["thresholds"]["min_top1"] is None and "top1_decisive" in r["overall"]


def test_prompt_set_is_frozen_and_complete():
    """Chat texts are what our template renders; the categories are there; the long prompt is
    ≥ 8192 tokens; the goldens were made from this very file."""
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)  # no checkpoint: the built-in CHAT_TEMPLATE
    ps = load_prompts()
    assert {p.name for p in ps} >= {"code", "prose", "json", "chinese", "math", "multi_turn",
                                    "long_context"}
    for p in ps:
        if p.kind == "chat":
            assert tok.apply_chat_template(list(p.messages), enable_thinking=p.enable_thinking) == p.text
    assert sum(m["role"] == "user" for m in next(p for p in ps if p.name == "multi_turn").messages) >= 3
    assert len(next(p for p in ps if p.name == "long_context").encode(tok)) >= 8192
    golden = json.loads((REPO / "eval/golden/tiny/manifest.json").read_text())
    assert golden["prompt_set"]["sha256"] == sha256_file(DEFAULT_PROMPTS), \
        "prompt set changed: regenerate goldens (lab/make_golden.py, reason in kb/)"


def test_shared_reference_adopts_the_engine_tensors(tiny_model, hf_model):
    """Built on meta + assign: no copy, and it computes what a normally built HF model does."""
    from tailored.gate.reference import load_reference, reference_forward

    hf = load_reference(tiny_model.config, tiny_model, "shared", attn_impl="eager")
    ours = dict(tiny_model.named_parameters())
    for name, p in hf.named_parameters():
        assert p.data_ptr() == ours[name].data_ptr(), name
    ids = torch.randint(0, 248044, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    assert rel_err(reference_forward(hf, ids), want) <= 1e-6


def test_greedy_ties_and_breaches():
    # reference argmax 5 at step 2, engine chose 9 with a logit 1e-4 below: a tie under 2e-3
    g = M.compare_greedy([1, 2, 5, 7], [1, 2, 9, 3], [3.0] * 4, [3.0, 3.0, 2.9999, 1.0],
                         [2.0] * 4, 2e-3)
    assert g["match_len"] == 2 and g["tie"] and M.greedy_verdict(g, 4, 64) == "tie"
    g = M.compare_greedy([1, 2, 5], [1, 2, 9], [3.0] * 3, [3.0, 3.0, 2.5], [2.9] * 3, 2e-3)
    assert not g["tie"] and M.greedy_verdict(g, 3, 2) == "match"  # only 2 tokens required
    assert M.greedy_verdict(g, 3, 64) == "mismatch"
    o = {"top1": 0.99, "kl_mean": 0.0, "max_logit_err": 2e-3, "greedy_match_fraction": 1.0}
    b = M.breaches(o, {"min_top1": 0.995, "max_logit_err": 1e-3, "max_kl_mean": None,
                       "min_match_fraction": 0.95})
    assert len(b) == 2 and "top1" in b[0] and "max_logit_err" in b[1]
    assert M.scored_positions(10, 4, 0) == list(range(13))
    pos = M.scored_positions(8322, 64, 256)
    assert len(pos) == 256 and pos[0] == 0 and pos[-64:] == list(range(8321, 8385))  # T-1..T+N-2
