"""The full soak (issue 57 item 4) at small scale on the CPU: mixed prompt lengths, half
streamed, clients leaving mid-stream, prefix-cache hits compared with cold references, grammars,
every answer against the same request alone, and the server's requests, KV pages and state slots
back to idle. The GPU run is the same tool at 3,000+ requests (docs/accuracy.md#soak)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tailored.bench import soak as soak_mod
from tailored.bench import soakcheck
from tailored.bench.soakcheck import Reference, judge
from tests.live_server import LiveServer


@pytest.fixture(scope="module")
def nano():
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    stack = build_stack(None, max_model_len=512, max_num_seqs=8, progress=False,
                        prefix_cache_entries=4)
    app = build_app(AsyncEngine(stack.engine), stack.tokenizer, "nano", 512)
    with LiveServer(app, start_timeout=30) as srv:
        yield srv.url, stack.tokenizer.vocab_size


def _ref():
    # tokens "ab", "cd", "ef"; at the second the alternatives "cx" (gap 0.05) and "z" (0.5)
    return Reference("abcdef", ["ab", "cd", "ef"], [0, 2, 4], [-0.1, -0.6, -0.2],
                     [{"ab": -0.1}, {"cd": -0.6, "cx": -0.65, "z": -1.1}, {"ef": -0.2}])


def test_judge_same_prefix_tie_and_decisive():
    r = _ref()
    assert judge("abcdef", r, 0.1)[0] == "same"
    assert judge("abc", r, 0.0, partial=True)[0] == "same"  # a client that left: a prefix
    assert judge("abc", r, 0.1)[0] == "decisive"  # a whole answer must be whole
    verdict, d = judge("abcxyz", r, 0.1)
    assert verdict == "tie" and d["token_index"] == 1 and d["gap"] == pytest.approx(0.05)
    assert judge("abcxyz", r, 0.01)[0] == "decisive"  # the gap is beyond this bound
    assert judge("abzzz", r, 0.1)[0] == "decisive"  # "z" is an alternative 0.5 behind
    assert judge("abqqq", r, 1.0)[0] == "decisive"  # no alternative starts the rest
    assert judge("abcxyz", r, 0.0)[0] == "decisive"  # no tie gap: every difference counts
    assert judge("abcxyz", Reference("abcdef"), 0.1)[0] == "decisive"  # no logprobs
    assert judge("abcdxx", r, 0.0, partial=True)[0] == "decisive"


def test_reference_of_a_completion_choice():
    c = {"text": "abcd", "logprobs": {"tokens": ["ab", "cd"], "text_offset": [0, 2],
                                      "token_logprobs": [-0.1, None],
                                      "top_logprobs": [{"ab": -0.1}, None]}}
    r = Reference.of(c)
    assert r.tokens == ["ab", "cd"] and r.offsets == [0, 2] and r.tops == [{"ab": -0.1}, {}]
    assert Reference.of({"text": "x", "logprobs": None}).tokens is None


def test_leaks_and_waiting_for_idle():
    page = ("# HELP x\ntailored:num_requests_running{model_name=\"m\"} {r}\n"
            "tailored:num_requests_waiting{model_name=\"m\"} 0.0\n"
            "tailored:kv_cache_pages_used{model_name=\"m\"} {u}\n"
            "tailored:kv_cache_pages_cached{model_name=\"m\"} 2.0\n"
            "tailored:gdn_state_slots_used{model_name=\"m\"} {s}\n"
            "tailored:prefix_cache_hits_total{model_name=\"m\"} 7.0\n")
    pages = [page.replace("{r}", "1.0").replace("{u}", "9.0").replace("{s}", "1.0"),
             page.replace("{r}", "0.0").replace("{u}", "2.0").replace("{s}", "0.0")]

    class Resp:
        def __init__(self, text):
            self.status_code, self.text = 200, text

    class Client:  # a server that reaps its last request between two polls
        async def get(self, url):
            return Resp(pages.pop(0) if len(pages) > 1 else pages[0])

    before = {"requests": 0.0, "pages": 0.0, "slots": 0.0}
    assert soakcheck.leaks(before, {"requests": 1.0, "pages": 7.0, "slots": 1.0}) == [
        "requests: 1 held, 0 when idle", "pages: 7 held, 0 when idle",
        "slots: 1 held, 0 when idle"]
    now, held, _ = asyncio.run(soakcheck.wait_idle(Client(), "http://x", before, 5, 0.01))
    assert held == [] and now == {"source": "/metrics", "requests": 0.0, "pages": 0.0,
                                  "slots": 0.0, "prefix_cache_hits": 7.0}


@pytest.mark.contract("concurrency-soak")
def test_full_soak_on_the_nano_model(nano, tmp_path, capsys):
    """Every feature of the GPU soak at small scale: 16 prompts x 3 rounds at c=8 (+ the 16
    references), half streamed, a quarter of each round's clients leaving mid-stream, every 4th
    prompt extending the one before (its reference cold), every 5th with a grammar; 0 errors,
    every answer equal to its answer alone (fp32: exact), nothing held afterwards."""
    url, vocab = nano
    structured = 5 if _has_xgrammar() else 0
    out = tmp_path / "soak.json"
    rc = soak_mod.main(["--base-url", url, "--prompts", "16", "--concurrency", "8",
                        "--rounds", "3", "--max-tokens", "12", "--max-prompt-len", "150",
                        "--token-id-range", f"1,{vocab}", "--prefix-every", "4",
                        "--structured-every", str(structured), "--disconnect-fraction", "0.25",
                        "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["ok"], capsys.readouterr().out
    assert rep["requests"] == 64 and rep["errors"] == [] and rep["mismatches"] == []
    assert rep["disconnected"] > 0 and rep["compared"] == 48
    assert rep["cold_references"] is True and rep["prefix_cache_hits"] > 0
    assert rep["idle_before"]["source"] == "/metrics" and rep["leaks"] == []
    assert rep["idle_after"]["pages"] == rep["idle_before"]["pages"]
    assert rep["idle_after"]["slots"] == rep["idle_before"]["slots"] == 0


def test_soak_with_a_tie_gap_reads_the_references_logprobs(nano):
    """With --tie-gap the references carry their top logprobs; fp32 under load still equals
    them (no tie, no mismatch)."""
    url, vocab = nano
    res = asyncio.run(soak_mod.soak(url, prompts=6, concurrency=6, rounds=1, max_tokens=8,
                                    token_id_range=(1, vocab), max_prompt_len=80,
                                    tie_gap=0.1, max_decisive_fraction=0.05))
    assert res.ok and res.ties == [] and res.mismatches == [] and res.compared == 6


def _has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def test_serve_draws_the_gates_stable_dummy_weights(tiny_ckpt, monkeypatch):
    """The full-size soak compares greedy answers, which means something only on the gate's
    well-conditioned fixture: `tailored serve --load-format dummy --dummy-init stable --seed S`
    must build the model exactly as `tailored gate --load-format dummy --seed S` does (same
    build_stack arguments for the weights; the gate's default init is the stable one)."""
    import tailored.stack
    from tailored.cli import main as cli_main

    class Built(Exception):
        pass

    calls = []

    def capture(ckpt, **kw):
        calls.append({k: kw.get(k) for k in ("load_format", "seed", "dummy_init", "num_layers")})
        raise Built

    monkeypatch.setattr(tailored.stack, "build_stack", capture)
    with pytest.raises(Built):
        cli_main(["serve", str(tiny_ckpt), "--load-format", "dummy", "--dummy-init", "stable",
                  "--seed", "3", "--engine-process", "off", "--device", "cpu"])
    with pytest.raises(Built):
        cli_main(["gate", str(tiny_ckpt), "--load-format", "dummy", "--seed", "3",
                  "--device", "cpu"])
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0] == {"load_format": "dummy", "seed": 3, "dummy_init": "stable",
                        "num_layers": None}
