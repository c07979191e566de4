"""What `tailored serve` accepts for each engine option on its own: its type, its words, its
bounds. The serve parser takes each option's `type` / `choices` from here (`parser_kwargs`),
serve checks the parsed values with `check_all` before anything slow, and `tailored tune`
checks a contract's pinned values with `check` (tune/preflight.py), so a bound changed here
changes all three.

Only rules about one option live here. Rules between options (a speculative option needs
--num-speculative-tokens; --prompt-lookup-min <= --prompt-lookup-max) stay with serve
(cli.py): tune searches some of the options involved, so a value it pins can only be judged
on its own. Messages name the flag: "--max-num-seqs must be >= 1, got 0".
"""

from __future__ import annotations

from dataclasses import dataclass

from tailored.config import GDN_STATE_DTYPES, MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

MAX_STEP_TOKENS = 65536  # largest --max-num-batched-tokens (16 GiB of activation reserve)

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class Rule:
    """One option's values. type: int, float, str, or bool (a flag without a value). lo / hi:
    bounds, closed unless lo_open / hi_open. prefixes: a word starting with one of these is
    accepted beside `choices` (--device cuda:1). expected: the message's wording where the
    bounds' own would say it less clearly."""

    type: type = str
    choices: tuple | None = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    prefixes: tuple[str, ...] = ()
    expected: str | None = None

    def expects(self) -> str:
        if self.expected:
            return self.expected
        if self.choices is not None:
            return "one of " + ", ".join(map(repr, self.choices))
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.type is int and not (self.lo_open or self.hi_open):
            return f"in {self.lo}..{self.hi}"
        return (f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}"
                f"{')' if self.hi_open else ']'}")

    def problem(self, v) -> str | None:
        """What is wrong with value `v` ("must be ..."), None when it is accepted."""
        if isinstance(v, bool) != (self.type is bool) or not isinstance(
                v, (int, float) if self.type is float else self.type):
            return f"must be {_TYPE_WORDS[self.type]}"
        if self.choices is not None and v not in self.choices and not (
                self.prefixes and v.startswith(self.prefixes)):
            return f"must be {self.expects()}"
        # written so that NaN fails every bound
        ok = ((self.lo is None or (self.lo < v if self.lo_open else self.lo <= v))
              and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)))
        return None if ok else f"must be {self.expects()}"


def _words(*choices: str) -> Rule:
    return Rule(str, choices=choices)


def _at_least(lo: int) -> Rule:
    return Rule(int, lo=lo)


# dest -> rule, for every `tailored serve` option with a type other than free text, a word
# list or a bound (the front door's options check themselves: server/serve_options.py)
RULES: dict[str, Rule] = {
    "port": Rule(int, lo=1, hi=65535),
    "load_format": _words("auto", "dummy"),
    "num_layers": _at_least(1),
    "device": Rule(str, choices=("auto", "cpu"), prefixes=("cuda",),
                   expected="auto, cpu or cuda[:N]"),
    "dtype": _words("bfloat16", "float32", "float16"),
    "max_model_len": _at_least(1),
    "max_num_seqs": _at_least(1),
    # the activation reserve grows 256 KiB per budget token (memory_plan.plan_cache): a typo
    # here would only fail after the weights load, naming other flags
    "max_num_batched_tokens": Rule(int, lo=1, hi=MAX_STEP_TOKENS),
    "prefill_stall_factor": Rule(float, lo=0, hi=100, hi_open=True,
                                 expected="0 (off) or in (0, 100)"),
    "page_size": _at_least(1),
    "gpu_memory_utilization": Rule(float, lo=0, hi=1, lo_open=True),
    "seed": Rule(int),
    "dummy_init": _words("default", "stable"),
    "kernels": _words("auto", "on", "off"),
    "enforce_eager": Rule(bool),
    "prefill_graphs": _words("auto", "on", "off"),
    "async_scheduling": _words("auto", "on", "off"),
    "num_speculative_tokens": Rule(int, lo=0, hi=MAX_SPECULATIVE_TOKENS),
    "speculative_method": _words(*SPECULATIVE_METHODS),
    # their bounds depend on each other: cli.py checks them together
    "prompt_lookup_max": Rule(int),
    "prompt_lookup_min": Rule(int),
    "spec_min_acceptance": Rule(float, lo=0, hi=1),
    "spec_max_running": _at_least(1),
    "spec_synthetic_acceptance": Rule(float, lo=0, hi=1),
    "gdn_state_dtype": _words(*GDN_STATE_DTYPES),
    "prefix_cache_entries": _at_least(0),
    "gil_switch_interval_ms": Rule(float, lo=0, hi=1000, lo_open=True),
    "engine_process": _words("on", "off"),
    "shutdown_timeout": Rule(float, lo=0, expected=">= 0 seconds"),
    "max_body_bytes": _at_least(1024),
    "reasoning_parser": _words("qwen3"),
    "access_log": _words("on", "off"),
    "log_level": _words("critical", "error", "warning", "info", "debug"),
}


def flag(name: str) -> str:
    """The command-line spelling of option `name` (a dest): --max-num-seqs."""
    return "--" + name.replace("_", "-")


def check(name: str, value) -> None:
    """ValueError naming the flag when `tailored serve` refuses `value` for option `name`;
    None (not given: serve's default) and names without a rule pass."""
    rule = RULES.get(name)
    if value is None or rule is None:
        return
    why = rule.problem(value)
    if why:
        raise ValueError(f"{flag(name)} {why}, got {value!r}")


def check_all(args) -> None:
    """`check` on every option of the parsed serve command line `args`."""
    for name in RULES:
        check(name, getattr(args, name, None))


def parser_kwargs(name: str) -> dict:
    """add_argument's keywords that carry option `name`'s rule: type, choices, or a flag."""
    rule = RULES[name]
    if rule.type is bool:
        return {"action": "store_true"}
    if rule.choices is not None and not rule.prefixes:
        return {"choices": list(rule.choices)}
    return {} if rule.type is str else {"type": rule.type}
