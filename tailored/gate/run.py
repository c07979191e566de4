"""`tailored gate`: the engine against transformers with the same weights, on the frozen prompts.

    tailored gate --preset tiny --report gate.json                 # CPU, fp32 (CI)
    tailored gate /ckpt --device cuda --dtype bfloat16 --report gate-bf16.json

Steps: (1) all prompts go through the real Engine at once (or one after another with
--one-at-a-time: one-row decode steps, the single-stream path), greedy, N new tokens each,
keeping the hidden states it computed (engine_side.py); (2) the reference (reference.py) runs
one teacher-forced pass over each prompt + the engine's continuation; (3) logits at the scored
positions are compared and the greedy continuations checked (metrics.py) against the
thresholds file's section for the engine dtype.
Exit code: 0 pass, 1 a threshold breached, 2 bad input (raised as ValueError/RuntimeError and
turned into 2 by tailored.cli.main).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from tailored import flags
from tailored.gate import metrics as M
from tailored.gate.engine_side import engine_greedy, engine_teacher_forced, gate_engine_kwargs
from tailored.gate.manifest import manifest
from tailored.gate.prompts import DEFAULT_PROMPTS, REPO, ids_sha256, load_prompts, sha256_file
from tailored.gate.sources import PRESETS, bf16_source, check_bf16_source, preset_checkpoint
from tailored.gate.reference import (
    bf16_reference,
    load_reference,
    reference_forward,
    reference_from_state_dict,
    reference_logits,
)

log = logging.getLogger("tailored.gate")

DEFAULT_THRESHOLDS = REPO / "eval" / "thresholds.json"
SCORE_ROWS = 32  # logits rows per scoring chunk: 32 × 248320 × 4 B = 32 MB per tensor (cache-friendlier)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gate", help="accuracy gate: engine vs transformers on the frozen prompt set",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", nargs="?", default=None, help="Hugging Face checkpoint dir")
    p.add_argument("--preset", choices=[*PRESETS, "nano"], default=None,
                   help="tiny: synthetic tiny checkpoint, seed 0 (CI; fp32 by default); tiny-fp8: "
                        "the same in block FP8, tiny-nvfp4 / tiny-nvfp4-ct in NVFP4 (ModelOpt's / "
                        "compressed-tensors' layout), each checked against its dequantized "
                        "weights and against tiny; nano: the packaged trained nano model")
    p.add_argument("--bf16-reference", default=None,
                   help="FP8 / NVFP4 checkpoints: the bf16 checkpoint it was quantized from (the "
                        "second reference; --load-format dummy draws it from --seed)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="engine and reference dtype (default float32 for --preset tiny and on "
                        "cpu, bfloat16 on cuda); picks the thresholds section")
    p.add_argument("--thresholds", default=str(DEFAULT_THRESHOLDS), help="thresholds JSON")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompt set (JSONL)")
    p.add_argument("--only", default=None, help="comma-separated prompt names to run")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--max-scored-positions", type=int, default=256,
                   help="teacher-forced positions compared per prompt (0 = all; long prompts "
                        "are sampled evenly, continuation positions always kept)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine step budget = teacher-forced prefill chunk")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="send the prompts to the engine one after another instead of all at "
                        "once: every decode step then has one row, the c=1 path (the 1-row "
                        "GEMVs, kb/0042), where all at once decodes up to 7 rows a step")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="engine with prefill CUDA graphs (kb/0013): a prompt's first chunk, "
                        "alone in its step, replays a graph")
    p.add_argument("--reference-weights", choices=["auto", "checkpoint", "shared"],
                   default="auto", help="checkpoint: a second load (CPU default); shared: adopt "
                   "the engine's tensors, no second copy (cuda default)")
    p.add_argument("--reference-attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--hidden-from", choices=["engine", "forward"], default="engine",
                   help="engine: the hidden states the engine computed while serving (hook); "
                        "forward: a separate chunked model forward over the runner's cache")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="torch CPU threads during the gate (0 = leave as is); 1 is much faster "
                        "for the tiny model on a busy machine")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights drawn on the device (implies shared reference)")
    p.add_argument("--num-layers", type=int, default=None, help="first N decoder layers only")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--dummy-init", choices=["default", "stable"], default="stable",
                   help="statistics of --load-format dummy weights: stable (default here): "
                        "residual output projections scaled by 1/sqrt(2L), the full-size gate "
                        "fixture; default: serve's statistics, chaotic over 40 layers in bf16 "
                        "(kb/0008)")
    p.add_argument("--log-level", default="info")
    return p


def _section(path: Path, dtype: str) -> tuple[str, dict]:
    data = json.loads(Path(path).read_text())
    if dtype not in data:
        raise ValueError(f"{path} has no thresholds section {dtype!r}")
    return dtype, data[dtype]


def section_name(path: Path, precision: str, dtype: str) -> str:
    """The thresholds section of an engine computing in `dtype` on `precision` weights: the
    dtype's for bf16 weights; the precision's for quantized weights in bf16; in fp32
    "<precision>-float32" where the file has one (its vs_bf16_reference bound), else float32."""
    if precision == "bf16":
        return dtype
    if dtype != "float32":
        return precision
    own = f"{precision}-float32"
    return own if own in json.loads(Path(path).read_text()) else dtype


def score_prompt(hf, model, h_ref: torch.Tensor, h_eng: torch.Tensor, positions: list[int],
                 num_prompt: int, eng_tokens: list[int], tie_logit_gap: float) -> dict:
    """Metrics over `positions` (which include every continuation position), pooled, and the
    greedy comparison; also the reference's top-5 there (tensors under '_' keys)."""
    agree, ties, kl_sum, kl_max, err, top_ids, top_lp = 0, 0, 0.0, 0.0, 0.0, [], []
    cont = {}  # continuation step k -> (ref argmax, ref max, ref logit of e_k, ref 2nd logit)
    for s in range(0, len(positions), SCORE_ROWS):
        rows = torch.tensor(positions[s:s + SCORE_ROWS], device=h_eng.device)
        ref = reference_logits(hf, h_ref[rows])
        c = M.compare_logits(ref, model.compute_logits(h_eng[rows]))
        agree += int(c["agree"].sum())
        ties += int((~c["agree"] & (c["ref_max"] - c["ref_at_eng_argmax"] <= tie_logit_gap)).sum())
        kl_sum += float(c["kl"].double().sum())
        kl_max = max(kl_max, float(c["kl"].max()))
        err = max(err, float(c["max_err"].max()))
        top_ids.append(c["top_ids"].cpu())
        top_lp.append(c["top_logprobs"].cpu())
        for i, p in enumerate(rows.tolist()):
            k = p - (num_prompt - 1)
            if k >= 0:
                cont[k] = (int(c["ref_argmax"][i]), float(c["ref_max"][i]),
                           float(ref[i, eng_tokens[k]]), float(c["ref_second"][i]))
    n = len(positions)
    steps = [cont[k] for k in range(len(eng_tokens))]
    g = M.compare_greedy([c[0] for c in steps], eng_tokens, [c[1] for c in steps],
                         [c[2] for c in steps], [c[3] for c in steps], tie_logit_gap)
    return {"positions": n, "agree": agree, "top1": agree / n, "top1_ties": ties,
            "top1_decisive": agree / max(n - ties, 1), "kl_sum": kl_sum,
            "kl_mean": kl_sum / n, "kl_max": kl_max, "max_logit_err": err, "greedy": g,
            "_top_ids": torch.cat(top_ids), "_top_logprobs": torch.cat(top_lp)}


