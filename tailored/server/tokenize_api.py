"""vLLM's tokenizer routes, the served model's tokenizer over HTTP:

    POST /tokenize        {"prompt": str, "add_special_tokens"?: bool}
                          -> {"count", "max_model_len", "tokens": [ids], "token_strs": null}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": str}
    GET  /tokenizer_info  {"tokenizer_class", "eos_token", "pad_token", "bos_token": null,
                           "model_max_length", "chat_template"}

lm-evaluation-harness's local-completions looks for them first (`tokenizer_backend` auto:
`/tokenizer_info` with an `eos_token`, and `/tokenize`) and then tokenizes through the server,
so `--model_args model=...,base_url=...` needs no tokenizer files on the client
(docs/evaluation.md). The prompt is encoded as a completions prompt is (special-token text
becomes those tokens; no BOS: the Qwen tokenizer adds none, so add_special_tokens changes
nothing); the body limits and errors are the completions route's.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from tailored.server.errors import OpenAIError, shown
from tailored.server.http_io import error_response, read_json


def add_tokenizer_routes(app: FastAPI, server) -> None:
    """The three routes on `app`, over `server` (serving.Server: its tokenizer, limits)."""
    tok = server.tokenizer

    def special(token_id: int | None) -> str | None:
        return None if token_id is None else tok.decode([token_id], skip_special_tokens=False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            server.authorize(request)
            data = await read_json(request, server.max_body_bytes)
            prompt = data.get("prompt")
            if not isinstance(prompt, str):
                raise OpenAIError(f"'prompt' must be a string (got {shown(prompt)}); chat "
                                  "messages are not taken here", param="prompt")
            if not isinstance(data.get("add_special_tokens", False), bool):
                raise OpenAIError("'add_special_tokens' must be a boolean",
                                  param="add_special_tokens")
            ids = await server.encode(prompt, "prompt")
        except OpenAIError as e:
            return error_response(e)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            server.authorize(request)
            data = await read_json(request, server.max_body_bytes)
            ids = data.get("tokens")
            if not isinstance(ids, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise OpenAIError("'tokens' must be a list of token ids", param="tokens")
            server.check_token_ids(ids, "tokens")
        except OpenAIError as e:
            return error_response(e)
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = tok.eos_token_ids
        templates = getattr(tok, "_templates", None) or {}
        return {"tokenizer_class": type(tok).__name__,
                "eos_token": special(eos[0] if eos else None),
                "pad_token": special(tok.token_to_id("<|endoftext|>")),
                "bos_token": None,
                "model_max_length": server.max_model_len,
                "chat_template": templates.get("default")}
