"""Async scheduling (kb/0025): a queue that cannot be admitted (max_num_seqs running) does not
turn pipelining off."""
import pytest

from tailored.engine.types import SamplingParams
from test_async_fuzz import ids, make


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def tok():
    from tailored.tokenizer import load_tokenizer
    return load_tokenizer(None)


def test_queue_beyond_max_num_seqs_disables_pipelining(tiny_model, tok):
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