def engine_pass(stack, prompts, max_new_tokens: int, chunk: int, hidden_from: str = "engine",
                one_at_a_time: bool = False):
    """The engine's side, once for every reference: prompt ids, greedy continuations and the
    hidden states [T+N-1, H] behind them, per prompt name; and timings (s). one_at_a_time:
    each prompt runs alone (its decode steps have one row) instead of all of them together."""
    engine, tok = stack.engine, stack.tokenizer
    ids = {p.name: p.encode(tok) for p in prompts}
    t = time.monotonic()
    capture = hidden_from == "engine"
    if one_at_a_time:
        eng_tokens, eng_hidden = {}, {}
        for name, one in ids.items():
            toks, hid = engine_greedy(engine, {name: one}, max_new_tokens, capture=capture)
            eng_tokens.update(toks)
            eng_hidden.update(hid)
    else:
        eng_tokens, eng_hidden = engine_greedy(engine, ids, max_new_tokens, capture=capture)
    timings = {"engine_greedy_s": time.monotonic() - t}
    if hidden_from != "engine":
        t = time.monotonic()
        for p in prompts:
            eng_hidden[p.name] = engine_teacher_forced(
                engine, ids[p.name] + eng_tokens[p.name][:-1], chunk)
        timings["engine_teacher_forced_s"] = time.monotonic() - t
    return ids, eng_tokens, eng_hidden, timings


