#!/usr/bin/env python3
"""lm-evaluation-harness's requests over the local task set (tests/lm_eval_tasks/), replayed
with the standard library only: for the GPU machine, which cannot install lm-eval (its wheels,
pyarrow, pandas, scikit-learn..., exceed what a device call carries) and reaches no index.

`run` sends what lm-eval 0.4's local-completions sends (tests/server/test_evaluation.py checks
that the two give the same per-choice log-likelihoods on the nano server): each multiple-choice
pair encoded as lm-eval's `_encode_pair` does, sorted as its Collator sorts them (longest
first), `batch_size` token-id prompts a request with `echo: true, logprobs: 1, max_tokens: 1,
temperature: 0, seed: 1234`, scored as its `parse_logprobs` (the sum of `token_logprobs[ctxlen:
-1]`); the generation task greedy up to a newline. `ttft` times the first streamed chunk of a
prompt of N random token ids with and without echo + logprobs (the prompt logprobs' cost).
`compare` judges an FP8 run against a bf16 run with a noise floor measured the same way
(docs/evaluation.md): mean squared per-token logprob difference within the gate's
`fp8.vs_bf16_reference.max_kl_vs_floor` times the floor's, and echo's TTFT at most 1.3x.

    python lab/lm_eval_replay.py run http://127.0.0.1:8001 --tokenizer /tmp/full --out bf16.json
    python lab/lm_eval_replay.py ttft http://127.0.0.1:8001 --out ttft-bf16.json
    python lab/lm_eval_replay.py compare --base bf16.json --floor floor.json --other fp8.json \\
        --ttft ttft-bf16.json ttft-fp8.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
MAX_TTFT_RATIO = 1.3  # issue 58: a 1,024-token prompt with echo at most 1.3x its TTFT without


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def rows(name: str) -> list[dict]:
    return [json.loads(ln) for ln in (TASKS / name).read_text().splitlines() if ln.strip()]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair (causal LM)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def run(args) -> dict:
    sys.path.insert(0, str(ROOT))
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    pairs = []  # (doc, choice, ctx ids, continuation ids)
    for d, doc in enumerate(rows("nano_mc.jsonl")):
        for c, choice in enumerate(doc["choices"]):
            pairs.append((d, c, *encode_pair(tok, doc["context"], choice)))
    order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i][2] + pairs[i][3]),
                                                     tuple(pairs[i][2] + pairs[i][3])))
    scored = {}
    for b in range(0, len(order), args.batch_size):
        batch = order[b:b + args.batch_size]
        out = post(args.base_url, {"model": args.model, "prompt": [pairs[i][2] + pairs[i][3]
                                                                   for i in batch],
                                   "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                   "seed": 1234, "echo": True})
        for i, choice in zip(batch, sorted(out["choices"], key=lambda c: c["index"])):
            n = len(pairs[i][2])
            lps = choice["logprobs"]["token_logprobs"][n:-1]
            tops = choice["logprobs"]["top_logprobs"][n:-1]
            scored[i] = {"doc": pairs[i][0], "choice": pairs[i][1], "ctxlen": n,
                         "token_logprobs": lps, "loglik": sum(lps),
                         "is_greedy": all(lp == max(t.values()) for lp, t in zip(lps, tops))}
    docs = rows("nano_mc.jsonl")
    choices = [scored[i] for i in range(len(pairs))]
    acc = []
    for d, doc in enumerate(docs):
        ll = [c["loglik"] for c in choices if c["doc"] == d]
        acc.append(max(range(len(ll)), key=ll.__getitem__) == doc["label"])
    gen = []
    for doc in rows("nano_gen.jsonl"):
        out = post(args.base_url, {"model": args.model, "prompt": tok.encode(doc["context"]),
                                   "temperature": 0, "max_tokens": 12, "stop": ["\n"],
                                   "seed": 1234})
        text = out["choices"][0]["text"]
        gen.append({"text": text, "exact_match": text.lstrip() == doc["target"]})
    return {"base_url": args.base_url, "choices": choices, "acc": sum(acc) / len(acc),
            "generation": gen}


def first_chunk_s(base: str, body: dict) -> float:
    """Seconds from sending a streamed request to its first data chunk."""
    host, port = base.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    while not resp.readline().startswith(b"data: "):
        pass
    took = time.perf_counter() - t0
    resp.read()
    conn.close()
    return took


def ttft(args) -> dict:
    ids = random.Random(0).choices(range(300, args.max_id), k=args.tokens)
    plain = {"model": args.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    echo = {**plain, "echo": True, "logprobs": 1}
    for _ in range(args.warmup):
        first_chunk_s(args.base_url, plain), first_chunk_s(args.base_url, echo)
    a, b = [], []
    for _ in range(args.repeats):  # alternating, so drifts hit both alike
        a.append(first_chunk_s(args.base_url, plain))
        b.append(first_chunk_s(args.base_url, echo))
    return {"tokens": args.tokens, "ttft_s": a, "ttft_echo_s": b,
            "median_s": statistics.median(a), "median_echo_s": statistics.median(b),
            "ratio": statistics.median(b) / statistics.median(a)}


def msd(a: dict, b: dict) -> float:
    """Mean squared difference of the per-token logprobs of two runs' choices."""
    d = [(x - y) ** 2 for ca, cb in zip(a["choices"], b["choices"])
         for x, y in zip(ca["token_logprobs"], cb["token_logprobs"])]
    return sum(d) / len(d)


