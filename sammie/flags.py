"""Sammie's switch table: every `SAMMIE_*` environment variable, declared once, read here only.

Its own table, not tailored's: the two servers are deployed apart, and a `TAILORED_*` name
means nothing to sammie (nor the reverse). The same rules as tailored/flags.py: an unknown
`SAMMIE_*` name or a bad value stops the start with a message naming it; `snapshot()` is what
manifests record (a secret's value shows as "(set)"). docs/sammie.md lists them. Manifests come
from tailored/gate/manifest.py, shared, so the commit that a copy without git records is still
`TAILORED_COMMIT`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from tailored.flags import Active, refuse_unknown, shown

PREFIX = "SAMMIE_"


def _switch(env: str, default: str, why: str, secret: bool = False):
    return field(default=default, metadata={"env": PREFIX + env, "why": why, "secret": secret},
                 repr=not secret)


@dataclass(frozen=True)
class Flags:
    api_key: str = _switch(
        "API_KEY", "", "API keys `sammie serve` accepts, comma-separated, beside --api-key and "
        "--api-key-file; never shown", secret=True)
    cache: str = _switch(
        "CACHE", "", "directory for the tiny synthetic checkpoint `sammie serve` writes when "
        "given none; empty = ~/.cache/sammie")

    @classmethod
    def from_env(cls, environ=None) -> "Flags":
        env = os.environ if environ is None else environ
        known = {f.metadata["env"]: f for f in dataclasses.fields(cls)}
        refuse_unknown(env, PREFIX, known, "sammie", "docs/sammie.md")
        return cls(**{f.name: env[n].strip() for n, f in known.items() if env.get(n, "").strip()})

    def snapshot(self) -> dict:
        return shown(self)


def markdown_rows() -> list[str]:
    """The table's rows for docs/sammie.md."""
    return [f"| `{f.metadata['env']}` | {f.metadata['why']} |" for f in dataclasses.fields(Flags)]


# the record `sammie serve` parses at start (tailored/flags.py's Active, as tailored's table)
_active: Active[Flags] = Active(Flags)
current = _active.current
activate = _active.activate
