"""Is the full-size random model chaotic in bf16? (kb/0008, issue 4, H200.)

Two *reference* implementations that differ only in attention rounding — transformers with SDPA
and with eager attention, holding the same bf16 weights — teacher-forced on the same prompts.
If even they disagree on the top-1 token, a bf16 engine-vs-reference gate on these weights
measures chaos, not the engine. Done for each dummy init ('default', 'stable').

    python3 scripts/gate_chaos_probe.py /tmp/full [--inits default,stable] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from tailored.config import ModelConfig
from tailored.gate import metrics as M
from tailored.gate.prompts import DEFAULT_PROMPTS, load_prompts
from tailored.gate.reference import reference_forward, reference_from_state_dict, shared_state_dict
from tailored.synth import build_empty_model, init_dummy_weights
from tailored.tokenizer import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--inits", default="default,stable")
    ap.add_argument("--only", default="code,chinese,multi_turn")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    cfg = ModelConfig.from_dir(a.ckpt)
    tok = load_tokenizer(a.ckpt)
    prompts = load_prompts(DEFAULT_PROMPTS, a.only.split(","))
    out = {}
    for init in a.inits.split(","):
        m = build_empty_model(cfg, a.device, torch.bfloat16, with_mtp=False)
        init_dummy_weights(m, 0, init=init)
        sd = shared_state_dict(m)
        ref_a = reference_from_state_dict(cfg, sd, a.device, "sdpa")
        ref_b = reference_from_state_dict(cfg, sd, a.device, "eager")
        rows = []
        for p in prompts:
            ids = p.encode(tok)
            ha, hb = reference_forward(ref_a, ids), reference_forward(ref_b, ids)
            la, lb = ref_a.lm_head(ha).float(), ref_b.lm_head(hb).float()
            c = M.compare_logits(la, lb)
            gap = (c["ref_max"] - c["ref_second"]).median().item()
            rows.append({"name": p.name, "T": len(ids), "top1": c["agree"].float().mean().item(),
                         "kl_mean": c["kl"].mean().item(), "max_err": c["max_err"].max().item(),
                         "logit_max": la.abs().max().item(), "median_top2_gap": gap,
                         "hidden_rel_err": ((ha.float() - hb.float()).norm() / ha.float().norm()).item()})
            r = rows[-1]
            print(f"{init:8s} {p.name:12s} T={r['T']:4d} top1 {r['top1']:.4f} KL {r['kl_mean']:.2e} "
                  f"max err {r['max_err']:.2f} |logit| {r['logit_max']:.1f} top-2 gap "
                  f"{gap:.2f} hidden rel err {r['hidden_rel_err']:.3f}", flush=True)
        out[init] = rows
        del m, sd, ref_a, ref_b
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
