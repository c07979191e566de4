"""Async scheduling (kb/0025): a queue that cannot be admitted (max_num_seqs running) does not
turn pipelining off."""
import pytest

from tailored.engine.types import SamplingParams
from test_async_fuzz import ids, make

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


@pytest.mark.contract("concurrency-soak")
def test_queue_beyond_max_num_seqs_keeps_pipelining(tiny_model, tok):
    e = make(tiny_model, tok, True, max_num_seqs=2)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(4):
        e.add_request(f"r{i}", ids(8, i), sp)
    ahead_while_queued = ahead_after = 0
    while e.has_unfinished():
        queued = bool(e.scheduler.waiting)
        e.step()
        if e._inflight is not None:
            if queued:
                ahead_while_queued += 1
            else:
                ahead_after += 1
    print("ahead while 2 requests queued:", ahead_while_queued, "after:", ahead_after)
    assert ahead_while_queued > 0