def reference_hidden(hf, prompts, ids, eng_tokens) -> dict[str, torch.Tensor]:
    """One teacher-forced pass of `hf` per prompt over prompt + the engine's continuation (the
    last token is never fed back): final-normed hidden states [T+N-1, H] per prompt name."""
    return {p.name: reference_forward(hf, ids[p.name] + eng_tokens[p.name][:-1]) for p in prompts}


def score_all(hf, stack, prompts, ids, eng_tokens, eng_hidden, ref_hidden, th: dict, *,
              max_new_tokens: int, max_scored: int, label: str = "") -> list[dict]:
    """Per prompt: the metrics of `eng_hidden` against `ref_hidden` (score_prompt; logits by
    the reference's and by the engine model's lm_head)."""
    model, tok = stack.engine.runner.model, stack.tokenizer
    records = []
    for p in prompts:
        t0 = time.monotonic()
        T = len(ids[p.name])
        pos = M.scored_positions(T, max_new_tokens, max_scored)
        rec = {"name": p.name, "prompt_tokens": T,
               **score_prompt(hf, model, ref_hidden[p.name], eng_hidden[p.name], pos, T,
                              eng_tokens[p.name], th["tie_logit_gap"])}
        g = rec["greedy"]
        g["verdict"] = M.greedy_verdict(g, max_new_tokens, th["min_match_tokens"])
        rec["engine_text"] = tok.decode(eng_tokens[p.name])[:300]
        rec["timings"] = {"score_s": time.monotonic() - t0}
        records.append(rec)
        log.info("%s%-14s T=%5d top1 %.4f kl %.2e err %.2e greedy %s (%d)", label, p.name, T,
                 rec["top1"], rec["kl_mean"], rec["max_logit_err"], g["verdict"], g["match_len"])
    return records


def noise_floor(hf, stack, prompts, ids, eng_tokens, ref_hidden, th: dict, attn: str,
                **kw) -> dict:
    """What two correct bf16 implementations of the reference disagree on: transformers with
    the same weights and the other attention kernel (sdpa ↔ eager), teacher-forced on the same
    tokens as the gate and scored exactly like the engine (score_all, with the second
    implementation's hidden states in the engine's place), pooled over prompts. The bf16/FP8
    sections judge the engine against this floor."""
    other = "eager" if attn == "sdpa" else "sdpa"
    hf2 = reference_from_state_dict(stack.model_config, hf.state_dict(), hf.lm_head.weight.device,
                                    other)
    hidden2 = reference_hidden(hf2, prompts, ids, eng_tokens)
    del hf2
    o = M.overall(score_all(hf, stack, prompts, ids, eng_tokens, hidden2, ref_hidden, th,
                            label="[floor] ", **kw))
    return {"implementation": f"transformers attn {attn} vs {other}", "positions": o["positions"],
            "top1": o["top1"], "kl_mean": o["kl_mean"], "max_logit_err": o["max_logit_err"]}


