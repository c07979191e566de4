"""`tailored cluster`: N `tailored serve` replicas behind the SMG gateway on one host
(docs/scale-out.md).

    tailored cluster --replicas 4 --port 8000 -- /models/Qwen3.6-FP8 --prefix-cache-entries 64

Each replica is `tailored serve` with the arguments after `--`, listening on
127.0.0.1:REPLICA_PORT+i (only the gateway is reached from outside), on the i-th GPU
(`CUDA_VISIBLE_DEVICES`) when the machine has CUDA GPUs; on a CPU machine they are nano
replicas (with no checkpoint after `--`). Once
every replica answers /health, SMG (`smg launch`, the PyPI package `smg`) starts on --host:--port
with the replicas as its workers and its cache-aware policy: each conversation goes to the
replica whose prefix cache holds it. SMG polls each replica's /v1/loads and /health; a replica
that dies or stalls leaves its rotation, and the requests it was streaming end with an error
event. The replicas' and the gateway's output goes to files in --log-dir.

Ctrl-C or SIGTERM stops the gateway first (no new requests), then the replicas (each lets its
in-flight requests finish for up to --shutdown-timeout seconds, as `tailored serve` does), then
anything left is killed; a second Ctrl-C kills everything at once. A replica that dies is left
dead (the gateway routes around it; the log says so); the cluster ends with exit code 1 when
the gateway or every replica is gone.

API keys (--api-key, --api-key-file, TAILORED_API_KEY) go to every replica through its
environment and to the gateway, which asks clients for the first and any other, and sends the
first to the replicas.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger("tailored.cluster")

GATEWAY_PACKAGE = "smg==1.13.0"  # the version the CPU CI runs (pyproject's test extra)
# serve options the cluster sets itself
OWNED_SERVE_OPTIONS = ("--host", "--port", "--api-key", "--api-key-file")
POLL_S = 0.25


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="N `tailored serve` replicas behind the SMG gateway "
                                       "on this host (docs/scale-out.md)")
    p.add_argument("--replicas", type=int, default=2,
                   help="how many `tailored serve` replicas (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the gateway's listen address; 0.0.0.0 to expose it (default: "
                        "%(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="the gateway's port (default: %(default)s)")
    p.add_argument("--replica-port", type=int, default=None,
                   help="replica i listens on 127.0.0.1:REPLICA_PORT+i (default: --port + 1)")
    p.add_argument("--gpus", default="auto",
                   help="auto: replica i on the i-th GPU (its CUDA_VISIBLE_DEVICES) of those "
                        "CUDA_VISIBLE_DEVICES lists, else of those nvidia-smi shows, else no "
                        "GPU; none; or GPU ids, comma-separated, one per replica (default: "
                        "%(default)s)")
    p.add_argument("--policy", default="cache_aware",
                   help="the gateway's routing policy (`smg launch --policy`) (default: "
                        "%(default)s)")
    p.add_argument("--gateway-bin", default=None,
                   help="the smg executable (default: `python -m smg` when this Python has "
                        "it, else smg on PATH)")
    p.add_argument("--gateway-args", default="",
                   help="more `smg launch` arguments, one shell-quoted string, e.g. "
                        "'--health-check-interval-secs 2' (default: none)")
    p.add_argument("--gateway-metrics-port", type=int, default=None,
                   help="the gateway's Prometheus port, on 127.0.0.1 (default: the port after "
                        "the replicas')")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this key at the gateway and the replicas; repeatable; also "
                        "TAILORED_API_KEY and --api-key-file (default: none)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="keys, one a line (default: none)")
    p.add_argument("--log-dir", default=None,
                   help="where replica-I.log and gateway.log go (default: a new temporary "
                        "directory, printed)")
    p.add_argument("--state-file", default=None,
                   help="write the running cluster's URLs, pids and logs here as JSON once "
                        "it serves (default: none)")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds a replica may take to answer /health (weights, warm-up, "
                        "CUDA graphs) (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds a stopping replica lets its in-flight requests run (its "
                        "`serve --shutdown-timeout`) (default: %(default)s)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: the `tailored serve` arguments of every replica (checkpoint "
                        "directory and options; not --host, --port or keys) (default: none, "
                        "the nano model)")


# ---- planning ------------------------------------------------------------------------------------
def serve_arguments(raw: list[str], shutdown_timeout: float) -> list[str]:
    """The replicas' serve arguments: `raw` without its leading `--`, refused when it sets what
    the cluster owns; --shutdown-timeout added unless given."""
    args = list(raw[1:] if raw[:1] == ["--"] else raw)
    for a in args:
        if a.split("=", 1)[0] in OWNED_SERVE_OPTIONS:
            raise ValueError(f"{a.split('=', 1)[0]} is set by the cluster: give it to "
                             "`tailored cluster` (--host/--port are the gateway's)")
    if not any(a.split("=", 1)[0] == "--shutdown-timeout" for a in args):
        args += ["--shutdown-timeout", f"{shutdown_timeout:g}"]
    return args


def gpu_plan(spec: str, replicas: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica (None: left as it is)."""
    if spec == "none":
        return [None] * replicas
    if spec == "auto":
        gpus = _cuda_devices()
        if not gpus:
            return [None] * replicas
        if replicas > len(gpus):
            raise ValueError(f"--replicas {replicas} on {len(gpus)} GPU(s): one replica a GPU; "
                             "lower --replicas or name the GPUs with --gpus")
        return gpus[:replicas]
    ids = [g.strip() for g in spec.split(",") if g.strip()]
    if len(ids) != replicas:
        raise ValueError(f"--gpus names {len(ids)} GPU(s) for {replicas} replicas")
    return ids


