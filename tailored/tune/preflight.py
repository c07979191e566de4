"""What `tailored tune` checks before it starts a server: a contract whose trials would all
fail (a missing prompt file, a pinned value `tailored serve` refuses, requests longer than
the context) is refused in a second with the field and the fix, not after the first start.

Each check raises ValueError (the CLI's exit code 2) naming the contract field."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

# the values `tailored serve` takes for the options whose values are words or flags
WORD_OPTIONS = {"prefill_graphs": ("auto", "on", "off"), "enforce_eager": (True, False),
                "gdn_state_dtype": ("auto", "bfloat16", "float32")}
INT_OPTIONS = {"max_num_batched_tokens": 16, "max_num_seqs": 1, "num_speculative_tokens": 0,
               "spec_max_running": 1, "prefix_cache_entries": 0}  # name: least value


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
        if k in WORD_OPTIONS:
            if v not in WORD_OPTIONS[k] or isinstance(v, bool) != isinstance(WORD_OPTIONS[k][0], bool):
                raise ValueError(f"{where}: {v!r} is not one of "
                                 f"{', '.join(map(repr, WORD_OPTIONS[k]))}")
        elif k in INT_OPTIONS:
            if isinstance(v, bool) or not isinstance(v, int) or v < INT_OPTIONS[k]:
                raise ValueError(f"{where}: {v!r} is not a whole number >= {INT_OPTIONS[k]}")
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
