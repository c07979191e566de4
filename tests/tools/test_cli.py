"""`tailored serve` / `tailored synth` refuse bad input with one line (exit 2), before loading weights."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch

from tailored.cli import main
from tailored.stack import build_stack


@pytest.mark.parametrize("flags,msg", [
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--max-num-seqs", "-1"], "--max-num-seqs must be >= 1"),
    (["--num-layers", "0"], "--num-layers must be >= 1"),
    (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization must be in"),
    (["--device", "tpu"], "--device must be"),
    (["--gil-switch-interval-ms", "0"], "--gil-switch-interval-ms must be in"),
    (["--max-num-batched-tokens", "99999999999"], "--max-num-batched-tokens must be in 1..65536"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be in 0..8"),
    (["--num-speculative-tokens", "9"], "--num-speculative-tokens must be in 0..8"),
    (["--num-speculative-tokens", "1", "--spec-synthetic-acceptance", "1.5"],
     "--spec-synthetic-acceptance must be in [0, 1]"),
    (["--num-speculative-tokens", "1", "--spec-synthetic-acceptance", "nan"],
     "--spec-synthetic-acceptance must be in [0, 1]"),
    (["--spec-synthetic-acceptance", "0.5"], "needs --num-speculative-tokens >= 1"),
    (["--num-speculative-tokens", "1", "--spec-max-running", "0"],
     "--spec-max-running must be >= 1"),
    (["--spec-max-running", "4"], "--spec-max-running needs --num-speculative-tokens >= 1"),
    (["--speculative-method", "ngram"],
     "--speculative-method needs --num-speculative-tokens >= 1"),
    (["--num-speculative-tokens", "2", "--prompt-lookup-max", "3"],
     "--prompt-lookup-max/min need --speculative-method ngram or ngram+mtp"),
    (["--num-speculative-tokens", "2", "--speculative-method", "ngram", "--prompt-lookup-min",
      "5"], "--prompt-lookup-min must be in 1..--prompt-lookup-max, got 5 and 4"),
    (["--num-speculative-tokens", "2", "--speculative-method", "ngram", "--prompt-lookup-min",
      "0"], "--prompt-lookup-min must be in 1..--prompt-lookup-max, got 0 and 4"),
    (["--num-speculative-tokens", "2", "--spec-min-acceptance", "1.5"],
     "--spec-min-acceptance must be in [0, 1]"),
    (["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
])
def test_bad_serve_flags(tiny_ckpt, capsys, flags, msg):
    assert main(["serve", str(tiny_ckpt), "--port", "8197", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(tiny_ckpt, capsys):
    assert main(["serve", str(tiny_ckpt), "--device", "cuda", "--port", "8197"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU messages")
@pytest.mark.parametrize("interpret,dtype,msg", [
    ("0", "float32", "set TRITON_INTERPRET=1"),
    ("1", "bfloat16", "use --dtype float32"),
])
def test_kernels_on_the_cpu_refused_before_loading(tiny_ckpt, capsys, monkeypatch, interpret,
                                                   dtype, msg):
    """--kernels on without a GPU needs the interpreter and fp32 (bf16 gives NaN there)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert main(["serve", str(tiny_ckpt), "--kernels", "on", "--dtype", dtype,
                 "--port", "8197"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_busy_port_detected_before_loading(tiny_ckpt, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", str(tiny_ckpt), "--port", str(port)]) == 2
    assert "cannot listen" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["list_config", "llama", "missing_dir", "empty_dir",
                                  "corrupt_shard"])
def test_bad_checkpoints(tiny_ckpt, tmp_path, capsys, case):
    d = tmp_path / "c"
    if case == "list_config":
        d.mkdir()
        (d / "config.json").write_text("[1]")
    elif case == "llama":
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif case == "empty_dir":
        d.mkdir()
    elif case == "corrupt_shard":
        shutil.copytree(tiny_ckpt, d)
        shard = next(d.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:100_000])
    assert main(["serve", str(d), "--port", "8197"]) == 2
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    errs = [ln for ln in lines if "tailored serve: error:" in ln]
    assert len(errs) == 1 and "Traceback" not in "\n".join(lines)
    err = errs[0]
    assert {"list_config": "JSON object", "llama": "model_type='llama'", "missing_dir": "no such checkpoint directory",
            "empty_dir": "no config.json",
            "corrupt_shard": "cannot read shard"}[case] in err


def test_synth_onto_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["synth", str(f)]) == 2
    assert "File exists" in capsys.readouterr().err


def test_fewer_layers_than_the_first_attention_layer(tiny_ckpt):
    """--num-layers 3 keeps only GDN layers: no KV pages are needed and serving still works."""
    from tailored.engine.types import SamplingParams

    stack = build_stack(tiny_ckpt, num_layers=3, progress=False, max_model_len=256, max_num_seqs=2)
    eng = stack.engine
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finished and outs[-1].num_output_tokens == 3


def test_synth_on_cuda_without_a_gpu_is_one_line_and_leaves_nothing(tmp_path, capsys,
                                                                    monkeypatch):
    """`synth --device cuda` on a machine without a GPU: one error line, exit 2, no directory
    left behind (new-user trial, session 13: a PyTorch internals error and an empty OUT/)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "ck"
    assert main(["synth", str(out), "--preset", "tiny", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err and not out.exists()


def test_serve_refuses_an_unknown_log_level(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--log-level", "bogus"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def _serve_help_entries(capsys) -> dict[str, str]:
    """`tailored serve --help` as {option or positional: its help text, whitespace joined}."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    body = text[text.index("positional arguments:"):]
    entries: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        if line.startswith("  ") and not line.startswith("   "):  # a new entry: "  --opt X  help"
            head, _, rest = line.strip().partition("  ")
            name = head.split()[0].rstrip(",")
            entries[name] = rest.strip()
        elif line.startswith("   ") and name is not None:  # its help, continued
            entries[name] = f"{entries[name]} {line.strip()}".strip()
    entries.pop("-h", None)
    return entries


def test_every_serve_option_shows_help_and_its_default(capsys):
    """Every `tailored serve` option explains itself in --help and names its default."""
    import argparse

    from tailored import cli

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers())
    actions = [a for a in parser._subparsers._group_actions[0].choices["serve"]._actions
               if not isinstance(a, argparse._HelpAction)]
    entries = _serve_help_entries(capsys)
    assert len(entries) == len(actions)
    for a in actions:
        name = a.option_strings[0] if a.option_strings else a.dest
        text = entries[name]
        assert "(default: " in text, f"{name}: no default in its help: {text!r}"
        assert len(text.split("(default: ")[0].split()) >= 2, f"{name}: help too short: {text!r}"
        if a.default not in (None, False):
            assert f"(default: {a.default}" in text, f"{name}: help does not name {a.default!r}"


def test_speculative_flags_become_engine_config_fields():
    """The flags given (and only those) reach EngineConfig; vLLM's
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5} spelled as flags."""
    import argparse

    from tailored.cli import speculative_options
    from tailored.config import EngineConfig

    ns = argparse.Namespace(spec_max_running=None, speculative_method="ngram",
                            prompt_lookup_max=5, prompt_lookup_min=None,
                            spec_min_acceptance=0.0)
    kw = speculative_options(ns)
    assert kw == {"speculative_method": "ngram", "prompt_lookup_max": 5,
                  "spec_min_acceptance": 0.0}
    ec = EngineConfig(num_speculative_tokens=3, **kw)
    assert ec.uses_ngram and not ec.uses_mtp and ec.prompt_lookup_min == 2
    assert ec.spec_max_running == 2
