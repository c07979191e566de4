"""`tailored serve`'s front-door options: API keys, the Host allow-list, the health bound
(docs/serving.md#security). `tailored cluster` reads the keys the same way.

Keys come from three places, all accepted together: `--api-key KEY` (repeatable; visible in
`ps`, so prefer the others on a shared machine), `--api-key-file PATH` (one key a line; blank
lines and `#` comments skipped) and the `TAILORED_API_KEY` switch (comma-separated). A key is
printable ASCII without spaces or commas.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tailored.server.guard import (DEFAULT_EXEMPT, EXEMPT_ROUTES, LOOPBACK_NAMES, AccessPolicy,
                                   is_loopback)

DEFAULT_STALL_TIMEOUT_S = 60.0


def add_front_door_options(p: argparse.ArgumentParser) -> None:
    """The options on `p` (the serve parser)."""
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY; x-api-key on the "
                        "Anthropic Messages routes) on every route but --api-key-exempt ones, "
                        "else 401; repeat for several keys. Also TAILORED_API_KEY (comma-"
                        "separated) and --api-key-file; a key given here shows in `ps` "
                        "(default: none, no key needed)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read keys from this file, one a line (blank lines and # comments "
                        "skipped), beside --api-key (default: none)")
    p.add_argument("--api-key-exempt", default=",".join(DEFAULT_EXEMPT), metavar="LIST",
                   help="routes that answer without a key when keys are set, comma-separated "
                        "from: health (/health, /health_generate), metrics (/metrics), version "
                        "(/version); 'none' for no exemption (default: %(default)s)")
    p.add_argument("--allowed-hosts", default="auto", metavar="LIST",
                   help="host names the Host header may name, comma-separated (other hosts "
                        "get 400: a web page using DNS rebinding cannot drive the server); "
                        "'*' for any. auto: localhost, 127.0.0.1 and ::1 when --host is "
                        "loopback, any host otherwise (default: %(default)s)")
    p.add_argument("--health-stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                   metavar="S",
                   help="/health answers 503 while work has waited S seconds for the engine "
                        "loop to finish a step, so a gateway stops sending it traffic; it "
                        "answers 200 again once the loop moves. Also the deep probe's "
                        "(/health_generate) wait for its token (default: %(default)s)")


def read_keys(api_key: list[str] | None, api_key_file: str | None, env_keys: str,
              env_name: str = "TAILORED_API_KEY") -> tuple:
    """Every key of the three sources (module docstring), in order, without duplicates.
    Raises ValueError naming the source of a bad key or an unreadable file. env_name: the
    variable env_keys came from (sammie's is SAMMIE_API_KEY)."""
    found: list[tuple[str, str]] = [(k, "--api-key") for k in api_key or ()]
    if api_key_file is not None:
        try:
            lines = Path(api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {api_key_file}: {e.strerror}") from None
        keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {api_key_file}: no key in it")
        found += [(k, "--api-key-file") for k in keys]
    found += [(k.strip(), env_name) for k in env_keys.split(",") if k.strip()]
    out: list[str] = []
    for key, where in found:
        if not key or not key.isascii() or not key.isprintable() or any(
                c in key for c in " ,"):
            raise ValueError(f"{where}: a key must be printable ASCII without spaces or commas")
        if key not in out:
            out.append(key)
    return tuple(out)


def exempt_paths(names: str) -> frozenset[str]:
    """The routes of an --api-key-exempt list. ValueError for an unknown name."""
    picked = [n.strip() for n in names.split(",") if n.strip()]
    if picked == ["none"]:
        return frozenset()
    bad = [n for n in picked if n not in EXEMPT_ROUTES]
    if bad:
        raise ValueError(f"--api-key-exempt: unknown {bad[0]!r}; choose from "
                         f"{', '.join(EXEMPT_ROUTES)} or none")
    return frozenset(p for n in picked for p in EXEMPT_ROUTES[n])


def allowed_hosts(value: str, host: str) -> frozenset[str] | None:
    """The Host allow-list of --allowed-hosts for a server listening on `host` (None: any)."""
    value = value.strip()
    if value == "*":
        return None
    if value == "auto":
        if not is_loopback(host):
            return None
        names = [*LOOPBACK_NAMES, host]
    else:
        names = [n for n in value.split(",") if n.strip()]
        if not names:
            raise ValueError("--allowed-hosts: give host names, '*' or auto")
    return frozenset(n.strip().strip("[]").lower().rstrip(".") for n in names)


def access_policy(args, env_keys: str) -> AccessPolicy:
    """The AccessPolicy of parsed serve options (env_keys: the TAILORED_API_KEY switch).
    ValueError for a bad value (one line, before anything loads)."""
    if not args.health_stall_timeout > 0:
        raise ValueError(f"--health-stall-timeout must be > 0 seconds, got "
                         f"{args.health_stall_timeout}")
    return AccessPolicy(api_keys=read_keys(args.api_key, args.api_key_file, env_keys),
                        exempt_paths=exempt_paths(args.api_key_exempt),
                        allowed_hosts=allowed_hosts(args.allowed_hosts, args.host))


def check_port(host: str, port: int) -> None:
    """ValueError when `host:port` cannot be listened on (taken, not ours): checked before
    the weights load, where uvicorn would only say so after them."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
