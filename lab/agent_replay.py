#!/usr/bin/env python3
"""Coding-agent sessions recorded and replayed against an OpenAI Responses / Anthropic Messages
server (tailored or vLLM): TTFT and prefix-cache hits of every turn (issue: the coding agents'
front doors, part 5; runbook in docs/agents.md).

    # 1. record: a proxy in front of a server (or none: each request is refused once recorded);
    #    point Codex CLI / Claude Code at it
    python lab/agent_replay.py record --upstream http://127.0.0.1:8000 --port 8100 \\
        --out codex.jsonl
    # 2. (optional) grow a recorded first turn into a multi-turn session: N tool round trips
    #    with source-code tool outputs, on the agent's real system prompt and tools
    python lab/agent_replay.py synth codex.jsonl --turns 8 --tool-tokens 1500 \\
        --out codex-8.jsonl
    # 3. replay, one turn at a time, streamed, against each server
    python lab/agent_replay.py replay codex-8.jsonl --base-url http://127.0.0.1:8000 \\
        --model qwen36-35b-a3b --max-tokens 64 --json tailored-codex.json

A session file is JSONL, one request a line: {"path": "/v1/responses" | "/v1/messages",
"body": {...}}. Replay sends each body as recorded (the model renamed, stream on, the output
capped at --max-tokens so decode time does not blur TTFT) and reports per turn: prompt
tokens, cached tokens by the server's usage (Responses input_tokens_details.cached_tokens,
Messages cache_read_input_tokens), prefix-cache hits by the server's Prometheus counters
(`tailored:prefix_cache_hits_total` / `vllm:prefix_cache_hits_total`, and the queries
beside them: hits / queries is the hit rate of that turn), TTFT (request sent -> first
generated text, reasoning or tool-call event) and end-to-end time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import httpx

DELTA_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                "response.function_call_arguments.delta", "content_block_delta")
METRIC = re.compile(r"^(tailored|vllm):prefix_cache_(hits|queries)(?:_total)?(?:\{[^}]*\})? "
                    r"([0-9.eE+-]+)$", re.M)


# ---- record ----------------------------------------------------------------------------------

def record(args) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    out = open(args.out, "a", encoding="utf-8")
    client = httpx.AsyncClient(base_url=args.upstream if args.upstream != "none"
                               else "http://127.0.0.1:9", timeout=None)

    async def forward(request: Request):
        body = await request.body()
        if request.method == "POST" and request.url.path in ("/v1/responses", "/v1/messages"):
            out.write(json.dumps({"path": request.url.path, "body": json.loads(body)},
                                 ensure_ascii=False) + "\n")
            out.flush()
            print(f"recorded {request.url.path} ({len(body)} bytes)", file=sys.stderr)
        if args.upstream == "none":  # recording first turns only: refuse, the agent stops
            return Response(json.dumps({"error": {"message": "recorded (no upstream)",
                                                  "type": "server_error"}}),
                            status_code=503, media_type="application/json")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "accept-encoding")}
        upstream = await client.send(client.build_request(
            request.method, request.url.path, params=request.query_params, content=body,
            headers=headers), stream=True)
        kind = upstream.headers.get("content-type", "application/json")
        if kind.startswith("text/event-stream"):
            async def relay():
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    await upstream.aclose()
            return StreamingResponse(relay(), status_code=upstream.status_code,
                                     media_type=kind)
        data = await upstream.aread()
        await upstream.aclose()
        return Response(data, status_code=upstream.status_code, media_type=kind)

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "HEAD"])])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


# ---- synth -----------------------------------------------------------------------------------

def _filler(tokens: int, seed: int) -> str:
    """~`tokens` tokens of real source code (the standard library's), as a tool's output."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = files[seed % len(files)].read_text(encoding="utf-8", errors="replace")
    while len(text) < tokens * 4:
        text += text
    return text[: tokens * 4]  # ~4 characters a token


def _arguments(schema: dict, turn: int) -> dict:
    """Arguments for a tool: a string for each required property (an enum's first value)."""
    props = (schema or {}).get("properties", {})
    args = {}
    for name in (schema or {}).get("required", []) or list(props)[:1]:
        spec = props.get(name, {})
        if spec.get("enum"):
            args[name] = spec["enum"][0]
        elif spec.get("type") in ("integer", "number"):
            args[name] = turn
        elif spec.get("type") == "boolean":
            args[name] = False
        else:
            args[name] = f"cat src/module_{turn}.py"
    return args


def synth(args) -> None:
    first = json.loads(Path(args.session).read_text().splitlines()[0])
    path, body = first["path"], first["body"]
    turns = [first]
    if path == "/v1/responses":
        tool = next(t for t in body.get("tools") or [] if t.get("type") == "function")
        items = list(body["input"]) if isinstance(body["input"], list) else [
            {"role": "user", "content": body["input"]}]
        for i in range(args.turns):
            call_id = f"call_replay_{i}"
            items += [{"type": "message", "role": "assistant", "content": [
                          {"type": "output_text", "text": f"Reading module {i}."}]},
                      {"type": "function_call", "call_id": call_id, "name": tool["name"],
                       "arguments": json.dumps(_arguments(tool.get("parameters"), i))},
                      {"type": "function_call_output", "call_id": call_id,
                       "output": _filler(args.tool_tokens, i)}]
            turns.append({"path": path, "body": {**body, "input": list(items)}})
    else:
        tool = (body.get("tools") or [{}])[0]
        msgs = list(body["messages"])
        for i in range(args.turns):
            use_id = f"toolu_replay_{i}"
            msgs += [{"role": "assistant", "content": [
                         {"type": "text", "text": f"Reading module {i}."},
                         {"type": "tool_use", "id": use_id, "name": tool.get("name", "Read"),
                          "input": _arguments(tool.get("input_schema"), i)}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": use_id,
                          "content": _filler(args.tool_tokens, i)}]}]
            turns.append({"path": path, "body": {**body, "messages": list(msgs)}})
    with open(args.out, "w", encoding="utf-8") as f:
        for t in turns:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(turns)} turns of {path}", file=sys.stderr)


