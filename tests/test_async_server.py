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
    assert sa == sb and sb["running"] == sb["waiting"] == 0, (sa, sb)