def relative_breaches(o: dict, floor: dict, th: dict) -> list[str]:
    """Bounds relative to the noise floor (null = not enforced): kl_mean ≤ max_kl_vs_floor ×
    floor KL; top1 ≥ floor top1 − max_top1_below_floor."""
    out = []
    r = th.get("max_kl_vs_floor")
    if r is not None and not o["kl_mean"] <= r * floor["kl_mean"]:
        out.append(f"kl_mean = {o['kl_mean']:.3g} > {r:g} x noise floor {floor['kl_mean']:.3g}")
    d = th.get("max_top1_below_floor")
    if d is not None and not o["top1"] >= floor["top1"] - d:
        out.append(f"top1 = {o['top1']:.4f} < noise floor {floor['top1']:.4f} - {d:g}")
    return out


def run_gate(stack, prompts, th: dict, *, max_new_tokens: int, max_scored: int,
             reference_mode: str, attn: str, chunk: int, hidden_from: str = "engine",
             ) -> tuple[list[dict], dict]:
    """Core of the gate on a built stack (one reference). Returns per-prompt records and
    timings (s)."""
    ids, eng_tokens, eng_hidden, timings = engine_pass(stack, prompts, max_new_tokens, chunk,
                                                       hidden_from)
    t = time.monotonic()
    hf = load_reference(stack.model_config, stack.engine.runner.model, reference_mode,
                        stack.checkpoint_dir, attn)
    timings["reference_load_s"] = time.monotonic() - t
    t = time.monotonic()
    ref_hidden = reference_hidden(hf, prompts, ids, eng_tokens)
    timings["reference_forward_s"] = time.monotonic() - t
    records = score_all(hf, stack, prompts, ids, eng_tokens, eng_hidden, ref_hidden, th,
                        max_new_tokens=max_new_tokens, max_scored=max_scored)
    return records, timings


def public(rec: dict) -> dict:
    """A record without its tensors (keys starting with '_')."""
    return {k: v for k, v in rec.items() if not k.startswith("_")}


def resolve(args):
    """(checkpoint dir, device, dtype name, reference mode) from the options."""
    from tailored.stack import pick_device

    if (args.preset is None) == (args.checkpoint_dir is None):
        raise ValueError("give a checkpoint directory or --preset (not both)")
    ckpt = preset_checkpoint(args.preset) if args.preset else Path(args.checkpoint_dir)
    dev = pick_device(args.device)
    dtype = args.dtype or ("float32" if args.preset or dev.type == "cpu" else "bfloat16")
    mode = args.reference_weights
    if mode == "auto":
        mode = "shared" if dev.type == "cuda" or args.load_format == "dummy" else "checkpoint"
    if mode == "checkpoint" and args.load_format == "dummy":
        raise ValueError("--load-format dummy has no checkpoint weights: use --reference-weights shared")
    return ckpt, dev, dtype, mode


