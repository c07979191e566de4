"""Async scheduling (kb/0025): AsyncEngine over the real tiny engine, async on vs off, with
client aborts."""
import asyncio

import pytest

from tailored.engine.types import FinishReason, SamplingParams
from tailored.server.async_engine import AsyncEngine
from test_async_fuzz import ids, make

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def test_async_engine_loop(tiny_model, tok):
    res = {}
    for on in (False, True):
        eng = make(tiny_model, tok, on, num_pages=20)
        ae = AsyncEngine(eng)
        ae.start()

        async def one(i):
            sp = SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
            toks, why = [], None
            stream = await ae.generate(f"q{i}", ids(5 + 9 * i, 40 + i), sp)
            async for o in stream:
                toks += o.delta_token_ids
                if i == 3 and len(toks) >= 4:
                    stream.abort()
                if o.finished:
                    why = o.finish_reason
            return toks, why

        async def main():
            r = await asyncio.gather(*(one(i) for i in range(6)))
            await asyncio.sleep(0.3)
            return r, await ae.stats()
        try:
            res[on] = asyncio.run(main())
        finally:
            ae.shutdown()
    (a, sa), (b, sb) = res[False], res[True]
    for i, (x, y) in enumerate(zip(a, b)):
        if i == 3:
            assert y[1] in (None, FinishReason.ABORT)
            continue
        assert x == y, i
    # How many preemptions a 20-page pool needs depends on when each request reaches the
    # engine loop (the clients race it), so only the end state is compared: every page and
    # state slot back, nothing left running or waiting.
    for st in (sa, sb):
        assert st["running"] == st["waiting"] == 0, (sa, sb)
    drop = ("num_preemptions",)
    assert {k: v for k, v in sa.items() if k not in drop} == \
        {k: v for k, v in sb.items() if k not in drop}, (sa, sb)
