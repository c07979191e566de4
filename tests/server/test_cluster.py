"""`tailored cluster` for real: two `tailored serve` nano replicas (each with its engine
process) behind the SMG gateway binary (PyPI `smg`, the test extra), API keys on. Through the
gateway: requests are served; a conversation stays on one replica and hits its prefix cache
(`cached_tokens`); a replica killed mid-stream leaves the rotation, its in-flight stream ends
with an error event (nothing ends silently), the other replica's stream finishes and new
requests keep being served; a replica whose engine loop stops (SIGSTOP) leaves the rotation
while /health says it is stalled and comes back when it moves; SIGTERM stops everything.
~35 s on 2 cores, most of it the replicas' start and the gateway's 5 s shutdown settle."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tailored import cluster as cluster_cmd

MODEL = "qwen36-35b-a3b"
KEY = "cluster-test-key"
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8

try:
    GATEWAY = cluster_cmd.gateway_command(None)
except ValueError:  # CI installs it with the test extra
    GATEWAY = None


def free_ports(n: int) -> int:
    """A base port with n free consecutive ports (the gateway, the replicas, its metrics)."""
    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    if GATEWAY is None:
        why = f"the SMG gateway is not installed: pip install '{cluster_cmd.GATEWAY_PACKAGE}'"
        if os.environ.get("CI_REQUIRE_GATEWAY"):  # .ci/run sets it: CI must run this test
            pytest.fail(why)
        pytest.skip(why)
    d = tmp_path_factory.mktemp("cluster")
    (d / "keys").write_text(f"# the test's key\n{KEY}\n")
    base = free_ports(4)
    state_file = d / "state.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILORED_API_KEY")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailored.cli", "cluster", "--replicas", "2", "--port",
         str(base), "--log-dir", str(d), "--state-file", str(state_file), "--api-key-file",
         str(d / "keys"), "--shutdown-timeout", "5",
         # leave the rotation after one failed probe, 1 s apart (the default: 2, 5 s apart)
         "--gateway-args", "--health-check-interval-secs 1 --health-failure-threshold 1",
         "--", "--prefix-cache-entries", "16", "--max-num-seqs", "4", "--max-model-len", "2048",
         "--health-stall-timeout", "2"],
        env=env, stdout=open(d / "cluster.out", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the cluster did not start:\n{(d / 'cluster.out').read_text()}")
        time.sleep(0.2)
    state = json.loads(state_file.read_text())
    state["dir"], state["proc"] = d, proc
    try:
        yield state
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGINT)  # a second Ctrl-C: kill everything now
            proc.wait(30)


def gw(state, path: str, **body) -> httpx.Response:
    return httpx.post(state["gateway"]["url"] + path, json={"model": MODEL, **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text  # exempt from the key (the default)
    return float(re.search(rf"^tailored:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def running_on(state) -> list[int]:
    """Requests running on each replica (its /v1/loads, with the key)."""
    out = []
    for r in state["replicas"]:
        try:
            loads = httpx.get(r["url"] + "/v1/loads", timeout=5,
                              headers={"Authorization": f"Bearer {KEY}"}).json()
            out.append(loads["loads"][0]["num_running_reqs"])
        except httpx.HTTPError:
            out.append(-1)
    return out


def test_served_through_the_gateway_with_keys(running):
    r = gw(running, "/v1/completions", prompt="Once upon a time", max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.post(running["gateway"]["url"] + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x"}).status_code == 401
    # a replica refuses a caller without the key too (only the gateway is meant to reach it)
    assert httpx.get(running["replicas"][0]["url"] + "/v1/models").status_code == 401
    models = httpx.get(running["gateway"]["url"] + "/v1/models",
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_a_conversation_stays_on_one_replica_and_hits_its_cache(running):
    urls = [r["url"] for r in running["replicas"]]
    before = [counter(u, "prefix_cache_queries_total") for u in urls]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "The sea?"}]
    cached = []
    for turn in range(3):
        r = gw(running, "/v1/chat/completions", messages=msgs, max_tokens=8, temperature=0,
               chat_template_kwargs={"enable_thinking": False})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"And then, part {turn}?"}]
    assert cached[1] > 100 and cached[2] > cached[1], cached  # each turn reuses the last
    grew = [counter(u, "prefix_cache_queries_total") - b for u, b in zip(urls, before)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # one replica served them all


def engine_process(pid: int) -> int:
    """The pid of a replica's engine process (its child running multiprocessing's spawn)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmd:
            return int(stat.parent.name)
    raise AssertionError(f"replica {pid} has no engine process")


def healthy_workers(state) -> int:
    return httpx.get(state["gateway"]["url"] + "/readiness").json()["healthy_workers"]


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_stalled_replica_leaves_rotation_until_it_moves(running):
    """Its engine loop stopped (SIGSTOP) while a request waits: /health turns 503 after the
    stall bound (2 s here), SMG takes it out, requests go to the other one; once the loop
    moves it is back, and the request that waited is answered."""
    replica = running["replicas"][1]
    child = engine_process(replica["pid"])
    os.kill(child, signal.SIGSTOP)
    waited: dict = {}
    try:
        t = threading.Thread(target=lambda: waited.update(r=httpx.post(
            replica["url"] + "/v1/completions", timeout=60,
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "prompt": "waiting", "max_tokens": 2})))
        t.start()
        wait_until(lambda: httpx.get(replica["url"] + "/health").status_code == 503, 10,
                   "a stalled replica answered /health 200")
        wait_until(lambda: healthy_workers(running) == 1, 10, "the gateway kept it")
        for i in range(3):
            assert gw(running, "/v1/completions", prompt=f"meanwhile {i}",
                      max_tokens=2).status_code == 200
    finally:
        os.kill(child, signal.SIGCONT)
    t.join(30)
    assert waited["r"].status_code == 200
    wait_until(lambda: healthy_workers(running) == 2, 15, "the gateway did not take it back")