def run(args) -> int:
    """`tailored gate`; returns the exit code (0 pass, 1 breach)."""
    threads = torch.get_num_threads()
    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> int:
    from tailored.stack import build_stack
    from tailored.tokenizer import load_tokenizer

    t_start = time.monotonic()
    # checked before anything slow (the engine would say "max_tokens" after the load)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    only = [s for s in args.only.split(",") if s] if args.only is not None else None
    if only == []:
        raise ValueError(f"--only {args.only!r} names no prompt (leave it out to run them all)")
    if only and len(set(only)) != len(only):  # a prompt runs once: a repeat is likely a typo
        twice = sorted({n for n in only if only.count(n) > 1})
        raise ValueError(f"--only {args.only!r} names {', '.join(twice)} more than once")
    ckpt, dev, dtype, mode = resolve(args)
    # the report's kernel switches, read now: a bad TAILORED_* value must not cost the run
    # (it was read only when the report was written, after the engine and reference passes)
    switches = flags.current().snapshot()  # every TAILORED_* switch (tailored/flags.py)
    # checked before anything slow: a wrong --bf16-reference must not cost the engine pass
    bf16_src = check_bf16_source(bf16_source(args, ckpt), ckpt, args)
    prompts = load_prompts(args.prompts, only)
    tok = load_tokenizer(ckpt)
    all_ids = [p.encode(tok) for p in prompts]
    lens = [len(i) for i in all_ids]
    stack = build_stack(ckpt, load_format=args.load_format, num_layers=args.num_layers,
                        device=str(dev), dtype=dtype, seed=args.seed, progress=False,
                        dummy_init=args.dummy_init, prefill_graphs=args.prefill_graphs,
                        **gate_engine_kwargs(lens, args.max_new_tokens,
                                             max_num_batched_tokens=args.max_num_batched_tokens))
    cfg = stack.model_config
    quantized = cfg.quantized
    # the engine's compute dtype picks the section; a quantized checkpoint computed in bf16 has
    # its own ("fp8", "nvfp4"), and in fp32 "<precision>-float32" where the file has one
    section, th = _section(args.thresholds, section_name(args.thresholds, cfg.precision, dtype))
    t_built = time.monotonic()
    ids, eng_tokens, eng_hidden, timings = engine_pass(
        stack, prompts, args.max_new_tokens, args.max_num_batched_tokens, args.hidden_from,
        args.one_at_a_time)
    t = time.monotonic()
    consume = cfg.fp8 is not None and mode == "shared"
    if consume:  # the engine has run: its cache, graphs and FP8 weights make room (80 GB cards)
        stack.engine.runner.release()
        _free(dev)
    hf = load_reference(cfg, stack.engine.runner.model, mode, stack.checkpoint_dir,
                        args.reference_attn, consume=consume)
    if consume:
        _free(dev)
    timings["reference_load_s"] = time.monotonic() - t
    kw = {"max_new_tokens": args.max_new_tokens, "max_scored": args.max_scored_positions}
    t = time.monotonic()
    ref_hidden = reference_hidden(hf, prompts, ids, eng_tokens)  # one pass, used by all below
    timings["reference_forward_s"] = time.monotonic() - t
    floor = None
    if th.get("noise_floor"):  # bf16 / FP8: measure what two correct references disagree on
        t = time.monotonic()
        floor = noise_floor(hf, stack, prompts, ids, eng_tokens, ref_hidden, th,
                            args.reference_attn, **kw)
        timings["noise_floor_s"] = time.monotonic() - t
        if th.get("tie_gap_from_floor"):  # a gap two correct bf16 runs can flip is a tie
            th = dict(th, tie_logit_gap=max(th["tie_logit_gap"], floor["max_logit_err"]))
        log.info("noise floor (%s): top1 %.4f KL %.2e max err %.3f", floor["implementation"],
                 floor["top1"], floor["kl_mean"], floor["max_logit_err"])
    records = score_all(hf, stack, prompts, ids, eng_tokens, eng_hidden, ref_hidden, th, **kw)
    del ref_hidden
    o = M.overall(records)
    found = M.breaches(o, th) + (relative_breaches(o, floor, th) if floor else [])
    vs_bf16 = None
    if quantized:  # the second reference: the bf16 weights before quantization
        del hf
        _free(dev)
        vs_bf16 = {"source": str(bf16_src) if bf16_src else None}
        if bf16_src is None:
            vs_bf16["note"] = ("not run: give --bf16-reference DIR (the bf16 checkpoint this "
                               f"{cfg.precision.upper()} one was quantized from), or use "
                               "--load-format dummy")
        else:
            t = time.monotonic()
            hf = bf16_reference(cfg, dev, stack.engine.runner.model.model.embed_tokens.weight.dtype,
                                bf16_src, args.reference_attn, args.seed, args.dummy_init)
            timings["bf16_reference_load_s"] = time.monotonic() - t
            rec_b = score_all(hf, stack, prompts, ids, eng_tokens, eng_hidden,
                              reference_hidden(hf, prompts, ids, eng_tokens), th,
                              label="[vs bf16] ", **kw)
            del hf
            _free(dev)
            vs_bf16["overall"] = M.overall(rec_b)
            vs_bf16["prompts"] = [public(r) for r in rec_b]
            bound = th.get("vs_bf16_reference") or {}
            vs_bf16["thresholds"] = bound
            b_found = [f"vs bf16 reference: {b}" for b in
                       M.breaches(vs_bf16["overall"], bound)
                       + (relative_breaches(vs_bf16["overall"], floor, bound) if floor else [])]
            vs_bf16["breaches"] = b_found
            found = found + b_found
    enforced = th.get("enforced", True)
    notes = []
    if args.max_new_tokens < th["min_match_tokens"]:
        notes.append(f"max_new_tokens {args.max_new_tokens} < min_match_tokens "
                     f"{th['min_match_tokens']}: greedy match checked over {args.max_new_tokens}")
    if quantized:
        p = cfg.precision.upper()
        notes.append(f"{p} engine: 'overall' is against the {p} weights dequantized into the "
                     "reference; 'vs_bf16_reference' against the bf16 weights they came from")
    passed = not (found and enforced)
    report = {
        "passed": passed,
        "manifest": manifest(
            device=dev, dtype=dtype, checkpoint=ckpt, load_format=args.load_format,
            seed=args.seed, prompts_path=Path(args.prompts),
            prompts_sha256=sha256_file(args.prompts),
            prompt_ids_sha256=ids_sha256(all_ids),
            extra={"options": {k: v for k, v in vars(args).items() if k != "func"},
                   "precision": cfg.precision, "reference_weights": mode,
                   "thresholds_file_sha256": sha256_file(args.thresholds),
                   "gdn_state_dtype": stack.engine_config.gdn_state_dtype_name,
                   "switches": switches}),
        "thresholds": {"file": str(args.thresholds), "section": section, **th},  # tie gap as used
        "overall": o,
        "noise_floor": floor,
        "breaches": found,
        "notes": notes,
        "prompts": [public(r) for r in records],
        "vs_bf16_reference": vs_bf16,
        "timings": {"build_s": t_built - t_start, **timings,
                    "total_s": time.monotonic() - t_start},
    }
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    _print_summary(report)
    return 0 if passed else 1


