"""Measurable like any endpoint (issue 58): prompt logprobs over HTTP — completions' `echo`
(OpenAI's legacy shape), vLLM's `prompt_logprobs` (completions per choice, chat at the top
level), `max_tokens` 0 — and `min_tokens` with streaming, `n` and structured output, on the
nano model behind a real server; then lm-evaluation-harness itself (local-completions and
local-chat-completions) over the local task set in tests/lm_eval_tasks/, its per-choice
log-likelihoods checked against transformers' log-softmax over the nano weights (fp32).
The engine's side: tests/engine/test_prompt_logprobs.py, test_min_tokens.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from nano_server import nano_server, nano_servers  # noqa: F401 - the fixture

import tailored

pytestmark = pytest.mark.usefixtures("nano_servers")

NANO = Path(tailored.__file__).parent / "data" / "nano"
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "lm_eval_tasks"
TOL = 2e-4  # a logprob, ours (fp32, the plain path) against transformers' (fp32)
PROMPT = "import os\n\nclass Reader:\n    def __init__(self"

SEEN: list = []  # (prompt ids, SamplingParams) of every engine request of this module's server


def record(prompt_ids, sampling):
    SEEN.append((tuple(prompt_ids), sampling))
    return sampling


@pytest.fixture(scope="module")
def srv():
    return nano_server(record)


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref():
    """ids -> [len(ids), vocab] log-softmax rows of transformers' model over the nano weights
    (row p: the distribution of token p + 1)."""
    from tailored.gate.reference import reference_from_files

    model = reference_from_files(NANO)

    def logprobs(ids) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].float(), -1)

    return logprobs


def post(client, path: str, **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- echo and prompt_logprobs -------------------------------------------------------------------
def test_echo_with_logprobs_is_the_prompt_then_the_completion(client, srv, ref):
    """What lm-eval reads: the prompt's tokens first (the first one's logprob and
    top_logprobs null, the others the model's), then the completion's, exactly as without
    echo; text_offset walks the returned text; usage as without echo."""
    ids = srv.tokenizer.encode(PROMPT)
    body = dict(prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    got = post(client, "/v1/completions", echo=True, **body)
    plain = post(client, "/v1/completions", **body)
    c, p = got["choices"][0], plain["choices"][0]
    assert c["text"] == PROMPT + p["text"]
    lp, P = c["logprobs"], len(ids)
    assert len(lp["tokens"]) == P + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = ref(ids)
    for pos in range(1, P):
        assert abs(lp["token_logprobs"][pos] - rows[pos - 1, ids[pos]].item()) <= TOL
        top = lp["top_logprobs"][pos]  # the k most likely and the prompt's token
        assert lp["tokens"][pos] in top and 2 <= len(top) <= 3
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][P:] == p["logprobs"][key]
    offsets = lp["text_offset"] + [len(c["text"])]
    assert [c["text"][a:b] for a, b in zip(offsets, offsets[1:])] == lp["tokens"]
    assert got["usage"] == plain["usage"] == {"prompt_tokens": P, "completion_tokens": 3,
                                             "total_tokens": P + 3}


def test_echo_of_token_id_prompts_alone_in_a_batch_with_n(client, srv, ref):
    """max_tokens 0 with echo: the prompt alone, for a batch of token-id prompts (what lm-eval
    sends), each with n choices; no completion tokens."""
    tok = srv.tokenizer
    prompts = [tok.encode("def fibonacci(n):"), tok.encode("for i in range(10):\n")]
    got = post(client, "/v1/completions", prompt=prompts, echo=True, logprobs=1,
               max_tokens=0, n=2)
    assert len(got["choices"]) == 4
    for k, c in enumerate(got["choices"]):
        ids = prompts[k // 2]
        assert c["index"] == k and c["finish_reason"] == "length"
        assert c["text"] == tok.decode(ids)
        lps = c["logprobs"]["token_logprobs"]
        rows = ref(ids)
        assert lps[0] is None and len(lps) == len(ids)
        assert all(abs(lps[p] - rows[p - 1, ids[p]].item()) <= TOL for p in range(1, len(ids)))
    assert got["usage"]["completion_tokens"] == 0
    assert got["usage"]["prompt_tokens"] == sum(map(len, prompts))
    echo_only = post(client, "/v1/completions", prompt=PROMPT, echo=True, max_tokens=0)
    assert echo_only["choices"][0] == {"index": 0, "text": PROMPT, "logprobs": None,
                                      "finish_reason": "length"}


def check_vllm_entries(field, ids, rows, k):
    """vLLM's prompt_logprobs: null, then {id: {logprob, rank, decoded_token}} with the prompt's
    token first, then the k most likely ranked 1..k."""
    assert field[0] is None and len(field) == len(ids)
    for p in range(1, len(ids)):
        entry, row = field[p], rows[p - 1]
        first = next(iter(entry))
        assert first == str(ids[p])
        mine = entry[first]
        assert abs(mine["logprob"] - row[ids[p]].item()) <= TOL
        want = row[ids[p]].item()
        assert int((row > want + TOL).sum()) + 1 <= mine["rank"] <= int((row >= want - TOL).sum())
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if t != first
                        or v["rank"] <= k)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert all(abs(entry[str(t)]["logprob"] - row[t].item()) <= TOL for _, t in ranked)
        assert len(entry) in (k, k + 1) and all(isinstance(v["decoded_token"], str)
                                                for v in entry.values())


def test_prompt_logprobs_in_vllms_shape(client, srv, ref):
    tok = srv.tokenizer
    ids = tok.encode(PROMPT)
    got = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=3)
    c = got["choices"][0]
    assert c["text"] and "logprobs" in c and c["logprobs"] is None  # not echoed
    check_vllm_entries(c["prompt_logprobs"], ids, ref(ids), 3)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    chat = post(client, "/v1/chat/completions", messages=msgs, max_tokens=2, prompt_logprobs=1)
    chat_ids = tok.encode(tok.apply_chat_template(msgs))
    check_vllm_entries(chat["prompt_logprobs"], chat_ids, ref(chat_ids), 1)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    # not asked: no such key, in either API
    assert "prompt_logprobs" not in post(client, "/v1/chat/completions", messages=msgs,
                                         max_tokens=1)
    assert "prompt_logprobs" not in post(client, "/v1/completions", prompt="x",
                                         max_tokens=1)["choices"][0]


def sse(client, path: str, **body) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_echo_streams_the_prompt_in_the_first_chunk(client):
    body = dict(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, echo=True)
    whole = post(client, "/v1/completions", **body)["choices"][0]
    chunks = [ch["choices"][0] for ch in sse(client, "/v1/completions", **body)]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(ch["text"] for ch in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((ch["logprobs"][key] for ch in chunks if ch["logprobs"]), []) \
            == whole["logprobs"][key]


# ---- min_tokens ------------------------------------------------------------------------------
def test_min_tokens_streamed_with_n_and_under_a_grammar(client, srv):
    """EOS pushed to the top by logit_bias comes right after min_tokens tokens, streamed and
    for each of n choices; a grammar that can only end wins over min_tokens (its answer is
    complete: no 500 from every token masked)."""
    eos = str(srv.tokenizer.eos_token_ids[0])
    body = dict(prompt=PROMPT, max_tokens=12, min_tokens=5, logit_bias={eos: 100})
    chunks = sse(client, "/v1/completions", **body, stream_options={"include_usage": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 6  # 5 and the EOS
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "stop"
    got = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
               n=2, temperature=0.8, seed=3, **body)
    assert got["usage"]["completion_tokens"] == 12
    assert [c["finish_reason"] for c in got["choices"]] == ["stop", "stop"]
    pick = post(client, "/v1/completions", prompt="x = ", max_tokens=10, min_tokens=8,
                structured_outputs={"choice": ["yes", "no"]})["choices"][0]
    assert pick["text"] in ("yes", "no") and pick["finish_reason"] == "stop"


def test_bad_combinations_are_400s_naming_the_field_and_the_server_stays_healthy(client):
    cases = [
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"prompt": "x", "min_tokens": 10**6}, "min_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ]
    for body, param in cases:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert client.get("/health").json() == {"status": "ok"}
    assert post(client, "/v1/completions", prompt="x", max_tokens=1, echo=True,
                logprobs=0)["choices"][0]["text"].startswith("x")


def test_tokenizer_routes_in_vllms_shape(client, srv):
    """/tokenize, /detokenize, /tokenizer_info (tokenize_api.py): what lm-eval's remote
    tokenizer reads."""
    tok = srv.tokenizer
    text = "import os<|im_end|>"
    got = post(client, "/tokenize", prompt=text, add_special_tokens=False)
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0
    assert post(client, "/detokenize", tokens=got["tokens"]) == {"prompt": text}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"]
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": []}, "prompt"),
                              ("/detokenize", {"tokens": [10**7]}, "tokens"),
                              ("/detokenize", {"tokens": "12"}, "tokens")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


# ---- lm-evaluation-harness -----------------------------------------------------------------
def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair (causal): the context's trailing spaces go to the
    continuation; the continuation's ids are the whole's after the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def test_lm_eval_runs_unchanged_and_its_loglikelihoods_are_the_models(srv, ref, tmp_path):
    """The local task set through lm-eval 0.4's local-completions (multiple choice and
    generation; token-id prompts, 4 a request, tokenized by the server's /tokenize, which
    lm-eval finds by itself) and local-chat-completions (generation): the harness completes,
    sent echo + logprobs + max_tokens 1 for each choice, and each
    per-choice log-likelihood it reports is the sum of transformers' logprobs of the
    choice's tokens."""
    pytest.importorskip("lm_eval")
    SEEN.clear()
    run = subprocess.run([sys.executable, str(TASKS / "run_local.py"), srv.url],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout)
    comp, chat = out["local-completions"], out["local-chat-completions"]
    assert set(comp["results"]) == {"nano_mc", "nano_gen"}
    assert 0 <= comp["results"]["nano_mc"]["acc,none"] <= 1
    assert "exact_match,strip" in comp["results"]["nano_gen"]
    assert "exact_match,strip" in chat["results"]["nano_gen"]
    assert [len(s["resps"]) for s in chat["samples"]["nano_gen"]] == [1, 1]
    scored = {ids: sp for ids, sp in SEEN if sp.prompt_logprobs is not None}
    assert all(sp.max_tokens == 1 and sp.logprobs == 1 for sp in scored.values())
    tok = srv.tokenizer
    checked = 0
    for sample in comp["samples"]["nano_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx, cont = encode_pair(tok, context, continuation)
            whole = tuple(ctx + cont)
            assert whole in scored  # the very ids lm-eval sent
            rows = ref(whole)
            want = sum(rows[p - 1, whole[p]].item() for p in range(len(ctx), len(whole)))
            loglik = resp[0][0] if isinstance(resp[0], list) else resp[0]
            assert math.isclose(loglik, want, abs_tol=TOL * len(cont)), (context, continuation)
            checked += 1
    assert checked == 24  # 8 questions x 3 choices
    # the GPU run's stand-in for lm-eval (docs/evaluation.md) sends the same requests: the
    # same per-choice log-likelihoods
    replay = subprocess.run([sys.executable, str(ROOT / "lab" / "lm_eval_replay.py"), "run",
                             srv.url, "--tokenizer", str(NANO), "--out", str(tmp_path / "r.json")],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr[-4000:]
    mine = json.loads((tmp_path / "r.json").read_text())["choices"]
    theirs = [s["resps"][c][0][0] for s in comp["samples"]["nano_mc"]
              for c in range(len(s["resps"]))]
    assert len(mine) == len(theirs)
    assert all(math.isclose(m["loglik"], t, abs_tol=1e-5) for m, t in zip(mine, theirs))
