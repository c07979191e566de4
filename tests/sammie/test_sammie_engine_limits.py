"""The engine under hostile input (a helper's attack, sammie-hard): one request's fault stays
its own in a batch; decoding and masks stay within bounded memory and a mask budget."""

from __future__ import annotations

import asyncio

import pytest

from sammie.engine.batcher import Batcher


def test_a_failing_job_does_not_fail_its_batch_mates():
    calls = []

    def run(jobs):
        calls.append(list(jobs))
        if "boom" in jobs:
            raise RuntimeError("can't allocate memory")
        return [ValueError("own fault") if j == "own" else j.upper() for j in jobs]

    async def main():
        b = Batcher(run, max_batch=8, max_wait_ms=200)
        b.start()
        try:
            return await asyncio.gather(*(b.submit(j) for j in ("a", "boom", "b", "own")),
                                        return_exceptions=True)
        finally:
            await b.stop()

    out = asyncio.run(main())
    assert out[0] == "A" and out[2] == "B"
    assert isinstance(out[1], RuntimeError) and isinstance(out[3], ValueError)
    assert calls[0] == ["a", "boom", "b", "own"]  # one batch, then each job alone
    assert calls[1:] == [["a"], ["boom"], ["b"], ["own"]]