def stream(state, prompt: str, max_tokens: int, out: dict) -> None:
    """A streamed completion through the gateway: its events, or the transport error."""
    events = []
    try:
        with httpx.stream("POST", state["gateway"]["url"] + "/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.HTTPError as e:
        out["transport_error"] = repr(e)
    out["events"] = events


WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India",
         "Juliett", "Kilo", "Lima")


def prompt_per_replica(state) -> list[str]:
    """A prompt the gateway sends to each replica: a new prompt goes where the cache-aware
    policy puts it, and the same prompt again goes there too (its text is cached there)."""
    urls = [r["url"] for r in state["replicas"]]
    found: dict[int, str] = {}
    for word in WORDS:
        prompt = f"{word} {word.lower()} {word.upper()}: a story of {len(word)} parts"
        before = [counter(u, "prompt_tokens_total") for u in urls]
        assert gw(state, "/v1/completions", prompt=prompt, max_tokens=1).status_code == 200
        grew = [counter(u, "prompt_tokens_total") > b for u, b in zip(urls, before)]
        found.setdefault(grew.index(True), prompt)
        if len(found) == len(urls):
            return [found[i] for i in range(len(urls))]
    pytest.fail(f"every new prompt went to the same replica: {found}")


def test_a_killed_replica_leaves_rotation_and_loses_nothing_silently(running):
    prompts = prompt_per_replica(running)
    victim = 0
    a, b = {}, {}
    ta = threading.Thread(target=stream, args=(running, prompts[victim], 400, a))
    tb = threading.Thread(target=stream, args=(running, prompts[1 - victim], 200, b))
    ta.start()
    tb.start()
    deadline = time.monotonic() + 30
    while running_on(running) != [1, 1]:  # each on its replica
        assert time.monotonic() < deadline, f"not one stream a replica: {running_on(running)}"
        time.sleep(0.05)
    pid = running["replicas"][victim]["pid"]
    os.kill(pid, signal.SIGKILL)  # the replica's server; its engine process follows
    ta.join(60)
    tb.join(120)
    # the killed replica's stream ends with an error event, not as if it were complete
    assert a.get("status") == 200 and "transport_error" not in a, a
    errors = [e for e in a["events"] if isinstance(e, dict) and "error" in e]
    ends = [e for e in a["events"] if isinstance(e, dict) and (e.get("usage") or e.get(
        "choices") and e["choices"][0].get("finish_reason"))]
    assert errors and not ends, a["events"][-3:]
    # the other replica's stream is whole
    [usage] = [e["usage"] for e in b["events"] if isinstance(e, dict) and e.get("usage")]
    texts = [e for e in b["events"] if isinstance(e, dict) and e.get("choices")]
    assert b["events"][-1] == "[DONE]" and texts[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 200
    # new requests keep being served, and the dead replica leaves the rotation
    for i in range(4):
        r = gw(running, "/v1/completions", prompt=f"after {i}", max_tokens=3)
        assert r.status_code == 200, r.text
    wait_until(lambda: healthy_workers(running) == 1, 20,
               "the dead replica stayed in the rotation")
    deadline = time.monotonic() + 20  # its engine process too: nothing is left behind
    while _group_alive(pid):
        assert time.monotonic() < deadline, "the killed replica's engine process lives on"
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_sigterm_stops_the_gateway_and_the_replicas(running):
    proc = running["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for p in [running["gateway"]["pid"]] + [r["pid"] for r in running["replicas"]]:
        assert not _group_alive(p), p
    assert not (running["dir"] / "state.json").exists()
    out = (running["dir"] / "cluster.out").read_text()
    assert "replica 0 is up" in out and "cluster stopped" in out
    assert re.search(r"replica \d \(pid \d+\) exited", out)  # the killed one was reported


def test_cluster_arguments(monkeypatch, capsys):
    from tailored.cli import main

    for argv, msg in [(["--replicas", "0"], "--replicas must be >= 1"),
                      (["--", "--host", "0.0.0.0"], "--host is set by the cluster"),
                      (["--gateway-bin", "/no/such/smg"], "not an executable")]:
        assert main(["cluster", *argv]) == 2  # one line, before anything starts
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")  # the GPUs this cluster may use
    assert cluster_cmd.gpu_plan("auto", 2) == ["2", "5"]
    with pytest.raises(ValueError, match="--replicas 4 on 3 GPU"):
        cluster_cmd.gpu_plan("auto", 4)
    assert cluster_cmd.serve_arguments(["--", "/ckpt", "--prefix-cache-entries", "8"], 30) == [
        "/ckpt", "--prefix-cache-entries", "8", "--shutdown-timeout", "30"]
    with pytest.raises(ValueError, match="--port is set by the cluster"):
        cluster_cmd.serve_arguments(["--port=9000"], 30)
    assert cluster_cmd.gpu_plan("none", 2) == [None, None]
    assert cluster_cmd.gpu_plan("4,5", 2) == ["4", "5"]
    with pytest.raises(ValueError, match="names 1 GPU"):
        cluster_cmd.gpu_plan("0", 2)