def _cuda_devices() -> list[str]:
    """The CUDA GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: that variable's
    own when set, else nvidia-smi's GPUs 0..n-1 (none without nvidia-smi)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(n)]


def gateway_command(explicit: str | None) -> list[str]:
    """How to run smg: --gateway-bin, this Python's `-m smg`, or smg on PATH."""
    if explicit:
        if shutil.which(explicit) is None:
            raise ValueError(f"--gateway-bin {explicit}: not an executable")
        return [explicit]
    if importlib.util.find_spec("smg") is not None:
        return [sys.executable, "-m", "smg"]
    found = shutil.which("smg")
    if found:
        return [found]
    raise ValueError(f"the SMG gateway is not installed: pip install '{GATEWAY_PACKAGE}' (or "
                     "name its executable with --gateway-bin)")


def gateway_arguments(args, urls: list[str], metrics_port: int, keys: tuple) -> list[str]:
    out = ["launch", "--host", args.host, "--port", str(args.port), "--worker-urls", *urls,
           "--policy", args.policy, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics_port),
           # a replica whose /health fails twice, 5 s apart, leaves the rotation (SMG's
           # defaults: 3 failures, 60 s apart); requests that fail to reach one are retried
           "--health-check-interval-secs", "5", "--health-failure-threshold", "2",
           "--log-level", "warn"]
    if keys:
        out += ["--api-key", keys[0]]
        out += [a for i, k in enumerate(keys[1:], 1) for a in ("--tenant-api-key", f"key{i}:{k}")]
    return out + shlex.split(args.gateway_args)


# ---- processes -----------------------------------------------------------------------------------
def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # a terminal's Ctrl-C reaches the cluster only: it stops them in order
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    f = open(log, "ab")
    try:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    finally:
        f.close()


def get_json(url: str, keys: tuple = (), timeout: float = 2.0):
    """(status, JSON body or None) of a GET; (None, None) when nothing answers."""
    req = urllib.request.Request(url)
    if keys:
        req.add_header("Authorization", f"Bearer {keys[0]}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return None, None


def tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text[-lines:])