def _free(dev) -> None:
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _print_summary(r: dict) -> None:
    print(f"{'prompt':14s} {'T':>6s} {'top1':>7s} {'decisive':>8s} {'KL mean':>9s} {'max err':>9s}  greedy")
    for p in r["prompts"]:
        g = p["greedy"]
        print(f"{p['name']:14s} {p['prompt_tokens']:6d} {p['top1']:7.4f} {p['top1_decisive']:8.4f} "
              f"{p['kl_mean']:9.2e} {p['max_logit_err']:9.2e}  {g['verdict']} ({g['match_len']})")
    o = r["overall"]
    print(f"overall: top1 {o['top1']:.4f} (decisive {o['top1_decisive']:.4f}, {o['top1_ties']} ties)  KL mean {o['kl_mean']:.2e}  max err "
          f"{o['max_logit_err']:.2e}  greedy match {o['greedy_match']}/{o['prompts']} "
          f"(ties {o['greedy_tie']})  {r['timings']['total_s']:.1f} s")
    f = r.get("noise_floor")
    if f:
        print(f"noise floor ({f['implementation']}): top1 {f['top1']:.4f}  KL mean "
              f"{f['kl_mean']:.2e}  max err {f['max_logit_err']:.2e}  (tie gap used "
              f"{r['thresholds']['tie_logit_gap']:.3g})")
    vb = r.get("vs_bf16_reference")
    if vb and vb.get("overall"):
        b = vb["overall"]
        print(f"vs bf16 reference: top1 {b['top1']:.4f} (decisive {b['top1_decisive']:.4f})  KL mean {b['kl_mean']:.2e}  max err "
              f"{b['max_logit_err']:.2e}  greedy match {b['greedy_match']}/{b['prompts']} "
              f"(ties {b['greedy_tie']})")
    elif vb:
        print(f"vs bf16 reference: {vb.get('note')}")
    for b in r["breaches"]:
        print(f"BREACH: {b}")
    one = r["manifest"].get("options", {}).get("one_at_a_time")
    print("gate " + ("PASSED" if r["passed"] else "FAILED")
          + ("" if r["thresholds"].get("enforced", True) else " (section not enforced)")
          + (" (prompts one at a time)" if one else ""))