def compare(args) -> dict:
    load = lambda p: json.loads(Path(p).read_text())  # noqa: E731
    base, floor, other = load(args.base), load(args.floor), load(args.other)
    factor = json.loads((ROOT / "eval" / "thresholds.json").read_text()
                        )["fp8"]["vs_bf16_reference"]["max_kl_vs_floor"]
    f, o = msd(floor, base), msd(other, base)
    def picks(r: dict) -> list[int]:  # each question's choice of the highest log-likelihood
        by_doc: dict[int, list[float]] = {}
        for c in r["choices"]:
            by_doc.setdefault(c["doc"], []).append(c["loglik"])
        return [max(range(len(v)), key=v.__getitem__) for _, v in sorted(by_doc.items())]

    pb, po = picks(base), picks(other)
    verdict = {
        "floor_msd": f, "fp8_msd": o, "max_factor": factor, "fp8_vs_floor": o / f if f else None,
        "max_abs_loglik_diff": max(abs(x["loglik"] - y["loglik"])
                                   for x, y in zip(other["choices"], base["choices"])),
        "same_picks": sum(p == q for p, q in zip(pb, po)) / len(pb),
        "loglik_ok": o <= factor * f,
    }
    for p in args.ttft or ():
        t = load(p)
        verdict[f"ttft_ratio {Path(p).stem}"] = t["ratio"]
        verdict["ttft_ok"] = verdict.get("ttft_ok", True) and t["ratio"] <= MAX_TTFT_RATIO
    verdict["passed"] = verdict["loglik_ok"] and verdict.get("ttft_ok", True)
    return verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("base_url")
    r.add_argument("--tokenizer", required=True, help="checkpoint directory of the tokenizer")
    r.add_argument("--model", default=None)
    r.add_argument("--batch-size", type=int, default=4)
    t = sub.add_parser("ttft")
    t.add_argument("base_url")
    t.add_argument("--model", default=None)
    t.add_argument("--tokens", type=int, default=1024)
    t.add_argument("--max-id", type=int, default=150000,
                   help="prompt ids are drawn below this (the nano model: 4000)")
    t.add_argument("--repeats", type=int, default=10)
    t.add_argument("--warmup", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("--base", required=True)
    c.add_argument("--floor", required=True)
    c.add_argument("--other", required=True)
    c.add_argument("--ttft", nargs="*")
    for p in (r, t, c):
        p.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    result = {"run": run, "ttft": ttft, "compare": compare}[args.cmd](args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text if args.cmd != "run" else json.dumps({k: result[k] for k in ("acc", "generation")}))
    return 0 if result.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
