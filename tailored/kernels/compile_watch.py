"""Log every Triton compile that happens after the start-up warm-up.

Why: a compile (or an autotuning run) while serving stalls the step that hit it — seconds, in a
benchmark window or a user's request. The first mixed steps of a cold server took 0.5–1.6 s
instead of ~0.25 s (kb/0030): Triton compiles a variant of a kernel for every
new integer specialization (1, multiple of 16, other) and pointer alignment, and the warm-up
had not reached them all. This names each one, so the warm-up can be made to cover it.

Uses Triton's `knobs.runtime.jit_post_compile_hook` (Triton ≥ 3.4; `runtime/jit.py` calls it
after each in-memory cache miss, an on-disk hit included). Any hook already installed keeps
being called; a second call (another runner in the process) installs nothing more, and that
runner's own warm-up compiles are then logged too.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("tailored.kernels")


def watch_compiles() -> bool:
    """Install the hook; returns False when this Triton has no such knob (nothing installed)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = knobs.runtime
    if not hasattr(rt, "jit_post_compile_hook"):
        return False
    prev = rt.jit_post_compile_hook
    if getattr(prev, "_tailored_watch", False):  # a second runner in this process
        return True
    count = [0]

    def hook(**kw):  # Triton passes key, repr, fn, compile, is_manual_warmup, already_compiled
        count[0] += 1
        log.warning("Triton compile #%d after warm-up (this step waits for it): %s; %s",
                    count[0], str(kw.get("repr", "?"))[:300], _specialization(kw))
        return prev(**kw) if prev is not None else None

    hook._tailored_watch = True
    rt.jit_post_compile_hook = hook
    return True


def _specialization(kw: dict) -> str:
    """The integer/pointer specializations (attrs: divisibility, value 1) and constexprs of a
    compile, from Triton's serialized specialization data; the raw text's start if it is not
    the JSON this Triton version writes."""
    raw = str((kw.get("compile") or {}).get("specialization_data", ""))
    try:
        d = json.loads(raw)
        return (f"attrs {dict(zip(map(str, d['attrs_keys']), d['attrs_vals']))} "
                f"constexprs {d['constant_vals']}")[:600]
    except (ValueError, KeyError, TypeError):
        return raw[:600]
