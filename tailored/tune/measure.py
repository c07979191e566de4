"""One candidate measured: its own `tailored serve`, the invariant probes, `tailored bench` on
the contract's traffic, and the accuracy gate where the candidate may change numerics.

The server is started and stopped as `tailored cluster` does its replicas (cluster.start,
cluster.get_json on /health, cluster.terminate of its process group).

Probes (invariants.py, tune column 'probe'), on the candidate's server before the benchmark:
  identical-concurrent-greedy: PROBE_COPIES copies of one greedy prompt sent together must
      get one answer;
  greedy-equals-defaults: the probe prompts' greedy answers, one at a time and then together,
      must equal the defaults' (the baseline's). An option an invariant covers (token budget,
      running requests, drafting, prefix cache, graphs) must not change them; when they do
      differ, the candidate is treated as numerics-changing: the gate decides, or the
      contract's `numerics.may_change: false` rejects it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tailored import cluster
from tailored.tune import space as sp

PROBE_PROMPTS = ("def fibonacci(n):", "def fibonacci(n):\n    if n < 2:\n        return n\n",
                 "class Stack:\n    def __init__(self):", "import os\n\n\ndef walk(path):")
PROBE_COPIES = 4
PROBE_TOKENS = 16


class CandidateFailed(RuntimeError):
    """The candidate's server did not start or died; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`with Server(args, env, log, timeout) as url:` a `tailored serve` child on a free port."""

    def __init__(self, serve_args: list[str], env: dict, log: Path, startup_timeout_s: float):
        self.serve_args, self.env, self.log = serve_args, env, log
        self.timeout = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "tailored.cli", "serve", *self.serve_args,
               "--host", "127.0.0.1", "--port", str(port), "--access-log", "off"]
        if "--log-level" not in self.serve_args:
            cmd += ["--log-level", "warning"]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = cluster.start(cmd, self.log, self.env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout
        while cluster.get_json(url + "/health")[0] != 200:
            if self.proc.poll() is not None:
                raise CandidateFailed(f"server exited with code {self.proc.returncode}: "
                                      f"{cluster.tail(self.log, 3).strip()}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise CandidateFailed(f"server not healthy within {self.timeout:g} s")
            time.sleep(cluster.POLL_S)
        return url

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            cluster.terminate([self.proc], 20.0, lambda: False)
            self.proc = None


def _complete(url: str, prompt: str) -> str:
    import httpx

    r = httpx.post(url + "/v1/completions", timeout=120, trust_env=False, json={
        "model": "qwen36-35b-a3b", "prompt": prompt, "max_tokens": PROBE_TOKENS,
        "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def probe(url: str) -> dict:
    """Greedy answers: each probe prompt alone, then all together, then PROBE_COPIES copies."""
    alone = [_complete(url, p) for p in PROBE_PROMPTS]
    with ThreadPoolExecutor(max(len(PROBE_PROMPTS), PROBE_COPIES)) as ex:
        together = list(ex.map(lambda p: _complete(url, p), PROBE_PROMPTS))
        copies = list(ex.map(lambda p: _complete(url, p), [PROBE_PROMPTS[0]] * PROBE_COPIES))
    return {"alone": alone, "together": together, "copies": copies}


def probe_verdict(got: dict, baseline: dict | None) -> tuple[list[str], bool]:
    """(broken contracts, outputs differ from the defaults')."""
    broken = []
    if len(set(got["copies"])) != 1:
        broken.append("identical-concurrent-greedy: identical greedy prompts sent together "
                      "got different answers")
    differs = baseline is not None and (got["alone"] != baseline["alone"]
                                        or got["together"] != baseline["together"])
    return broken, differs


def bench_command(contract, url: str, out: Path, token_hi: int, cand: dict) -> list[str]:
    t, slo = contract.traffic, contract.slo
    cmd = [sys.executable, "-m", "tailored.cli", "bench", "--base-url", url, "--out", str(out),
           "--num-warmups", "1", "--label", out.stem, "--no-uvloop",
           "--engine-config", json.dumps(cand, sort_keys=True),
           "--num-prompts", str(t.requests)]
    if slo.ttft_p99_ms:
        cmd += ["--slo-ttft-ms", f"{slo.ttft_p99_ms:g}"]
    if slo.itl_p99_ms:
        cmd += ["--slo-itl-ms", f"{slo.itl_p99_ms:g}"]
    if t.prompts == "random":
        cmd += ["--input-len", str(t.input_tokens), "--output-len", str(t.output_tokens),
                "--ignore-eos", "--token-id-range", f"0,{token_hi}"]
    elif t.prompts == "chat-mix":
        cmd += ["--workload", "chat-mix"]
    elif t.prompts == "agent-mix":
        sh = t.shared_prefix
        cmd += ["--workload", "agent-mix", "--output-len", str(t.output_tokens)]
        if sh is not None:
            cmd += ["--agent-system-prompts", str(sh.system_prompts), "--agent-system-tokens",
                    str(sh.tokens), "--agent-turns", str(sh.turns), "--agent-conversations",
                    str(sh.conversations)]
    else:
        cmd += ["--prompt-file", t.prompts]
    if t.request_rate is not None:
        cmd += ["--request-rate", f"{t.request_rate:g}"]
    if t.concurrency is not None:
        cmd += ["--concurrency", str(t.concurrency)]
    return cmd


METRICS = ("output_throughput", "request_throughput", "p50_ttft_ms", "p99_ttft_ms",
           "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_e2el_ms",
           "request_goodput", "completed", "failed")


def run_bench(contract, url: str, out: Path, token_hi: int, cand: dict, env: dict,
              timeout_s: float) -> dict:
    cmd = bench_command(contract, url, out, token_hi, cand)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if not out.is_file():
        raise CandidateFailed(f"tailored bench wrote no result (exit {p.returncode}): "
                              f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    run = json.loads(out.read_text())["runs"][0]
    return {k: run.get(k) for k in METRICS}


def gate_prompts(contract, on_gpu: bool) -> list[str]:
    if contract.numerics.gate_prompts:
        return list(contract.numerics.gate_prompts)
    t = contract.traffic
    names = ["code"]
    if t.structured_share > 0:
        names.append("json")
    if t.tool_share > 0 or t.has_shared_prefix:
        names.append("multi_turn")
    if t.long_context_share > 0 and on_gpu:  # the 8k prompt: minutes on a CPU
        names.append("long_context")
    return names


def run_gate(contract, ckpt: Path, cand: dict, report: Path, env: dict, on_gpu: bool,
             timeout_s: float) -> dict:
    """`tailored gate` on the candidate's numerics: its switches and GDN state dtype, its
    token budget. Returns {passed, breaches, prompts, report}."""
    names = gate_prompts(contract, on_gpu)
    cmd = [sys.executable, "-m", "tailored.cli", "gate", str(ckpt), "--only", ",".join(names),
           "--max-new-tokens", str(contract.numerics.gate_max_new_tokens),
           "--max-num-batched-tokens", str(cand["max_num_batched_tokens"]),
           "--report", str(report)]
    if not on_gpu:
        cmd += ["--device", "cpu"]
    genv = dict(env, TAILORED_GDN_STATE_DTYPE=str(cand.get("gdn_state_dtype") or "auto"))
    p = subprocess.run(cmd, capture_output=True, text=True, env=genv, timeout=timeout_s)
    if not report.is_file():
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:]
        return {"passed": False, "breaches": [f"gate did not run (exit {p.returncode}): "
                                              f"{' '.join(tail)}"], "prompts": names}
    r = json.loads(report.read_text())
    return {"passed": bool(r["passed"]), "breaches": r.get("breaches", []), "prompts": names,
            "report": str(report), "seconds": round(r.get("timings", {}).get("total_s", 0), 1)}


def child_env(cand: dict) -> dict:
    """The environment of a candidate's server: this one's, with its switches (the contract's
    search wins over a TAILORED_* set outside)."""
    env = dict(os.environ)
    env.update(sp.switch_env(cand))
    # the children import this tailored (a worktree may differ from the installed one)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != root])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
