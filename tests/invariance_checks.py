"""Engine-level invariance checks shared by the CPU suite (tests/engine/test_invariance.py, tiny
model, plain path) and the GPU suite (tests/gpu/test_gpu_invariance.py, full width, kernel
path + graphs).

Each check takes `make(**engine_kwargs) -> Engine`; the caller picks model, device, sizes and
tolerance. Hidden states are the ones the engine computed (gate.engine_side capture).
"""

from __future__ import annotations

import torch

from tailored.engine.types import FinishReason, SamplingParams
from tailored.gate.engine_side import engine_greedy


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _system(repeats: int) -> str:
    return "You are a careful assistant who answers in full sentences. " * repeats


def chat_turns(tok, system_repeats: int = 12) -> tuple[list[int], list[int], int]:
    """Two turns of one chat through the served template, as ids (turn 1, turn 2), and where
    turn 1's generation prompt starts (its last <|im_start|>): the prefix cache's save point
    (engine/prefix_cache.py). Turn 2 repeats turn 1 up to there, not beyond."""
    system = _system(system_repeats)
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "Name three prime numbers."}]
    turn2 = turn1 + [{"role": "assistant", "content": "2, 3 and 5."},
                     {"role": "user", "content": "And their sum?"}]
    p1 = tok.encode(tok.apply_chat_template(turn1), allow_special=True)
    p2 = tok.encode(tok.apply_chat_template(turn2), allow_special=True)
    cut = max(i for i, t in enumerate(p1) if t == tok.token_to_id("<|im_start|>"))
    return p1, p2, cut


def new_chat(tok, system_repeats: int = 12) -> tuple[list[int], int]:
    """Another chat with `chat_turns`' system prompt and another question, as ids, and where
    its system message ends (the next <|im_start|>): the prefix cache's other save point.
    Up to there its ids are chat_turns' turn 1's, not beyond."""
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": _system(system_repeats)},
         {"role": "user", "content": "What is the capital of France?"}]), allow_special=True)
    return ids, ids.index(tok.token_to_id("<|im_start|>"), 1)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def alone_equals_inside_a_batch_of_32(make, *, max_len: int, target_len: int, new: int,
                                      budget: int, max_model_len: int, tol: float) -> None:
    """A request's greedy tokens and hidden states do not depend on its 31 mixed-length
    neighbours (lengths 1..max_len), its chunks sharing steps with their decode rows."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, max_len, (31,), generator=g).tolist()
    batch = {f"n{i}": ids(t, 100 + i) for i, t in enumerate(lens)}
    batch["target"] = ids(target_len, 1)  # admitted last
    toks, hid = engine_greedy(make(budget=budget, max_num_seqs=32, max_model_len=max_model_len),
                              batch, new, capture=True)
    alone_t, alone_h = engine_greedy(make(max_model_len=max_model_len),
                                     {"target": batch["target"]}, new, capture=True)
    assert toks["target"] == alone_t["target"]
    assert rel(hid["target"], alone_h["target"]) <= tol


def identical_prompts_identical_outputs(make, *, prompt_len: int, max_model_len: int) -> None:
    """8 copies at once, on slots dirtied by earlier requests (LIFO reuse), chunked admission."""
    e = make(budget=64, max_num_seqs=8, max_model_len=max_model_len)
    engine_greedy(e, {f"w{i}": ids(30 + 9 * i, 50 + i) for i in range(8)}, 5)  # dirty slots
    p = ids(prompt_len, 3)
    out, _ = engine_greedy(e, {f"c{i}": p for i in range(8)}, 16)
    assert all(v == out["c0"] for v in out.values())


def chunked_equals_single_pass(runs: dict, single: int, tol: float) -> None:
    """runs: budget → engine_greedy(..., capture=True) result of the same prompt."""
    ref_t, ref_h = runs[single]
    for b, (t, h) in runs.items():
        assert t["p"] == ref_t["p"], f"budget {b}"
        assert rel(h["p"], ref_h["p"]) <= tol, b


def prefill_then_decode_equals_prefill(e, P: list[int], tol: float) -> None:
    """prefill(T−1)+decode of the engine's own greedy x == prefill(T) with P[:T−1]+[x]."""
    T = len(P)
    t1, h1 = engine_greedy(e, {"q": P[:T - 1]}, 3, capture=True)
    t2, h2 = engine_greedy(e, {"q": P[:T - 1] + [t1["q"][0]]}, 2, capture=True)
    assert t2["q"] == t1["q"][1:]
    assert rel(h1["q"][:T + 1], h2["q"][:T + 1]) <= tol


def abort_frees_pages_and_slots(e) -> None:
    """Aborts while waiting, mid-prefill and mid-decode: pools return to their baseline.
    e: an engine with budget 32, 3 sequences, 30 pages."""
    base = e.stats()
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 60, 20, 7, 9)):
        e.add_request(f"r{i}", ids(n, 400 + i), sp)
    reasons = {}

    def step():
        for o in e.step():
            if o.finished:
                reasons[o.request_id] = o.finish_reason

    step()  # r0 prefilled, r1 mid-prefill; r3, r4 wait (3 seqs max)
    req = e.scheduler.requests
    assert req["r1"].slot and 0 < req["r1"].num_computed_tokens < 60 and not req["r4"].slot
    e.abort_request("r1")
    e.abort_request("r4")
    for _ in range(3):
        step()
    assert req["r0"].output_ids and req["r0"].slot  # mid-decode
    e.abort_request("r0")
    while e.has_unfinished():
        step()
    assert [reasons[k] for k in ("r0", "r1", "r4")] == [FinishReason.ABORT] * 3
    assert reasons["r2"] is reasons["r3"] is FinishReason.LENGTH
    assert e.stats() == base


