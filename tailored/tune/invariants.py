"""The contracts the engine relies on: each invariant of docs/architecture.md and each failure
class of ../shared/docs/failure-cases.md, named, with the tests that check it and what
`tailored tune` does about a candidate that could break it.

A test claims a contract with `@pytest.mark.contract("name")` (tests/conftest.py registers
the marker; `python -m pytest --contract NAME` runs only such tests). `docs/contracts.md` is
generated from this table and those markers (`python -m tailored.tune.invariants >
docs/contracts.md`); tests/house/test_contracts.py checks it is current, that every marker
names a contract here and that every contract has a test or says why not.

`tune` column: how a tune run keeps the contract for each candidate.
  probe   measure.py checks it on the candidate's own server before the benchmark
  static  space.refusals refuses the configurations known to break it, before a start
  gate    a candidate that may change numerics runs the accuracy gate (and the contract must
          allow numerics to change)
  tests   the marked tests, run once per tune with --contract-tests before the search (they
          check the code paths the candidates turn on, not one configuration)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# name: (what holds, where it is stated, how tune keeps it, why no CPU test if none)
CONTRACTS: dict[str, tuple[str, str, str, str]] = {
    "model-equals-transformers": (
        "the model's forward equals transformers' in fp32", "architecture", "tests, gate", ""),
    "kernel-equals-reference": (
        "every Triton kernel equals its reference op", "architecture", "tests", ""),
    "kernel-path-equals-plain": (
        "the kernel path equals the plain path; graph bodies equal eager steps",
        "architecture", "tests", ""),
    "graph-replay-equals-eager": (
        "a CUDA graph replay equals the eager step bitwise on the GPU", "architecture",
        "probe, tests", "CUDA graphs exist on the GPU only (tests/gpu/)"),
    "chunked-prefill-equals-single-pass": (
        "chunked prefill equals single-pass; prefill(T-1)+decode equals prefill(T)",
        "architecture; failure class 2", "probe, tests", ""),
    "mixed-step-isolation": (
        "a step leaves every slot and page outside its batch bit-identical",
        "architecture; failure class 1", "probe, tests", ""),
    "pools-return-to-baseline": (
        "pages and slots return to baseline after finish, abort and preemption",
        "architecture", "tests", ""),
    "prefix-cache-hit-equals-cold": (
        "a prefix-cache hit decodes as its cold run", "architecture; failure class 3",
        "probe, tests", ""),
    "prompt-logprobs-equal-reference": (
        "prompt logprobs equal the reference's log-softmax, alone, chunked, cached, batched",
        "architecture", "tests", ""),
    "spec-greedy-equals-plain": (
        "greedy output with speculative decoding equals without, stops inside accepted blocks",
        "architecture; failure classes 4, 5", "probe, static, tests", ""),
    "house-rules": (
        "layers import one way, files <= 600 lines, switches read only in flags.py",
        "architecture", "tests", ""),
    "identical-concurrent-greedy": (
        "N identical greedy prompts sent together get N identical answers",
        "failure class 1", "probe, tests", ""),
    "stops-and-usage": (
        "stop strings, EOS and max_tokens end where they must; usage equals what was returned",
        "failure class 5", "tests", ""),
    "quantized-numerics": (
        "quantized and reduced-precision paths stay within the accuracy gate",
        "failure class 6", "gate", "the gate itself (tailored gate) is the check"),
    "long-context": (
        "8k+ generations and long prompts match the reference at spot positions",
        "failure class 7", "tests", ""),
    "openai-api-behaviour": (
        "reasoning / content / tool calls / structured output split as the API says",
        "failure class 8", "tests", ""),
    "concurrency-soak": (
        "answers stay right under load, not just status codes", "failure class 9", "tests",
        ""),
    "step-budget-covers-decode": (
        "a step's token budget holds one decode token (plus drafts) of every running request",
        "tune", "static", "a configuration rule: space.refusals"),
    "config-consistent": (
        "options that depend on each other agree (spec_max_running <= max_num_seqs)", "tune",
        "static", "a configuration rule: space.refusals"),
}

# contracts a candidate's changed option touches (--contract-tests runs these)
TOUCHED_BY = {
    "max_num_batched_tokens": ("chunked-prefill-equals-single-pass", "step-budget-covers-decode"),
    "max_num_seqs": ("mixed-step-isolation", "identical-concurrent-greedy",
                     "pools-return-to-baseline"),
    "num_speculative_tokens": ("spec-greedy-equals-plain", "stops-and-usage"),
    "spec_max_running": ("spec-greedy-equals-plain", "config-consistent"),
    "prefix_cache_entries": ("prefix-cache-hit-equals-cold", "pools-return-to-baseline"),
    "prefill_graphs": ("graph-replay-equals-eager", "kernel-path-equals-plain"),
    "enforce_eager": ("graph-replay-equals-eager",),
    "gdn_state_dtype": ("quantized-numerics", "kernel-path-equals-plain"),
}


def _contract_marks(decorators) -> list[str]:
    out = []
    for d in decorators:
        nodes = d.elts if isinstance(d, (ast.List, ast.Tuple)) else [d]
        for n in nodes:
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "contract" and n.args
                    and isinstance(n.args[0], ast.Constant)):
                out.append(n.args[0].value)
    return out


def marked_tests(tests_dir: Path = REPO / "tests") -> dict[str, list[str]]:
    """{contract name: ['tests/x.py::test_y', ...]} from the markers in the source (ast)."""
    out: dict[str, list[str]] = {}
    for p in sorted(tests_dir.rglob("test_*.py")):
        tree = ast.parse(p.read_text(), str(p))
        rel = p.relative_to(tests_dir.parent).as_posix()
        module_marks = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
                module_marks += _contract_marks([node.value])
        for name in module_marks:
            out.setdefault(name, []).append(rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("test_"):
                for name in _contract_marks(node.decorator_list):
                    out.setdefault(name, []).append(f"{rel}::{node.name}")
    return out


def markdown(tests_dir: Path = REPO / "tests") -> str:
    marks = marked_tests(tests_dir)
    out = ["# Contracts", "",
           "What the engine relies on, each named, with the tests that check it "
           "(`@pytest.mark.contract(\"name\")`; `python -m pytest --contract NAME` runs them) "
           "and how `tailored tune` keeps it for a candidate configuration (docs/tune.md). "
           "Generated by `python -m tailored.tune.invariants > docs/contracts.md` from "
           "`tailored/tune/invariants.py` and the markers; a test checks it is current.", "",
           "tune: *probe* = checked on the candidate's server before its benchmark, *static* "
           "= configurations known to break it are refused before a start, *gate* = a "
           "candidate that may change numerics must pass the accuracy gate, *tests* = the "
           "marked tests, run once per tune run with `--contract-tests`.", "",
           "| contract | what holds | from | tune | tests |", "|---|---|---|---|---|"]
    for name, (what, src, tune, why_none) in CONTRACTS.items():
        tests = marks.get(name, [])
        shown = "<br>".join(f"`{t}`" for t in tests) or f"none on the CPU: {why_none}"
        out.append(f"| `{name}` | {what} | {src} | {tune} | {shown} |")
    return "\n".join(out) + "\n"


def touched(options: list[str]) -> list[str]:
    return sorted({c for o in options for c in TOUCHED_BY.get(o, ())})


if __name__ == "__main__":
    sys.stdout.write(markdown())
