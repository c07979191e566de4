#!/usr/bin/env python3
"""Issue 50, scale-out: N replicas behind the SMG gateway (`tailored cluster`), driven through
the gateway by `tailored bench` (docs/scale-out.md#measured).

Three parts, each on a fresh cluster (cold prefix caches), results in --out-dir:

1. throughput: for N in --replicas, random --input-len/--output-len prompts (ignore_eos) at
   concurrency --conc-per-replica x N (--prompts-per-stream x that many prompts), cache-aware
   policy -> throughput-N{N}.json; per replica (= per GPU) against N, target >= 0.95 x N x
   the N = 1 throughput;
2. agent mix at N = --agent-replicas, once with --policy cache_aware, once round_robin ->
   agent-{policy}.json: cached prompt tokens (the replicas' usage) and TTFT p50; target:
   cache-aware >= 2x the cached tokens of round robin, and a lower TTFT p50;
3. kill: N = --agent-replicas, random prompts at the throughput part's concurrency, replica 0
   SIGKILLed --kill-after-s seconds into the run -> kill.json: requests sent, succeeded (whole
   answer: finish_reason length, max_tokens tokens), failed with a visible error, lost
   silently (taken for whole but cut, or never answered: must be 0), and how the requests
   sent after the kill fared.

summary.json gathers the numbers; commands.txt has every command run.

GPU host (N = 1, 2, 4, 8; one replica a GPU; FP8 dummy weights):
    python lab/cluster_sweep.py --out-dir bench/results/DATE-cluster-h100-fp8 \\
        --replicas 1,2,4,8 --agent-replicas 2 -- /models/Qwen3.6-35B-A3B-FP8 \\
        --load-format dummy --prefix-cache-entries 64 --max-model-len 32768
CPU (nano replicas, 2 cores; see the --cpu defaults):
    python lab/cluster_sweep.py --cpu --out-dir bench/results/2026-12-07-cluster-nano-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tailored.bench import loadgen, results  # noqa: E402

GPU = dict(replicas="1,2,4,8", agent_replicas=2, conc_per_replica=32, input_len=1024,
           output_len=512, prompts_per_stream=4,
           agent_args="--agent-system-prompts 4 --agent-conversations 128 --agent-turns 6 "
                      "--agent-system-tokens 8000 --agent-tool-tokens 400 --output-len 128 "
                      "--concurrency 64",
           kill_after_s=20.0, kill_output_len=512, serve_args=[])
CPU = dict(replicas="1,2", agent_replicas=2, conc_per_replica=4, input_len=64, output_len=32,
           prompts_per_stream=12,
           agent_args="--agent-system-prompts 4 --agent-conversations 16 --agent-turns 4 "
                      "--agent-system-tokens 1000 --agent-tool-tokens 100 --output-len 16 "
                      "--concurrency 4",
           kill_after_s=3.0, kill_output_len=96,
           serve_args=["--prefix-cache-entries", "64", "--max-num-seqs", "8",
                       "--max-model-len", "8192"])


class Sweep:
    def __init__(self, a):
        self.a = a
        self.out = Path(a.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = Path(a.log_dir or tempfile.mkdtemp(prefix="cluster-sweep-"))
        self.commands: list[str] = []
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")]))
        if a.cpu:  # one torch thread a replica: N replicas share the cores
            self.env["OMP_NUM_THREADS"] = "1"

    def log(self, msg: str) -> None:
        print(f"[cluster_sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    # ---- the cluster -----------------------------------------------------------------
    def start(self, n: int, policy: str, tag: str) -> tuple[subprocess.Popen, dict]:
        d = self.logs / tag
        d.mkdir(parents=True, exist_ok=True)
        state_file = d / "state.json"
        state_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tailored.cli", "cluster", "--replicas", str(n),
               "--port", str(self.a.port), "--policy", policy, "--log-dir", str(d),
               "--state-file", str(state_file), "--shutdown-timeout", "5"]
        if self.a.gateway_args:
            cmd += ["--gateway-args", self.a.gateway_args]
        cmd += ["--", *self.a.serve_args]
        self.commands.append(("OMP_NUM_THREADS=1 " if self.a.cpu else "") + shlex.join(cmd))
        self.log(f"starting {n} replica(s), {policy}: logs in {d}")
        proc = subprocess.Popen(cmd, env=self.env, cwd=REPO, stdout=open(d / "cluster.out", "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.a.startup_timeout
        while not state_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop(proc)
                raise RuntimeError(f"the cluster did not start; see {d / 'cluster.out'}")
            time.sleep(0.5)
        return proc, json.loads(state_file.read_text())

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)  # the second Ctrl-C kills everything
                proc.wait(30)

    # ---- tailored bench ------------------------------------------------------------
    def bench(self, url: str, name: str, extra: list[str], engine_config: dict) -> dict:
        out = self.out / f"{name}.json"
        cmd = [sys.executable, "-m", "tailored.bench", "--base-url", url, "--label", name,
               "--engine-config", json.dumps(engine_config), "--out", str(out), *extra]
        self.commands.append(shlex.join(cmd))
        self.log(f"bench {name}")
        subprocess.run(cmd, env=self.env, cwd=REPO, check=False)
        return json.loads(out.read_text())

    def engine_config(self, n: int, policy: str) -> dict:
        return {"replicas": n, "policy": policy, "gateway": "smg (tailored cluster)",
                "serve_args": self.a.serve_args, "gateway_args": self.a.gateway_args,
                "cpu": self.a.cpu}

    def random_args(self, conc: int, output_len: int | None = None) -> list[str]:
        a = self.a
        return ["--input-len", str(a.input_len), "--output-len", str(output_len or a.output_len),
                "--ignore-eos", "--concurrency", str(conc), "--num-prompts",
                str(a.prompts_per_stream * conc), "--random-text"]

    # ---- the three parts ---------------------------------------------------------------
    def throughput(self) -> list[dict]:
        rows = []
        for n in [int(x) for x in self.a.replicas.split(",")]:
            conc = self.a.conc_per_replica * n
            proc, state = self.start(n, "cache_aware", f"throughput-N{n}")
            try:
                res = self.bench(state["gateway"]["url"], f"throughput-N{n}",
                                 self.random_args(conc), self.engine_config(n, "cache_aware"))
            finally:
                self.stop(proc)
            r = res["runs"][0]
            rows.append({"replicas": n, "concurrency": conc, "completed": r["completed"],
                         "failed": r["failed"], "output_tok_s": r["output_throughput"],
                         "output_tok_s_per_replica": r["output_throughput"] / n,
                         "p50_ttft_ms": r["p50_ttft_ms"], "p50_tpot_ms": r["p50_tpot_ms"]})
        single = rows[0]["output_tok_s"] if rows and rows[0]["replicas"] == 1 else None
        for row in rows:
            if single:
                row["scaling"] = row["output_tok_s"] / (row["replicas"] * single)
                row["target_met"] = row["scaling"] >= 0.95
        return rows

    def agent(self) -> dict:
        n, out = self.a.agent_replicas, {}
        for policy in ("cache_aware", "round_robin"):
            proc, state = self.start(n, policy, f"agent-{policy}")
            try:
                res = self.bench(state["gateway"]["url"], f"agent-{policy}",
                                 ["--workload", "agent-mix", *shlex.split(self.a.agent_args)],
                                 self.engine_config(n, policy))
            finally:
                self.stop(proc)
            r = res["runs"][0]
            out[policy] = {"completed": r["completed"], "failed": r["failed"],
                           "prompt_tokens": r["agent"]["prompt_tokens"],
                           "cached_tokens": r["agent"]["cached_tokens"],
                           "cached_fraction": r["agent"]["cached_fraction"],
                           "p50_ttft_ms": r["p50_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                           "per_turn": r["agent"]["per_turn"]}
        ca, rr = out["cache_aware"], out["round_robin"]
        out["replicas"] = n
        out["cached_ratio"] = ca["cached_tokens"] / rr["cached_tokens"] \
            if rr["cached_tokens"] else float("inf")
        out["target_met"] = out["cached_ratio"] >= 2 and ca["p50_ttft_ms"] < rr["p50_ttft_ms"]
        return out

    def kill(self) -> dict:
        a, n = self.a, self.a.agent_replicas
        conc = a.conc_per_replica * n
        out_len = a.kill_output_len
        proc, state = self.start(n, "cache_aware", "kill")
        victim = state["replicas"][0]
        w = loadgen.Workload(base_url=state["gateway"]["url"], concurrency=conc,
                             num_prompts=a.prompts_per_stream * conc, input_len=a.input_len,
                             output_len=out_len, ignore_eos=True, num_warmups=0,
                             random_text=True, request_timeout_s=600)
        self.commands.append(f"# in-process: {w}; SIGKILL replica 0 (pid {victim['pid']}) "
                             f"{a.kill_after_s} s into the run")
        killed_at: list[float] = []
        t_start = time.perf_counter()

        def kill_it():
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at.append(time.perf_counter() - t_start)
            self.log(f"killed replica 0 (pid {victim['pid']}) at {killed_at[0]:.1f} s")

        timer = threading.Timer(a.kill_after_s, kill_it)
        timer.start()
        try:
            run = asyncio.run(loadgen.run_once(w, keep_requests=True))
        finally:
            timer.cancel()
            survivors = self.replica_health(state)
            self.stop(proc)
        reqs = run["requests"]
        for r in reqs:
            r.pop("itl_s")  # the file stays small; the run's ITL percentiles keep them
        whole = [r for r in reqs if r["ok"] and r["finish_reason"] in ("length", "stop")
                 and r["output_tokens"] == out_len]
        visible = [r for r in reqs if not r["ok"] and r["error"]]
        t_kill = killed_at[0] if killed_at else float("inf")
        after = [r for r in reqs if r["start_s"] > t_kill]
        summary = {
            "replicas": n, "concurrency": conc, "killed": "replica 0", "killed_at_s": t_kill,
            "sent": w.num_prompts, "answered": len(reqs), "succeeded": len(whole),
            "failed_visible": len(visible),
            "lost_silently": w.num_prompts - len(whole) - len(visible),
            "errors": run["errors"], "sent_after_kill": len(after),
            "succeeded_after_kill": sum(1 for r in after if r in whole),
            "replica_health_after": survivors,
        }
        res = results.make_result("kill", results.build_manifest(
            base_url=None, engine_config=self.engine_config(n, "cache_aware"),
            server_label="kill"), {**w.describe(), "kill_after_s": a.kill_after_s}, [run])
        res["kill"] = summary
        results.write_result(self.out / "kill.json", res)
        return summary

    def replica_health(self, state: dict) -> list[int | None]:
        out = []
        for r in state["replicas"]:
            try:
                out.append(httpx.get(r["url"] + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                out.append(None)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cpu", action="store_true", help="nano replicas, the CPU sizes below")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--log-dir", default=None, help="cluster logs (default: a temp dir)")
    ap.add_argument("--port", type=int, default=8300, help="the gateway's; replicas follow")
    ap.add_argument("--parts", default="throughput,agent,kill")
    ap.add_argument("--replicas", default=None, help="N values of the throughput part")
    ap.add_argument("--agent-replicas", type=int, default=None)
    ap.add_argument("--conc-per-replica", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--prompts-per-stream", type=int, default=None)
    ap.add_argument("--agent-args", default=None, help="tailored bench agent-mix options")
    ap.add_argument("--kill-after-s", type=float, default=None)
    ap.add_argument("--kill-output-len", type=int, default=None)
    ap.add_argument("--gateway-args", default="", help="passed to tailored cluster")
    ap.add_argument("--startup-timeout", type=float, default=1800.0)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER,
                    help="-- then `tailored serve` arguments of every replica")
    a = ap.parse_args()
    preset = CPU if a.cpu else GPU
    for k, v in preset.items():
        if k != "serve_args" and getattr(a, k) is None:
            setattr(a, k, v)
    a.serve_args = [x for x in a.serve_args if x != "--"] or preset["serve_args"]
    if not a.cpu and not a.serve_args:
        ap.error("give the replicas' checkpoint and options after --")
    s = Sweep(a)
    summary: dict = {"cpu": a.cpu, "serve_args": a.serve_args,
                     "settings": {k: getattr(a, k) for k in preset if k != "serve_args"}}
    parts = a.parts.split(",")
    if "throughput" in parts:
        summary["throughput"] = s.throughput()
    if "agent" in parts:
        summary["agent"] = s.agent()
    if "kill" in parts:
        summary["kill"] = s.kill()
    summary["manifest"] = results.build_manifest()
    (s.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (s.out / "commands.txt").write_text("\n".join(s.commands) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "manifest"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