class Cluster:
    """The replicas and the gateway of one `tailored cluster` run."""

    def __init__(self, args, keys: tuple, log_dir: Path) -> None:
        self.args, self.keys, self.log_dir = args, keys, log_dir
        base = args.replica_port if args.replica_port is not None else args.port + 1
        self.ports = [base + i for i in range(args.replicas)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.metrics_port = (args.gateway_metrics_port if args.gateway_metrics_port is not None
                             else base + args.replicas)
        self.replicas: list[subprocess.Popen] = []
        self.gateway: subprocess.Popen | None = None
        self.reported: set[int] = set()  # replicas whose exit was logged

    def replica_log(self, i: int) -> Path:
        return self.log_dir / f"replica-{i}.log"

    def start_replicas(self, serve_args: list[str], gpus: list[str | None]) -> None:
        for i, (port, gpu) in enumerate(zip(self.ports, gpus)):
            env = dict(os.environ)
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            if self.keys:
                env["TAILORED_API_KEY"] = ",".join(self.keys)
            cmd = [sys.executable, "-m", "tailored.cli", "serve", *serve_args,
                   "--host", "127.0.0.1", "--port", str(port)]
            self.replicas.append(start(cmd, self.replica_log(i), env))
            logger.info("replica %d: pid %d, %s%s, log %s", i, self.replicas[-1].pid,
                        self.urls[i], "" if gpu is None else f", GPU {gpu}", self.replica_log(i))

    def wait_replicas(self, timeout_s: float, stopping) -> None:
        """Until every replica answers /health; RuntimeError when one exits or times out."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.replicas)))
        while waiting:
            if stopping():
                raise KeyboardInterrupt
            for i in sorted(waiting):
                code = self.replicas[i].poll()
                if code is not None:
                    raise RuntimeError(f"replica {i} exited with code {code} while starting; "
                                       f"its log ({self.replica_log(i)}) ends:\n"
                                       f"{tail(self.replica_log(i))}")
                if get_json(self.urls[i] + "/health")[0] == 200:
                    waiting.discard(i)
                    logger.info("replica %d is up", i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica(s) {sorted(waiting)} not healthy within "
                                   f"{timeout_s:g} s (--startup-timeout)")
            time.sleep(POLL_S)

    def start_gateway(self, stopping, timeout_s: float = 120.0) -> None:
        cmd = gateway_command(self.args.gateway_bin) + gateway_arguments(
            self.args, self.urls, self.metrics_port, self.keys)
        log = self.log_dir / "gateway.log"
        self.gateway = start(cmd, log, dict(os.environ))
        logger.info("gateway: pid %d, log %s", self.gateway.pid, log)
        url = f"http://{self.local_host()}:{self.args.port}/readiness"
        deadline = time.monotonic() + timeout_s
        while True:
            if stopping():
                raise KeyboardInterrupt
            if self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited with code {self.gateway.returncode}; "
                                   f"its log ({log}) ends:\n{tail(log)}")
            status, body = get_json(url, self.keys)
            if status == 200 and isinstance(body, dict) and \
                    body.get("healthy_workers") == len(self.replicas):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not register the {len(self.replicas)} "
                                   f"replicas within {timeout_s:g} s; its log: {log}")
            time.sleep(POLL_S)

    def local_host(self) -> str:
        h = self.args.host
        if h in ("0.0.0.0", ""):
            return "127.0.0.1"
        if h == "::":
            return "[::1]"
        return f"[{h}]" if ":" in h else h

    def state(self) -> dict:
        return {
            "gateway": {"url": f"http://{self.local_host()}:{self.args.port}",
                        "pid": self.gateway.pid if self.gateway else None,
                        "metrics_url": f"http://127.0.0.1:{self.metrics_port}/metrics",
                        "log": str(self.log_dir / "gateway.log")},
            "replicas": [{"url": u, "pid": p.pid, "log": str(self.replica_log(i))}
                         for i, (u, p) in enumerate(zip(self.urls, self.replicas))],
        }

    def supervise(self, stopping) -> int:
        """Until a stop is asked (0) or the gateway or every replica is gone (1)."""
        while not stopping():
            if self.gateway.poll() is not None:
                logger.error("the gateway exited with code %s; stopping the replicas",
                             self.gateway.returncode)
                return 1
            for i, r in enumerate(self.replicas):
                if r.poll() is not None and i not in self.reported:
                    self.reported.add(i)
                    logger.error("replica %d (pid %d) exited with code %s; the gateway routes "
                                 "around it. Its log (%s) ends:\n%s", i, r.pid, r.returncode,
                                 self.replica_log(i), tail(self.replica_log(i), 5))
            if len(self.reported) == len(self.replicas):
                logger.error("every replica is gone; stopping")
                return 1
            time.sleep(POLL_S)
        return 0

    def stop(self, hurry) -> None:
        """The gateway, then the replicas (their in-flight requests get --shutdown-timeout),
        then SIGKILL for what is left; hurry(): a second Ctrl-C came, kill now."""
        t0 = time.monotonic()
        if self.gateway is not None:
            terminate([self.gateway], 15.0, hurry)
            logger.info("gateway stopped (%.1f s)", time.monotonic() - t0)
        t0 = time.monotonic()
        terminate(self.replicas, self.args.shutdown_timeout + 20.0, hurry)
        logger.info("replicas stopped (%.1f s)", time.monotonic() - t0)


def terminate(procs: list[subprocess.Popen], grace_s: float, hurry) -> None:
    """SIGTERM each process's group (its own session: a replica's engine process is in it),
    wait until every group is empty or grace_s passed (or hurry()), then SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in procs) and time.monotonic() < deadline and not hurry():
        time.sleep(0.1)
    for p in procs:
        if _alive(p):
            _signal(p, signal.SIGKILL)
    for p in procs:
        p.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)  # a group member killed above, not yet gone