# ---- replay ----------------------------------------------------------------------------------

async def _counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's prefix-cache counters (tokens), summed per kind; {} without /metrics."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for _, kind, value in METRIC.findall(text):
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


async def _turn(client: httpx.AsyncClient, rec: dict, args) -> dict:
    body = dict(rec["body"])
    body["stream"] = True
    if args.model:
        body["model"] = args.model
    if rec["path"] == "/v1/messages":
        body["max_tokens"] = args.max_tokens
        headers = {"x-api-key": args.api_key, "anthropic-version": "2023-06-01"}
    else:
        body["max_output_tokens"] = args.max_tokens
        headers = {"authorization": f"Bearer {args.api_key}"}
    before = await _counters(client)
    t0 = time.perf_counter()
    ttft, usage, status = None, {}, None
    async with client.stream("POST", rec["path"], json=body, headers=headers) as r:
        status = r.status_code
        if status != 200:
            return {"status": status, "error": (await r.aread()).decode()[:500]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event.get("type")
            if ttft is None and kind in DELTA_EVENTS:
                ttft = time.perf_counter() - t0
            if kind in ("response.completed", "response.incomplete"):
                u = event["response"].get("usage") or {}
                usage = {"prompt": u.get("input_tokens"),
                         "cached": (u.get("input_tokens_details") or {}).get("cached_tokens")}
            elif kind == "message_start":
                u = event["message"].get("usage") or {}
                cached = u.get("cache_read_input_tokens") or 0
                usage = {"prompt": (u.get("input_tokens") or 0) + cached, "cached": cached}
    e2e = time.perf_counter() - t0
    after = await _counters(client)
    row = {"status": status, "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
           "e2e_ms": round(e2e * 1e3, 1), "prompt_tokens": usage.get("prompt"),
           "cached_tokens": usage.get("cached")}
    if after:
        row["cache_hits"] = after.get("hits", 0) - before.get("hits", 0)
        row["cache_queries"] = after.get("queries", 0) - before.get("queries", 0)
        row["hit_rate"] = (round(row["cache_hits"] / row["cache_queries"], 3)
                           if row["cache_queries"] else None)
    return row


async def _replay(args) -> list[dict]:
    session = [json.loads(line) for line in Path(args.session).read_text().splitlines()
               if line.strip()]
    rows = []
    async with httpx.AsyncClient(base_url=args.base_url.removesuffix("/v1"),
                                 timeout=args.timeout) as client:
        for i, rec in enumerate(session):
            row = {"turn": i + 1, "path": rec["path"], **await _turn(client, rec, args)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def replay(args) -> None:
    rows = asyncio.run(_replay(args))
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hits':>7} {'rate':>6} {'TTFT ms':>9} "
          f"{'e2e ms':>9}")
    for r in rows:
        cells = [r.get("prompt_tokens"), r.get("cached_tokens"), r.get("cache_hits"),
                 r.get("hit_rate"), r.get("ttft_ms"), r.get("e2e_ms")]
        shown = ["-" if c is None else str(c) for c in cells]
        print(f"{r['turn']:>4} {shown[0]:>7} {shown[1]:>7} {shown[2]:>7} {shown[3]:>6} "
              f"{shown[4]:>9} {shown[5]:>9}")
    later = [r for r in rows[1:] if r.get("cache_queries")]
    summary = {
        "turns": len(rows),
        "ttft_ms_median": statistics.median([r["ttft_ms"] for r in rows if r.get("ttft_ms")])
        if any(r.get("ttft_ms") for r in rows) else None,
        "hit_rate_after_turn_1": (round(sum(r["cache_hits"] for r in later)
                                        / sum(r["cache_queries"] for r in later), 3)
                                  if later else None),
    }
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"base_url": args.base_url,
                                               "session": args.session, "rows": rows,
                                               "summary": summary}, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("record", help="a recording proxy in front of --upstream")
    r.add_argument("--upstream", required=True,
                   help="the server to forward to; 'none': answer 503 (record a first turn)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8100)
    r.add_argument("--out", required=True, help="the session file (JSONL, appended)")
    s = sub.add_parser("synth", help="grow a session's first turn into tool round trips")
    s.add_argument("session")
    s.add_argument("--turns", type=int, default=8)
    s.add_argument("--tool-tokens", type=int, default=1500)
    s.add_argument("--out", required=True)
    y = sub.add_parser("replay", help="send a session's turns one by one; TTFT and hits")
    y.add_argument("session")
    y.add_argument("--base-url", default="http://127.0.0.1:8000")
    y.add_argument("--model", default=None, help="the served model name (default: recorded)")
    y.add_argument("--max-tokens", type=int, default=64)
    y.add_argument("--api-key", default="replay")
    y.add_argument("--timeout", type=float, default=600.0)
    y.add_argument("--json", default=None, help="write the rows and summary here")
    args = p.parse_args(argv)
    {"record": record, "synth": synth, "replay": replay}[args.mode](args)


if __name__ == "__main__":
    main()
