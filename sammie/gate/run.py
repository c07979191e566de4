"""`sammie gate`: sammie's model against transformers' Sam3Model holding the same weights, on the
frozen cases (eval/sammie/cases.json), with committed thresholds (eval/sammie/thresholds.json).

    sammie gate                                   # tiny synthetic checkpoint, CPU, float32
    sammie gate CKPT --device cuda --dtype bfloat16 --out gate.json

Both sides see the same pixels and token ids (a tokenizer mismatch is itself a breach). The
200 queries are the same queries on both sides, so instances are compared query by query:
for every query the reference keeps (score > 0.3): box IoU and mask IoU (masks at the image's
size, thresholded at 0.5) against sammie's same query; over all queries the largest score
difference; and the queries kept on one side only, not counting those whose reference score
lies within `kept_margin` of the threshold. Any value past its threshold is a breach: the
report says which, and the exit status is 1. The report (JSON) carries the manifest
(tailored/gate/manifest.py: commit, versions, device, checkpoint hashes, case-set hash).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from sammie.gate.cases import CASES_DIR, load_cases

THRESHOLDS = CASES_DIR / "thresholds.json"
SCORE_THRESHOLD = 0.3
MASK_THRESHOLD = 0.5


def add_parser(sub):
    p = sub.add_parser("gate", help="numerics against transformers' Sam3Model, same weights")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="checkpoint directory (default: a tiny synthetic one, written to a "
                        "temporary directory)")
    p.add_argument("--preset", choices=["tiny", "full"], default="tiny",
                   help="the synthetic checkpoint's size when none is given (default: tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="sammie's dtype; the reference runs float32 (default: float32 on cpu, "
                        "bfloat16 on cuda)")
    p.add_argument("--cases", default=str(CASES_DIR), help="case directory (default: "
                                                           "eval/sammie)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.set_defaults(run=run)
    return p


def box_iou(a: list[float], b: list[float]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 1.0


def mask_iou(a: torch.Tensor, b: torch.Tensor) -> float:
    union = (a | b).sum().item()
    return (a & b).sum().item() / union if union else 1.0


def compare(ours: dict, ref: dict, width: int, height: int, margin: float) -> dict:
    """Metrics of one prompt (module docstring). ours / ref: scores [Q], boxes [Q, 4] (xyxy in
    [0, 1]), masks: a callable giving bool masks [k, H, W] of query indices."""
    kept_ref = set((ref["scores"] > SCORE_THRESHOLD).nonzero().flatten().tolist())
    kept_ours = set((ours["scores"] > SCORE_THRESHOLD).nonzero().flatten().tolist())
    near = set(((ref["scores"] - SCORE_THRESHOLD).abs() <= margin).nonzero().flatten().tolist())
    scale = torch.tensor([width, height, width, height])
    q = sorted(kept_ref)
    bi, mi = [], []
    if q:
        rb, ob = (ref["boxes"][q] * scale).tolist(), (ours["boxes"][q] * scale).tolist()
        bi = [box_iou(a, b) for a, b in zip(rb, ob)]
        rm, om = ref["masks"](q), ours["masks"](q)
        mi = [mask_iou(a, b) for a, b in zip(rm, om)]
    return {"kept_reference": len(kept_ref), "kept_sammie": len(kept_ours),
            "kept_mismatch": len((kept_ref ^ kept_ours) - near),
            "min_box_iou": min(bi, default=1.0), "min_mask_iou": min(mi, default=1.0),
            "max_score_diff": (ours["scores"] - ref["scores"]).abs().max().item()}


def check(m: dict, limits: dict) -> list[str]:
    bad = []
    if m["min_mask_iou"] < limits["min_mask_iou"]:
        bad.append(f"mask IoU {m['min_mask_iou']:.4f} < {limits['min_mask_iou']}")
    if m["min_box_iou"] < limits["min_box_iou"]:
        bad.append(f"box IoU {m['min_box_iou']:.4f} < {limits['min_box_iou']}")
    if m["max_score_diff"] > limits["max_score_diff"]:
        bad.append(f"score diff {m['max_score_diff']:.2e} > {limits['max_score_diff']}")
    if m["kept_mismatch"] > limits["max_kept_mismatch"]:
        bad.append(f"{m['kept_mismatch']} queries kept on one side only")
    return bad


def gate(ckpt: Path, device: str, dtype: str, cases_dir: Path) -> dict:
    from tailored.gate.manifest import checkpoint_hashes, device_name, git_commit, versions

    from sammie.checkpoint import ImageSettings, load_model
    from sammie.config import SamConfig
    from sammie.engine.images import decode
    from sammie.gate.reference import Reference, masks_at
    from sammie.model.sam3 import Sam3
    from sammie.tokenizer import PromptTokenizer

    limits = json.loads(THRESHOLDS.read_text())[dtype]
    cfg = SamConfig.from_dir(ckpt)
    ims = ImageSettings.from_dir(ckpt, cfg)
    model = load_model(ckpt, device, getattr(torch, dtype))
    tok = PromptTokenizer(ckpt)
    ref = Reference(ckpt, device)
    cases, cases_sha = load_cases(cases_dir)
    report_cases, all_bad = [], []
    with torch.inference_mode():
        for case in cases:
            img = decode(case.image, ims.size, ims.mean, ims.std, rescale=ims.rescale)
            w, h = img.width, img.height
            levels = model.encode_images(img.pixels[None].to(device, model.text_projection
                                                              .weight.dtype))
            rvis = ref.vision(img.pixels)
            rows = []
            for prompt in case.prompts:
                p = {"text": prompt} if isinstance(prompt, str) else prompt
                text = p.get("text") or "visual"
                boxes = labels = None
                if p.get("boxes"):
                    if not ref.boxes_ok:
                        rows.append({"prompt": p, "skipped": "box prompts: transformers' "
                                     "geometry encoder needs torchvision's roi_align"})
                        continue
                    b = torch.tensor(p["boxes"], dtype=torch.float32)
                    boxes = torch.stack([(b[:, 0] + b[:, 2]) / 2 / w, (b[:, 1] + b[:, 3]) / 2 / h,
                                         (b[:, 2] - b[:, 0]) / w, (b[:, 3] - b[:, 1]) / h], 1)[None]
                    labels = torch.tensor([p.get("labels") or [1] * len(p["boxes"])])
                ids, mask = tok.encode([text])
                rids, rmask = ref.tokens([text])
                tok_ok = bool((ids == rids).all() and (mask == rmask).all())
                dev = lambda t: None if t is None else t.to(device)  # noqa: E731
                det = model.detect(levels, torch.zeros(1, dtype=torch.long, device=device),
                                   model.encode_text(dev(ids), dev(mask)), dev(mask),
                                   None if boxes is None else dev(boxes).to(levels[0].dtype),
                                   dev(labels),
                                   None if boxes is None else torch.ones_like(dev(labels),
                                                                              dtype=torch.bool))
                r = ref.run(rvis, rids, rmask, boxes, labels)
                ours = {"scores": det.scores[0].float().cpu(), "boxes": det.boxes[0].float().cpu(),
                        "masks": lambda q, det=det: masks_at(
                            Sam3.mask_logits(det, 0, torch.tensor(q, device=device)), h, w,
                            MASK_THRESHOLD)}
                theirs = {**r, "masks": lambda q, r=r: masks_at(r["mask_logits"][q], h, w,
                                                                 MASK_THRESHOLD)}
                m = compare(ours, theirs, w, h, limits["kept_margin"])
                m["tokenizer_match"] = tok_ok
                bad = check(m, limits) + ([] if tok_ok else ["token ids differ"])
                all_bad += [f"{case.id} / {text!r}: {b}" for b in bad]
                rows.append({"prompt": p, **m, "breaches": bad})
            report_cases.append({"id": case.id, "width": w, "height": h, "prompts": rows})
    done = [r for c in report_cases for r in c["prompts"] if "skipped" not in r]
    summary = {"prompts": len(done),
               "skipped": sum(1 for c in report_cases for r in c["prompts"] if "skipped" in r),
               "min_mask_iou": min((r["min_mask_iou"] for r in done), default=None),
               "min_box_iou": min((r["min_box_iou"] for r in done), default=None),
               "max_score_diff": max((r["max_score_diff"] for r in done), default=None),
               "kept_reference": sum(r["kept_reference"] for r in done)}
    manifest = {**git_commit(), **versions(), "device": device_name(torch.device(device)),
                "dtype": dtype, "reference_dtype": "float32", "checkpoint": checkpoint_hashes(ckpt),
                "cases": {"path": str(cases_dir), "sha256": cases_sha},
                "reference_boxes": ref.boxes_ok}
    return {"schema": "sammie-gate/1", "manifest": manifest, "thresholds": limits,
            "summary": summary, "pass": not all_bad, "breaches": all_bad,
            "cases": report_cases}


def run(args) -> int:
    from sammie.synth import write_synthetic_checkpoint

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory(prefix="sammie-gate-") as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else write_synthetic_checkpoint(
            Path(tmp) / args.preset, args.preset)
        report = gate(ckpt, args.device, dtype, Path(args.cases))
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    s = report["summary"]
    print(f"sammie gate ({dtype} on {args.device}): {s['prompts']} prompts "
          f"({s['skipped']} skipped), {s['kept_reference']} reference instances; min mask IoU "
          f"{s['min_mask_iou']}, min box IoU {s['min_box_iou']}, max score diff "
          f"{s['max_score_diff']}: {'PASS' if report['pass'] else 'FAIL'}")
    for b in report["breaches"][:20]:
        print("  breach:", b, file=sys.stderr)
    return 0 if report["pass"] else 1
