#!/usr/bin/env python3
"""Train `nano`: a ~3.8 M-parameter model of exactly the Qwen3.6-35B-A3B architecture (issue 5).

One command, offline, deterministic from --seed:
  corpus (Python stdlib sources + Debian licence texts, lab/nano/corpus.py)
  → byte-level BPE tokenizer with the Qwen added tokens (lab/nano/tok.py)
  → training (batched differentiable forward, lab/nano/model.py; bf16 autocast on GPU)
  → evaluation (held-out perplexity, MTP acceptance for 1–3 greedy drafts, greedy completion)
  → export: an ordinary HF checkpoint dir (config.json, generation_config.json, tokenizer.json,
    tokenizer_config.json, model.safetensors in bf16 with official names incl. mtp.*),
    training_manifest.json, loss_curve.csv, nano_eval.json (greedy code-completion fixture)
  → export check on the CPU in fp32: tailored's engine vs the training forward and vs
    transformers (relative error ≤ 1e-4), greedy completion through the serving stack.

GPU (≈ 4–5 min wall incl. corpus/tokenizer, see docs/nano.md):
  PYTHONPATH=$PWD python lab/train_nano.py --out $OUT/nano --steps auto --time-budget 150
CPU smoke (placeholder checkpoint):
  PYTHONPATH=$PWD python lab/train_nano.py --out tailored/data/nano --device cpu --smoke
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no kernel downloads from transformers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # lab/ → `import nano`
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # repo root → `import tailored`

import torch
from nano import evaluate as ev
from nano import model as nm
from nano.corpus import build_corpus, resolve_sources
from nano.tok import PAD_ROWS, token_ids, train_tokenizer, write_tokenizer

MAX_BYTES = 8_000_000
FIB = "def fibonacci(n):"
OUR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "model.safetensors", "model.safetensors.index.json", "training_manifest.json",
             "loss_curve.csv", "nano_eval.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 helps on a shared, busy CPU)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke preset: 8 MB corpus, batch 8×128, 150 steps, small evals")
    g = p.add_argument_group("data")
    g.add_argument("--corpus", default="auto",
                   help="comma list of stdlib, copyright, transformers; or auto = stdlib,copyright "
                        "(+transformers when the stdlib has no test suite), see nano/corpus.py")
    g.add_argument("--max-corpus-mb", type=float, default=None,
                   help="use at most this many MB of training files (deterministic hash order)")
    g.add_argument("--vocab-size", type=int, default=4096,
                   help=f"embedding rows; the BPE gets vocab−{PAD_ROWS} regular tokens")
    g.add_argument("--tok-train-mb", type=float, default=16.0,
                   help="MB of training text the BPE is trained on (hash order)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", default="auto",
                   help="optimizer steps, or 'auto': measure the step time during warm-up and "
                        "fit --time-budget (the chosen count is in the manifest; pass it back "
                        "as --steps N to reproduce the run exactly)")
    g.add_argument("--time-budget", type=float, default=150.0,
                   help="seconds of training for --steps auto; any run stops at 1.2× this")
    g.add_argument("--batch-size", type=int, default=128)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP (t+2) loss")
    g.add_argument("--aux-weight", type=float, default=0.01, help="MoE load-balancing loss weight")
    g.add_argument("--amp", choices=["auto", "bf16", "none"], default="auto",
                   help="auto: bf16 autocast on cuda, fp32 on cpu")
    g.add_argument("--compile", action="store_true", help="torch.compile the training loss")
    g.add_argument("--log-every", type=int, default=25)
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-tokens", type=int, default=1_000_000, help="held-out tokens for ppl")
    g.add_argument("--accept-prompts", type=int, default=64)
    g.add_argument("--accept-prompt-len", type=int, default=64)
    g.add_argument("--accept-gen", type=int, default=128)
    g.add_argument("--fixture-prompts", type=int, default=16)
    g.add_argument("--fixture-tokens", type=int, default=48,
                   help="greedy tokens of the fibonacci completion and the fixture prompts")
    g.add_argument("--no-check", action="store_true", help="skip the CPU export check")
    a = p.parse_args(argv)
    if a.smoke:
        smoke = {"max_corpus_mb": 8.0, "tok_train_mb": 4.0, "batch_size": 8, "seq_len": 128,
                 "steps": "150", "warmup": 30, "lr": 3e-3, "eval_tokens": 20_000,
                 "accept_prompts": 8, "accept_prompt_len": 32, "accept_gen": 32,
                 "fixture_prompts": 4, "fixture_tokens": 32, "log_every": 10,
                 "time_budget": 1800.0}
        for k, v in smoke.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    return a


def log(msg: str) -> None:
    print(f"[nano {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def doc_order_key(d) -> str:
    return hashlib.sha256(f"{d.source}:{d.rel}".encode()).hexdigest()


def versions(device: torch.device) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "platform": platform.platform()}
    for mod in ("transformers", "tokenizers", "safetensors", "triton"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            v[mod] = None
    if device.type == "cuda":
        v["cuda"] = torch.version.cuda
        v["gpu"] = torch.cuda.get_device_name(device)
        v["gpu_capability"] = list(torch.cuda.get_device_capability(device))
    v["cpu_threads"] = torch.get_num_threads()
    return v


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def lr_at(step: int, total: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, total - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def fixture_prompts(docs, n: int) -> list[str]:
    """Code-completion prompts from held-out stdlib files: ≤ 400 chars of context ending with
    the first `def` line of the file (prompt ends at the newline after the signature)."""
    out = []
    for d in docs:
        if len(out) >= n:
            break
        if d.source != "stdlib":
            continue
        text = d.text
        i = text.find("\ndef ")
        if i < 0:
            i = text.find("\n    def ")
        if i < 0:
            continue
        end = text.find("\n", i + 1)
        if end < 0:
            continue
        start = max(0, text.rfind("\n", 0, max(0, end - 400)) + 1) if end > 400 else 0
        out.append(text[start:end + 1])
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    dev = torch.device("cuda" if (a.device == "auto" and torch.cuda.is_available()) else
                       (a.device if a.device != "auto" else "cpu"))
    bf16 = a.amp == "bf16" or (a.amp == "auto" and dev.type == "cuda")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in OUR_FILES:
        (out / f).unlink(missing_ok=True)
    kind = "gpu" if dev.type == "cuda" else "cpu-smoke"
    log(f"device {dev} ({kind}), amp {'bf16' if bf16 else 'fp32'}, seed {a.seed}, out {out}")

    # ---- 1. corpus ----------------------------------------------------------------------------
    t0 = time.monotonic()
    docs, corpus = build_corpus(resolve_sources(a.corpus))
    train_docs = sorted((d for d in docs if not d.heldout), key=doc_order_key)
    held_docs = [d for d in docs if d.heldout]
    if a.max_corpus_mb:
        cap, kept, n = a.max_corpus_mb * 1e6, [], 0
        for d in train_docs:
            if n >= cap:
                break
            kept.append(d)
            n += len(d.text.encode())
        train_docs = kept
        corpus["train_cap_mb"] = a.max_corpus_mb
    corpus["train_files_used"] = len(train_docs)
    corpus["train_bytes_used"] = sum(len(d.text.encode()) for d in train_docs)
    log(f"corpus: {corpus['files']} files, {corpus['bytes'] / 1e6:.1f} MB, sha256 "
        f"{corpus['sha256'][:16]}; train {len(train_docs)} files "
        f"{corpus['train_bytes_used'] / 1e6:.1f} MB, held-out {len(held_docs)} files "
        f"({time.monotonic() - t0:.1f} s)")

    # ---- 2. tokenizer -------------------------------------------------------------------------
    t0 = time.monotonic()
    tok_texts, n = [], 0
    for d in train_docs:
        if n >= a.tok_train_mb * 1e6:
            break
        tok_texts.append(d.text)
        n += len(d.text.encode())
    tok = train_tokenizer(tok_texts, a.vocab_size - PAD_ROWS)
    ids = token_ids(tok)
    eot = ids["<|endoftext|>"]
    n_tok = tok.get_vocab_size()
    assert n_tok <= a.vocab_size, (n_tok, a.vocab_size)
    cfg_dict = nm.nano_config(a.vocab_size, ids)
    max_len = cfg_dict["text_config"]["max_position_embeddings"]
    tok_sha = write_tokenizer(tok, out, max_len)
    t_tok = time.monotonic() - t0

    t0 = time.monotonic()

    def stream(ds):
        # special tokens written literally in a file (e.g. "<|im_start|>" in a tokenizer test)
        # are text, not control tokens: encode them as text, like split_special_tokens=True
        tok.encode_special_tokens = True
        try:
            enc = tok.encode_batch([d.text for d in ds], add_special_tokens=False)
        finally:
            tok.encode_special_tokens = False
        flat = []
        for e in enc:
            flat.extend(e.ids)
            flat.append(eot)
        return torch.tensor(flat, dtype=torch.long)

    train_stream, held_stream = stream(train_docs), stream(held_docs)
    t_enc = time.monotonic() - t0
    bpt_train = corpus["train_bytes_used"] / (len(train_stream) - len(train_docs))
    held_bytes = sum(len(d.text.encode()) for d in held_docs)
    bpt_held = held_bytes / max(1, len(held_stream) - len(held_docs))
    log(f"tokenizer: {n_tok} tokens ({n_tok - len(ids)} BPE + {len(ids)} added, embedding rows "
        f"{a.vocab_size}) trained on {n / 1e6:.1f} MB in {t_tok:.1f} s; encoded train "
        f"{len(train_stream):,} tokens ({bpt_train:.2f} B/token), held-out {len(held_stream):,} "
        f"({bpt_held:.2f} B/token) in {t_enc:.1f} s")

    # ---- 3. model -----------------------------------------------------------------------------
    model = nm.build_model(cfg_dict, a.seed, dev)
    n_params = nm.count_params(model)
    log(f"model: {n_params:,} parameters ({2 * n_params / 1e6:.2f} MB in bf16), "
        f"{cfg_dict['text_config']['num_hidden_layers']} layers + MTP")
    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if dev.type == "cuda" else {}))
    loss_fn = nm.losses
    if a.compile:
        loss_fn = torch.compile(nm.losses)

    # ---- 4. training --------------------------------------------------------------------------
    gen = torch.Generator().manual_seed(a.seed)
    train_dev = train_stream.to(dev)
    L, B = a.seq_len, a.batch_size
    offs = torch.arange(L + 1, device=dev)
    auto = a.steps == "auto"
    total = 10**9 if auto else int(a.steps)
    calib = (max(1, min(10, a.warmup // 4)), max(2, min(40, a.warmup)))  # timed window inside the warm-up
    curve, t_calib = [], None
    model.train()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    sync()
    t_train = time.monotonic()
    step, truncated = 0, False
    def ctx():
        return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

    while step < total:
        lr = lr_at(step, total, a)
        for gr in opt.param_groups:
            gr["lr"] = lr
        starts = torch.randint(0, len(train_stream) - L - 1, (B,), generator=gen).to(dev)
        window = train_dev[starts[:, None] + offs]
        with ctx():
            ls = loss_fn(model, window, a.mtp_weight, a.aux_weight)
        opt.zero_grad(set_to_none=True)
        ls["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        step += 1
        rec = {k: v.detach() for k, v in ls.items()}
        rec["gnorm"] = gnorm.detach()
        curve.append((step, lr, rec))
        if auto and step == calib[0]:
            sync()
            t_calib = time.monotonic()
        if auto and step == calib[1]:
            sync()
            dt = (time.monotonic() - t_calib) / (calib[1] - calib[0])
            total = max(a.warmup + 1, int((a.time_budget - (time.monotonic() - t_train)) / dt) + step)
            log(f"auto steps: {dt * 1000:.1f} ms/step ({B * L / dt:,.0f} tokens/s) → {total} steps "
                f"for a {a.time_budget:.0f} s budget")
        if step % a.log_every == 0 or step == total:
            el = time.monotonic() - t_train
            log(f"step {step}/{total if total < 10**9 else '?'} loss {rec['loss'].item():.4f} "
                f"ce {rec['ce'].item():.4f} mtp {rec['mtp_ce'].item():.4f} "
                f"aux {rec['aux'].item():.3f} gnorm {gnorm.item():.2f} lr {lr:.2e} "
                f"| {step * B * L / el:,.0f} tok/s, {el:.0f} s")
        if time.monotonic() - t_train > 1.2 * a.time_budget and step < total:
            truncated = True
            log(f"time budget exceeded: stopping at step {step} of {total}")
            break
    sync()
    train_time = time.monotonic() - t_train
    tokens_seen = step * B * L
    log(f"trained {step} steps, {tokens_seen:,} tokens in {train_time:.1f} s "
        f"({tokens_seen / train_time:,.0f} tok/s, {tokens_seen / len(train_stream):.2f} epochs)")
    rows = []
    for s, lr, rec in curve:
        rows.append({"step": s, "lr": lr, **{k: float(v) for k, v in rec.items()}})
    last = rows[-min(50, len(rows)):]
    final_train = {k: sum(r[k] for r in last) / len(last) for k in ("loss", "ce", "mtp_ce", "aux")}

    # ---- 5. evaluation (weights rounded to bf16 = the shipped checkpoint; fp32 maths) ----------
    t0 = time.monotonic()
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    held = ev.heldout_loss(model, held_stream, L, a.eval_tokens, max(1, 2 * B), bf16=False)
    held_bf16 = (ev.heldout_loss(model, held_stream, L, a.eval_tokens, max(1, 2 * B), bf16=True)
                 if bf16 else None)
    P, G = a.accept_prompt_len, a.accept_gen
    span = len(held_stream) - P
    starts = [int(i * span / a.accept_prompts) for i in range(a.accept_prompts)]
    prompts = torch.stack([held_stream[s:s + P] for s in starts]).to(dev)
    acc = ev.mtp_acceptance(model, prompts, G, 3)
    fib_ids = tok.encode(FIB, add_special_tokens=False).ids
    fib_seq = ev.greedy(model, torch.tensor([fib_ids], device=dev), a.fixture_tokens)[0, len(fib_ids):].tolist()
    fib_text = tok.decode(fib_seq, skip_special_tokens=False)
    t_eval = time.monotonic() - t0
    log(f"held-out: ppl {held['ppl']:.3f} (ce {held['ce']:.4f}) over {held['tokens']:,} tokens; "
        f"MTP t+2 ppl {held['mtp_ppl']:.3f}" +
        (f"; bf16-autocast ppl {held_bf16['ppl']:.3f}" if held_bf16 else ""))
    log(f"MTP acceptance (greedy): d1 {acc['acceptance_rate_1']:.3f}; tokens/step with k=1,2,3 "
        f"drafts: " + ", ".join(f"{acc['spec_decode'][k]['tokens_per_step']:.2f}" for k in (1, 2, 3)))
    log(f"greedy '{FIB}' → {fib_text!r} (eval {t_eval:.1f} s)")

    # ---- 6. export ----------------------------------------------------------------------------
    from safetensors.torch import save_file

    sd = nm.export_state_dict(model)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(nm.generation_config(ids), indent=2) + "\n")
    os.chmod(out / "model.safetensors", 0o644)
    every = max(1, len(rows) // 500)  # ≤ ~500 rows keep the directory under 8 MB
    with open(out / "loss_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows[::every] + (rows[-1:] if (len(rows) - 1) % every else []):
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})

    # ---- 7. export check (CPU, fp32) -----------------------------------------------------------
    check = {"skipped": True}
    fixture = None
    if not a.no_check:
        t0 = time.monotonic()
        check = {}
        cpu_model = model.to("cpu").float()
        text = held_docs[0].text if held_docs else FIB
        chk_ids = tok.encode(text, add_special_tokens=False).ids[:200]
        with torch.no_grad():
            h, _ = nm.forward_hidden(cpu_model, torch.tensor([chk_ids]), sdpa=False)
            ref_logits = nm.logits(cpu_model, h)[0]
        eng = ev.engine_logits(out, chk_ids)
        check["tokens"] = len(chk_ids)
        check["engine_vs_training_rel_err"] = ev.rel_err(eng, ref_logits)
        hf = ev.transformers_logits(out, chk_ids)
        check["transformers_vs_engine_rel_err"] = None if hf is None else ev.rel_err(eng, hf)
        fx_prompts = fixture_prompts(held_docs, a.fixture_prompts)
        res = ev.engine_greedy(out, [FIB] + fx_prompts, a.fixture_tokens)
        g = res[0]
        check["engine_greedy_fibonacci"] = g
        n_cmp = min(len(g["ids"]), len(fib_seq))
        check["engine_greedy_matches_training_forward"] = g["ids"][:n_cmp] == fib_seq[:n_cmp]
        ok = (check["engine_vs_training_rel_err"] <= 1e-4 and
              (hf is None or check["transformers_vs_engine_rel_err"] <= 1e-4))
        check["pass"] = bool(ok)
        # code-completion fixture for the accuracy gate: greedy ids through the serving stack
        fixture = {"description": "greedy completions (temperature 0, max_tokens below) of "
                                  "held-out stdlib code prompts by tailored's engine on the CPU "
                                  "in fp32 from this checkpoint",
                   "max_tokens": a.fixture_tokens, "items": []}
        for r in res:
            fixture["items"].append({"prompt": r["prompt"], "prompt_ids": r["prompt_ids"],
                                     "completion_ids": r["ids"], "completion": r["text"],
                                     "finish_reason": r["finish_reason"]})
        (out / "nano_eval.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        check["seconds"] = time.monotonic() - t0
        log(f"export check: engine vs training forward rel err "
            f"{check['engine_vs_training_rel_err']:.2e}, transformers vs engine "
            f"{_fmt(check['transformers_vs_engine_rel_err'])}"
            f"; engine greedy {g['text']!r} ({'PASS' if ok else 'FAIL'})")

    # ---- 8. manifest --------------------------------------------------------------------------
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(out.iterdir()) if f.is_file() and f.name != "training_manifest.json"}
    ckpt_bytes = sum(v["bytes"] for v in files.values())  # without the manifest itself
    by_part: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = ("mtp" if name.startswith("mtp.") else "embed_tokens" if "embed_tokens" in name
                else "lm_head" if name.startswith("lm_head") else
                "routed_experts" if ".experts." in name else
                "linear_attn" if "linear_attn" in name else "self_attn" if "self_attn" in name
                else "other_mlp" if ".mlp." in name else "norms")
        by_part[part] = by_part.get(part, 0) + p.numel()
    step_curve = max(1, len(rows) // 100)
    manifest = {
        "kind": kind,
        "note": ("CPU smoke run: a placeholder to exercise the pipeline; replace with the GPU run"
                 if kind != "gpu" else "GPU training run"),
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "lab/train_nano.py"] + (argv or sys.argv[1:])),
        "args": vars(a),
        "seed": a.seed,
        "versions": versions(dev),
        "corpus": corpus,
        "tokenizer": {"tokens": n_tok, "bpe_tokens": n_tok - len(ids), "added_tokens": ids,
                      "embedding_rows": a.vocab_size, "trained_on_bytes": n,
                      "tokenizer_json_sha256": tok_sha, "bytes_per_token_train": bpt_train,
                      "bytes_per_token_heldout": bpt_held},
        "data": {"train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
                 "document_separator": "<|endoftext|>"},
        "model": {"parameters": n_params, "parameters_by_part": by_part,
                  "dims": {k: cfg_dict["text_config"][k] for k in nm.NANO_DIMS},
                  "vocab_size": a.vocab_size},
        "training": {"steps": step, "steps_arg": a.steps, "truncated_by_time": truncated,
                     "batch_size": B, "seq_len": L, "tokens_seen": tokens_seen,
                     "epochs": tokens_seen / len(train_stream), "time_s": train_time,
                     "tokens_per_s": tokens_seen / train_time, "amp": "bf16" if bf16 else "fp32",
                     "optimizer": {"name": "AdamW", "lr": a.lr, "betas": [0.9, 0.95],
                                   "weight_decay": a.weight_decay, "warmup": a.warmup,
                                   "schedule": f"linear warm-up, cosine to {a.min_lr_ratio}×lr",
                                   "grad_clip": a.grad_clip},
                     "loss": {"mtp_weight": a.mtp_weight, "aux_weight": a.aux_weight},
                     "final_train_mean_last_50": final_train},
        "loss_curve": {"every": step_curve, "columns": ["step", "loss", "ce", "mtp_ce", "aux"],
                       "points": [[r["step"], round(r["loss"], 4), round(r["ce"], 4),
                                   round(r["mtp_ce"], 4), round(r["aux"], 4)]
                                  for r in rows[::step_curve]] +
                                 ([[rows[-1]["step"], round(rows[-1]["loss"], 4),
                                    round(rows[-1]["ce"], 4), round(rows[-1]["mtp_ce"], 4),
                                    round(rows[-1]["aux"], 4)]]
                                  if (len(rows) - 1) % step_curve else [])},
        "eval": {"weights": "bf16-rounded (as shipped), fp32 maths unless noted",
                 "heldout": held, "heldout_bf16_autocast": held_bf16,
                 "heldout_window": L, "mtp_acceptance": acc,
                 "greedy_fibonacci": {"prompt": FIB, "ids": fib_seq, "text": fib_text},
                 "seconds": t_eval},
        "export_check": check,
        "files": files,
        "checkpoint_bytes": ckpt_bytes,
        "total_seconds": time.monotonic() - t_start,
    }
    (out / "training_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    # ---- summary ------------------------------------------------------------------------------
    st = (out / "model.safetensors").stat().st_size
    lines = [
        ("run", f"{kind}, seed {a.seed}, {manifest['versions'].get('gpu') or 'cpu'}"),
        ("corpus", f"{corpus['files']} files {corpus['bytes'] / 1e6:.1f} MB sha {corpus['sha256'][:12]}"),
        ("tokens", f"train {len(train_stream):,} / held-out {len(held_stream):,}"),
        ("params", f"{n_params:,} ({st / 1e6:.2f} MB safetensors, dir {ckpt_bytes / 1e6:.2f} MB)"),
        ("training", f"{step} steps × {B}×{L} in {train_time:.0f} s, {tokens_seen / train_time:,.0f} tok/s"
                     f", {tokens_seen / len(train_stream):.2f} epochs" + (" (TRUNCATED)" if truncated else "")),
        ("train ce (last 50)", f"{final_train['ce']:.4f} (mtp {final_train['mtp_ce']:.4f})"),
        ("held-out ppl", f"{held['ppl']:.3f} fp32" + (f", {held_bf16['ppl']:.3f} bf16" if held_bf16 else "")
                         + f"; MTP t+2 ppl {held['mtp_ppl']:.3f}"),
        ("MTP accept d1", (f"{acc['acceptance_rate_1']:.3f} (cond. d2 {acc['conditional'][1]:.3f},"
                           f" d3 {acc['conditional'][2]:.3f})")),
        ("tokens/step k=1,2,3", ", ".join(f"{acc['spec_decode'][k]['tokens_per_step']:.3f}" for k in (1, 2, 3))),
        ("export check", "skipped" if check.get("skipped") else
         f"{'PASS' if check['pass'] else 'FAIL'} rel err engine {check['engine_vs_training_rel_err']:.1e}"
         f", transformers {_fmt(check['transformers_vs_engine_rel_err'])}"),
        ("fibonacci", repr(fib_text[:70])),
        ("time", f"total {time.monotonic() - t_start:.0f} s (train {train_time:.0f}, eval {t_eval:.0f})"),
    ]
    w = max(len(k) for k, _ in lines)
    print("\n" + "=" * 78)
    for k, v in lines:
        print(f"{k:<{w}} | {v}")
    print("=" * 78, flush=True)
    dir_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if dir_bytes > MAX_BYTES:
        log(f"ERROR: {out} holds {dir_bytes} bytes > {MAX_BYTES}")
        return 1
    if not check.get("skipped") and not check["pass"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
