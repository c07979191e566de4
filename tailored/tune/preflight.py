"""What `tailored tune` checks before it starts a server: a contract whose trials would all
fail (a missing prompt file, a pinned value `tailored serve` refuses, requests longer than
the context) is refused in a second with the field and the fix, not after the first start.

Each check raises ValueError (the CLI's exit code 2) naming the contract field."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tailored.server import serve_rules


def check_prompt_file(path: str) -> int:
    """The number of prompts in `path` (bench's prompt-file format); ValueError if it is
    missing, not JSONL, or holds none."""
    from tailored.bench.loadgen import load_prompt_files

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"traffic.prompts: no such prompt file {path!r} (relative paths are "
                         f"read from {Path.cwd()}); fix: the path of a .jsonl file, one "
                         "{\"prompt\": ...} or {\"messages\": [...]} object a line")
    try:
        return len(load_prompt_files([str(p)]))
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(f"traffic.prompts: {path}: {e}") from None


def check_fixed(fixed: dict[str, Any], switches: dict[str, dataclasses.Field]) -> None:
    """search.fixed: each value one `tailored serve` (an option) or the switch table (a
    TAILORED_* switch) accepts."""
    for k, v in fixed.items():
        where = f"search.fixed.{k}"
        if k in serve_rules.RULES:
            # serve's own rule for this option alone: rules between options are not checked,
            # as the others involved may be searched
            try:
                serve_rules.check(k, v)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        elif k in switches:
            _check_switch(where, v, switches[k])


def _check_switch(where: str, v, f: dataclasses.Field) -> None:
    from tailored import flags

    try:
        flags.current().replace(**{f.name: v})  # the switch table's own check
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def check_lengths(contract) -> None:
    """Random prompts: input + output tokens fit memory.max_model_len when it is given."""
    t, limit = contract.traffic, contract.memory.max_model_len
    if limit is not None and t.prompts == "random" and t.input_tokens + t.output_tokens > limit:
        raise ValueError(f"memory.max_model_len: {limit} < traffic.input_tokens "
                         f"{t.input_tokens} + traffic.output_tokens {t.output_tokens}; every "
                         "request would be refused; fix: raise it or leave it out")


def preflight(contract, switches: dict[str, dataclasses.Field]) -> None:
    """Every check above on `contract`."""
    if contract.traffic.prompts.endswith(".jsonl"):
        check_prompt_file(contract.traffic.prompts)
    check_fixed(contract.search.fixed, switches)
    check_lengths(contract)