def watch_steps(e) -> dict:
    """Wrap the runner's forward entry (launch under async scheduling, else execute): every
    step must leave each slot and KV page it does not name bit-identical; count the kinds of
    steps seen. Stale state is poisoned first."""
    r, cache = e.runner, e.runner.cache
    cache.rec[:, 1:].normal_()  # stale state of earlier owners: must stay until reset_state
    cache.conv[:, 1:].normal_()
    cache.k[:, 1:].normal_()
    # violations are recorded, not raised: the engine turns a runner exception into ERROR
    # outputs for that batch and carries on, which would hide an assert raised in here
    seen = {"prefill_only_multi_new": 0, "mixed": 0, "running_skipped": 0, "wrote_outside": []}
    entry = "launch" if hasattr(r, "launch") else "execute"
    orig = getattr(r, entry)

    def execute(so, *args, **kwargs):
        slots = {s.slot for s in so.seqs}
        pages = {p for s in so.seqs for p in s.page_ids}
        other_slots = [i for i in range(1, r.num_slots) if i not in slots]
        other_pages = [i for i in range(1, r.num_pages) if i not in pages]
        before = (cache.rec[:, other_slots].clone(), cache.conv[:, other_slots].clone(),
                  cache.k[:, other_pages].clone(), cache.v[:, other_pages].clone())
        out = orig(so, *args, **kwargs)
        after = (cache.rec[:, other_slots], cache.conv[:, other_slots], cache.k[:, other_pages],
                 cache.v[:, other_pages])
        names = ("rec", "conv", "k", "v")
        bad = [n for n, a, b in zip(names, before, after) if not torch.equal(a, b)]
        if bad:
            seen["wrote_outside"].append((sorted(slots), bad))
        decodes = sum(len(s.token_ids) == 1 and not s.reset_state for s in so.seqs)
        seen["prefill_only_multi_new"] += decodes == 0 and sum(s.reset_state for s in so.seqs) >= 2
        seen["mixed"] += 0 < decodes < len(so.seqs)
        seen["running_skipped"] += any(q.slot not in slots for q in e.scheduler.running)
        return out

    setattr(r, entry, execute)
    return seen


def drain(e) -> None:
    while e.has_unfinished():
        e.step()


def steps_leave_other_slots_and_pages_bit_identical(make, quick: bool = False) -> None:
    """Every step — prefill-only with several new requests, mixed prefill+decode, a step that
    skips a live running request — leaves each slot and KV page it does not name bit-identical
    (failure-cases §1: a prefill-only step wrote request 1's state into request 0's area).
    quick: fewer, shorter requests and no preemption case (Triton's interpreter is slow)."""
    sp = SamplingParams(max_tokens=3 if quick else 6, temperature=0.0, ignore_eos=True)
    # budget 4: the first step admits three 1–2-token prompts (prefill only); later steps mix
    # decode rows with 1-token prefill chunks
    e = make(budget=4, max_num_seqs=6, max_model_len=64, num_pages=40)
    seen = watch_steps(e)
    for i, n in enumerate((1, 2, 1, 5) if quick else (1, 2, 1, 9, 14, 6)):
        e.add_request(f"a{i}", ids(n, 200 + i), sp)
    for _ in range(2 if quick else 6):
        e.step()
    for i, n in enumerate((3,) if quick else (3, 1, 20)):
        e.add_request(f"b{i}", ids(n, 300 + i), sp)
    drain(e)
    assert not seen["wrote_outside"], f"steps wrote outside their slots/pages: {seen['wrote_outside']}"
    assert seen["prefill_only_multi_new"] and seen["mixed"], seen
    if quick:
        return
    # 4 KV pages: the newest request's prefill runs out of pages while the older one decodes,
    # so it waits holding its slot and pages (then is preempted when the decode needs a page)
    e = make(budget=16, max_num_seqs=2, max_model_len=64, num_pages=5)
    seen = watch_steps(e)
    e.add_request("a", ids(10, 500), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    e.add_request("b", ids(60, 501), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    drain(e)
    assert not seen["wrote_outside"], f"steps wrote outside their slots/pages: {seen['wrote_outside']}"
    assert seen["running_skipped"], seen


def long_generation_equals_one_prefill(make, *, n: int, tol: float) -> None:
    """failure-cases §7 (a model repeating one character after ~5k generated tokens): n decode
    steps — the GDN states updated n times in place, KV over n/16 pages — compute what one
    teacher-forced prefill of the same tokens computes, at spot positions from the prompt to the
    last decode step; and the prefill's next token is the generation's last."""
    P = ids(17, 7000)
    max_len = len(P) + n + 16
    t1, h1 = engine_greedy(make(max_num_seqs=1, max_model_len=max_len), {"g": P}, n,
                           capture=True)
    full = P + t1["g"][:-1]  # every token the decode steps consumed
    t2, h2 = engine_greedy(make(budget=len(full), max_num_seqs=1, max_model_len=max_len),
                           {"g": full}, 1, capture=True)
    assert t2["g"] == t1["g"][-1:]
    # prompt end, page and chunk edges, mid-generation, the last decode step
    rows = torch.tensor(sorted({0, 16, 17, 255, 256, 1023, 1024, n // 2, len(full) - 1}))
    assert rel(h1["g"][rows], h2["g"][rows]) <= tol
