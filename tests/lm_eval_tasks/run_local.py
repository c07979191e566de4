"""Run the local task set through lm-evaluation-harness's Python API against a running server
and print what the test checks, as JSON: each task's metrics and each sample's arguments and
responses (per-choice log-likelihoods for multiple choice, the text for generation).

    python tests/lm_eval_tasks/run_local.py BASE_URL [TOKENIZER_DIR]

It runs what `lm-eval run --model local-completions ... --include_path tests/lm_eval_tasks`
runs (docs/evaluation.md), without indexing lm-eval's built-in tasks (~7 s a run): the multiple
choice and generation tasks through local-completions (token-id prompts, 4 a request), then
the generation task through local-chat-completions (chat template, text). Tokens come from the
server's /tokenize (lm-eval's default `tokenizer_backend` finds it), or with TOKENIZER_DIR
from that directory's Hugging Face tokenizer files. Offline: the
Hugging Face clients are set offline and any connection to a host other than the loopback
raises.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"
_connect = socket.socket.connect


def _loopback_only(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise OSError(f"this run is offline: refused a connection to {address!r}")
    return _connect(self, address)


socket.socket.connect = _loopback_only

HERE = Path(__file__).resolve().parent


def run(base_url: str, tokenizer: str | None = None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(HERE), include_defaults=False)
    out = {}
    for model, path, names, extra in (
            ("local-completions", "/v1/completions", ["nano_mc", "nano_gen"],
             {"batch_size": 4}),
            ("local-chat-completions", "/v1/chat/completions", ["nano_gen"],
             {"apply_chat_template": True})):
        args = f"model=nano,base_url={base_url}{path},max_retries=1"
        if tokenizer is not None and model == "local-completions":
            args += f",tokenizer_backend=huggingface,tokenizer={tokenizer}"
        res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=names,
                                      task_manager=tasks, log_samples=True,
                                      **extra)
        out[model] = {
            "results": {t: {k: v for k, v in r.items() if isinstance(v, (int, float))}
                        for t, r in res["results"].items()},
            "samples": {t: [{"doc_id": s["doc_id"], "arguments": s["arguments"],
                             "resps": s["resps"], "target": s["target"]} for s in samples]
                        for t, samples in res["samples"].items()},
        }
    return out


if __name__ == "__main__":
    json.dump(run(*sys.argv[1:3]), sys.stdout, default=str)