def _alive(p: subprocess.Popen) -> bool:
    """Whether the process or anything else of its group still runs."""
    p.poll()  # reaps the leader: a zombie leader would keep its group "alive"
    try:
        os.killpg(p.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return p.poll() is None


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # its session: a replica's engine process too
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


# ---- the command ---------------------------------------------------------------------------------
def run(args) -> int:
    from tailored import flags
    from tailored.server.serve_options import read_keys

    switches = flags.Flags.from_env()  # a bad TAILORED_* stops here, not in N replicas
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    keys = read_keys(args.api_key, args.api_key_file, switches.api_key)
    serve_args = serve_arguments(args.serve_args, args.shutdown_timeout)
    gpus = gpu_plan(args.gpus, args.replicas)
    gateway_command(args.gateway_bin)  # installed? (before anything starts)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(
        prefix="tailored-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args, keys, log_dir)

    signals = {"n": 0}

    def on_signal(signum, frame):
        signals["n"] += 1
        if signals["n"] == 1:
            logger.info("stopping (again to kill everything at once)")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        cluster.start_replicas(serve_args, gpus)
        cluster.wait_replicas(args.startup_timeout, lambda: signals["n"] > 0)
        cluster.start_gateway(lambda: signals["n"] > 0)
        if args.state_file:
            Path(args.state_file).write_text(json.dumps(cluster.state(), indent=1))
        state = cluster.state()
        logger.info("serving on %s/v1: %d replica(s) behind SMG (%s policy), logs in %s",
                    state["gateway"]["url"], args.replicas, args.policy, log_dir)
        code = cluster.supervise(lambda: signals["n"] > 0)
    except KeyboardInterrupt:
        code = 0
    except RuntimeError as e:
        logger.error("%s", e)
        code = 1
    finally:
        cluster.stop(lambda: signals["n"] > 1)
        for s, h in old.items():
            signal.signal(s, h)
        if args.state_file:
            Path(args.state_file).unlink(missing_ok=True)
    logger.info("cluster stopped")
    return code
