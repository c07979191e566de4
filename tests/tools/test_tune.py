"""`tailored tune` (docs/tune.md): the contract's validation, the space's numerics rules, profiles
and `serve --profile`, and one end-to-end run on the nano model, interrupted and continued."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tailored.cli import main
from tailored.stack import embedded_checkpoint
from tailored.tune import profile as prof, space as sp
from tailored.tune.contract import ContractError, load_contract, parse_contract

pytest.importorskip("optuna")
REPO = Path(__file__).resolve().parents[2]
TRAFFIC = {"concurrency": 2}


@pytest.mark.parametrize("data,field,fix", [
    ({"name": "x", "traffic": {"concurrency": 0}}, "traffic.concurrency", "requests in flight"),
    ({"name": "x", "traffic": {"concurency": 2}}, "traffic.concurency",
     "did you mean 'concurrency'"),
    ({"name": "x"}, "traffic", "traffic fields"),
    ({"name": "x", "traffic": {}}, "traffic", "traffic.concurrency or traffic.request_rate"),
    ({"name": "x", "traffic": TRAFFIC, "slo": {"ttft_p99_ms": -5}}, "slo.ttft_p99_ms", "> 0"),
    ({"name": "x", "traffic": TRAFFIC, "precision": "fp4"}, "precision", "bf16 or fp8"),
    ({"name": "bad name!", "traffic": TRAFFIC}, "name", "letters, digits"),
    ({"name": "x", "traffic": TRAFFIC, "numerics": {"may_change": "perhaps"}},
     "numerics.may_change", "gate"),
    ({"name": "x", "traffic": TRAFFIC, "memory": {"gpu_memory_utilization": 1.5}},
     "memory.gpu_memory_utilization", "(0, 1]"),
])
def test_contract_errors_name_the_field_and_the_fix(data, field, fix):
    with pytest.raises(ContractError) as e:
        parse_contract(data, "c.yaml")
    line = str(e.value)
    assert line.startswith(f"c.yaml: {field}: ") and "fix:" in line and fix in line


@pytest.mark.parametrize("over,needle", [
    ({"traffic": {"concurrency": 2, "prompts": "no/such/file.jsonl"}},
     "traffic.prompts: no such prompt file"),
    ({"traffic": {"concurrency": 2, "prompts": "BAD"}}, "traffic.prompts: "),
    ({"search": {"fixed": {"max_num_seqs": 0}}},
     "search.fixed.max_num_seqs: --max-num-seqs must be >= 1, got 0"),
    ({"search": {"fixed": {"num_speculative_tokens": 9}}},  # serve's bound (cli's message)
     "search.fixed.num_speculative_tokens: --num-speculative-tokens must be in 0..8, got 9"),
    ({"search": {"fixed": {"prefill_graphs": "sometimes"}}}, "search.fixed.prefill_graphs"),
    ({"search": {"fixed": {"enforce_eager": "yes"}}}, "search.fixed.enforce_eager"),
    ({"search": {"fixed": {"TAILORED_MOE_W8A8_FROM": -3}}}, "search.fixed.TAILORED_MOE_W8A8"),
    ({"traffic": {"concurrency": 2, "input_tokens": 900, "output_tokens": 200},
      "memory": {"max_model_len": 1024}}, "memory.max_model_len: 1024 <"),
])
def test_tune_refuses_a_contract_whose_trials_would_all_fail_before_starting_anything(
        tmp_path, capsys, over, needle):
    """Checked in a second, before any server starts (exit code 2, the field named)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    data = {"name": "x", "traffic": {"concurrency": 2}, **over}
    if data["traffic"].get("prompts") == "BAD":
        data["traffic"]["prompts"] = str(bad)
    (tmp_path / "c.yaml").write_text(json.dumps(data))
    rc = main(["tune", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_a_pinned_value_is_judged_alone_with_serves_rule():
    """tune checks a pinned option by serve's rule for it alone (server/serve_rules.py):
    spec_max_running without num_speculative_tokens is fine (that one may be searched),
    though serve refuses it alone on its command line (tests/tools/test_cli.py)."""
    from tailored.tune.preflight import check_fixed

    check_fixed({"spec_max_running": 4, "gdn_state_dtype": "bfloat16"}, {})
    with pytest.raises(ValueError, match="search.fixed.spec_max_running: --spec-max-running "
                                         "must be an integer, got 2.5"):
        check_fixed({"spec_max_running": 2.5}, {})


def test_the_docs_example_contracts_load(tmp_path):
    """docs/tune.md's two example contracts are valid contracts as written."""
    text = (REPO / "docs" / "tune.md").read_text()
    blocks = re.findall(r"<!-- contract -->\n```yaml\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    names = []
    for i, b in enumerate(blocks):
        p = tmp_path / f"c{i}.yaml"
        p.write_text(b)
        names.append(load_contract(p).name)
    assert {"coding-assistant", "batch-summariser"} <= set(names)


def _target(on_gpu=False):
    return sp.Target(on_gpu=on_gpu, has_mtp=True,
                     model_dtype="bfloat16" if on_gpu else "float32")


def test_numerics_changes_and_refusals():
    t = _target()
    base = sp.serve_defaults(t)
    # covered by an invariant: no numerics change claimed (the probe still checks outputs)
    assert sp.numerics_changes(dict(base, max_num_seqs=4, num_speculative_tokens=2), base, t) == []
    assert sp.numerics_changes(dict(base, gdn_state_dtype="bfloat16"), base, t) == ["gdn_state_dtype"]
    assert sp.numerics_changes(dict(base, gdn_state_dtype="float32"), base, t) == []  # = auto
    assert sp.numerics_changes(dict(base, TAILORED_MOE_GEMV_UP_TO=4), base, t) == \
        ["TAILORED_MOE_GEMV_UP_TO"]
    assert sp.numerics_changes(dict(base, TAILORED_PDL=False), base, t) == []  # bitwise
    bad = sp.normalize(dict(base, max_num_seqs=64, max_num_batched_tokens=128,
                            num_speculative_tokens=2, spec_max_running=128))
    why = sp.refusals(bad)
    assert any(w.startswith("step-budget-covers-decode") for w in why)
    assert any(w.startswith("config-consistent") for w in why)
    assert sp.refusals(sp.normalize(base)) == []


def test_a_contract_that_forbids_numerics_changes_searches_none():
    c = parse_contract({"name": "x", "traffic": TRAFFIC, "search": {"switches": "all"}})
    s = sp.build_space(c, _target(on_gpu=True))
    changing = [k for k, f in sp.tunable_switches().items() if f.metadata["numerics"]]
    assert "gdn_state_dtype" not in s.choices and not set(changing) & set(s.choices)
    assert "TAILORED_PDL" in s.choices and "max_num_seqs" in s.choices
    # the step budget: searched on the GPU under load, with numerics held (a covered option)
    assert "prefill_stall_factor" not in s.choices  # concurrency 2: nothing decodes beside
    busy = sp.build_space(parse_contract({"name": "x", "traffic": {"concurrency": 64}}),
                          _target(on_gpu=True))
    assert busy.choices["prefill_stall_factor"] == [0.0, 2.0, 2.5, 3.0]
    assert sp.serve_args(dict(busy.defaults, prefill_stall_factor=2.5))[-2:] == \
        ["--prefill-stall-factor", "2.5"]
    c2 = parse_contract({"name": "x", "traffic": TRAFFIC, "numerics": {"may_change": True},
                         "search": {"switches": "all"}})
    assert set(changing) <= set(sp.build_space(c2, _target(on_gpu=True)).choices)
    with pytest.raises(ValueError, match="search.switches: TAILORED_NOPE"):
        sp.build_space(parse_contract({"name": "x", "traffic": TRAFFIC,
                                       "search": {"switches": ["TAILORED_NOPE"]}}), _target())


def _nano_profile(**over):
    from tailored.bench.results import checkpoint_fingerprint

    kw = dict(engine={"max_num_seqs": 3, "max_num_batched_tokens": 512},
              switches={"TAILORED_PDL": False},
              checkpoint=checkpoint_fingerprint(embedded_checkpoint()), precision="bf16",
              gpu="cpu")
    kw.update(over)
    return prof.make_profile("nano-test", **kw)


@pytest.mark.parametrize("over,needle", [
    ({"precision": "fp8"}, "made for fp8 weights"),
    ({"gpu": "H200"}, "made for GPU kind 'H200'"),
    ({"checkpoint": {"path": "/elsewhere", "sha256": "0" * 64}}, "made for checkpoint /elsewhere"),
])
def test_serve_refuses_a_profile_made_for_something_else(tmp_path, capsys, over, needle):
    p = prof.write_profile(tmp_path / "p.yaml", _nano_profile(**over))
    assert main(["serve", "--profile", str(p), "--port", "1"]) == 2
    assert needle in capsys.readouterr().err


def test_a_hand_edited_profile_is_refused(tmp_path, capsys):
    p = prof.write_profile(tmp_path / "p.yaml", _nano_profile())
    p.write_text(p.read_text().replace("max_num_seqs: 3", "max_num_seqs: 4"))
    assert main(["serve", "--profile", str(p)]) == 2
    assert "sha256 does not match" in capsys.readouterr().err


@pytest.mark.parametrize("field,value,needle", [
    ("engine", None, "field 'engine' must be a mapping"),
    ("precision", 5, "field 'precision' must be a string"),
    ("gpu", 5, "field 'gpu' must be a string"),
    ("engine", {"max_num_seqs": [1, 2]}, "must be single values"),
    ("engine", {"max_num_seqs": "abc"}, "engine option 'max_num_seqs' is str 'abc', the option takes a number"),
])
def test_a_rehashed_profile_with_bad_types_gets_an_error_not_a_traceback(
        tmp_path, capsys, field, value, needle):
    """An edit that also recomputed the hash passes the sha256 check: the types are checked."""
    import yaml

    p = _nano_profile()
    p[field] = value
    p["sha256"] = prof.profile_hash(p)
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(p, sort_keys=False))
    assert main(["serve", "--profile", str(f), "--port", "1"]) == 2
    assert needle in capsys.readouterr().err


def test_explicit_options_win_over_the_profile():
    import argparse

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    from tailored.cli import _serve_parser

    sp_ = _serve_parser(sub)
    argv = ["--max-num-seqs", "5", "--page-size", "16"]
    explicit = prof.explicit_options(sp_, argv)
    assert explicit == {"max_num_seqs", "page_size"}
    args = ap.parse_args(["serve", *argv])
    p = _nano_profile()
    applied = prof.apply_to_args(args, p, explicit)
    assert args.max_num_seqs == 5 and args.max_num_batched_tokens == 512
    assert applied == {"max_num_batched_tokens": 512} and p["kept"] == {"max_num_seqs": 5}


CONTRACT = textwrap.dedent("""\
    name: nano-ci
    traffic: {input_tokens: 48, output_tokens: 8, concurrency: 2, num_prompts: 4}
    slo: {ttft_p99_ms: 10000}
    numerics: {may_change: true, gate_max_new_tokens: 4}
    search:
      trials: 3
      seed: 1
      options: [max_num_seqs, num_speculative_tokens, gdn_state_dtype]
    """)


def _tune(tmp_path, *extra):
    cmd = [sys.executable, "-m", "tailored.cli", "tune", str(tmp_path / "c.yaml"), "--out",
           str(tmp_path / "out"), "--kb", str(tmp_path / "kb"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tune run on the nano model: stopped after one candidate, then continued."""
    d = tmp_path_factory.mktemp("tune")
    (d / "c.yaml").write_text(CONTRACT)
    (d / "kb").mkdir()
    (d / "kb" / "README.md").write_text("# kb\n")
    first = _tune(d, "--stop-after", "1")
    second = _tune(d)
    return d, first, second


def test_tune_runs_end_to_end_and_resumes(tuned):
    d, first, second = tuned
    assert first.returncode == 0, first.stderr[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    assert "1/3 candidates: rerun to continue" in first.stderr
    assert "resuming: the defaults and 1 trial(s) already measured" in second.stderr
    rep = json.loads((d / "out" / "report.json").read_text())
    assert rep["complete"] and [t["trial"] for t in rep["trials"]] == [0, 1, 2, 3]
    # the first invocation's trial is in the report as measured then, not measured again
    assert re.search(r"^\s+1 (kept|rejected)", first.stderr, re.M)
    assert len(re.findall(r"^\s+1 (kept|rejected)", second.stderr, re.M)) == 0
    assert rep["pareto_front"] and rep["chosen"]["trial"] in [t["trial"] for t in rep["trials"]]
    assert rep["gain"]["output_throughput"]["defaults"] > 0
    assert rep["manifest"]["checkpoint"]["sha256"] and rep["manifest"]["optuna"]
    for t in rep["trials"]:
        assert t["status"] in ("kept", "rejected") and t["why"]
        if t["numerics"]["changes"]:  # a numerics-changing candidate ran the gate
            assert t["status"] == "rejected" and "refused" in t["why"] or t["numerics"]["gate"]
    assert (d / "out" / "tune.png").read_bytes()[:4] == b"\x89PNG"
    p = prof.load_profile(d / "out" / "profile.yaml")
    assert p["name"] == "nano-ci" and p["gpu"] == "cpu"
    kb = list((d / "kb" / "tune").glob("*-nano-ci.jsonl"))
    assert len(kb) == 1 and len(kb[0].read_text().splitlines()) == 5  # 4 trials + the choice
    index = [ln for ln in (d / "kb" / "README.md").read_text().splitlines() if "nano-ci" in ln]
    assert len(index) == 1 and "3 candidates" in index[0]


def test_serve_applies_the_profile_and_reports_it(tuned, tmp_path):
    import httpx

    from tailored.tune.measure import Server, child_env

    d, _, _ = tuned
    p = prof.load_profile(d / "out" / "profile.yaml")
    log = tmp_path / "serve.log"
    with Server(["--profile", str(d / "out" / "profile.yaml"), "--max-num-batched-tokens",
                 "300", "--log-level", "info"], child_env({}), log, 120) as url:
        v = httpx.get(url + "/version", trust_env=False).json()
        m = httpx.get(url + "/metrics", trust_env=False).text
    assert v["profile"]["name"] == "nano-ci" and v["profile"]["sha256"] == p["sha256"]
    assert f'profile="nano-ci",sha256="{p["sha256"]}"' in m
    text = log.read_text()
    assert "profile nano-ci" in text and "kept from the command line: max_num_batched_tokens=300" in text
