"""`sammie bench` (the load client against any sammie-compatible URL, results with a manifest)
and `sammie reference` (the reference server it is measured against)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") \
            from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return out


def add_parser(sub):
    p = sub.add_parser("bench", help="images/s and latency p50/p99 at each concurrency against "
                                     "a sammie-compatible server")
    p.add_argument("--url", default="http://127.0.0.1:8100", help="(default: %(default)s)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32, 64],
                   help="comma-separated (default: 1,2,4,8,16,32,64)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests a run (default: 16 at c=1, 4 per stream above, at least 32)")
    p.add_argument("--warmups", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--size", type=int, default=1008, help="image side in pixels (default: "
                                                          "%(default)s)")
    p.add_argument("--prompts-per-image", type=int, default=1, help="(default: %(default)s)")
    p.add_argument("--multipart", action="store_true", help="send multipart, not JSON")
    p.add_argument("--mask-format", choices=["rle", "png", "none"], default="rle")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="a name for the result (e.g. sammie, "
                                                 "reference)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(run=run)
    r = sub.add_parser("reference", help="serve transformers' Sam3Model + Sam3Processor "
                                         "behind sammie's API (bench baseline)")
    r.add_argument("checkpoint")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8101)
    r.add_argument("--device", default="cpu")
    r.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    r.set_defaults(run=run_reference)
    return p


def run(args) -> int:
    from tailored.bench.results import build_manifest, make_result, write_result

    from sammie.bench.load import Workload, sweep

    base = Workload(base_url=args.url, warmups=args.warmups, size=args.size,
                    prompts_per_image=args.prompts_per_image, multipart=args.multipart,
                    mask_format=args.mask_format, api_key=args.api_key)
    runs = []
    for c in args.concurrency:
        n = args.num_requests or max(32, 16 if c == 1 else 4 * c)
        base.num_requests = n
        try:
            runs += sweep(base, [c], log=lambda m: print(m, file=sys.stderr, flush=True))
        except RuntimeError as e:
            print(f"sammie bench: {e}", file=sys.stderr)
            return 1
    manifest = build_manifest(base_url=args.url, server_label=args.label,
                              extra={"client": {"name": "sammie bench"}})
    workload = {k: v for k, v in vars(base).items() if k not in ("api_key",)}
    result = make_result(args.label, manifest, workload, runs)
    result["schema"] = "sammie-bench/1"
    if args.out:
        print(f"wrote {write_result(Path(args.out), result)}", file=sys.stderr)
    best = max(runs, key=lambda r: r["images_per_s"])
    print(f"best: {best['images_per_s']:.2f} images/s at c={best['concurrency']}; "
          f"c={runs[0]['concurrency']} p50 {runs[0]['p50_latency_ms']:.1f} ms")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def run_reference(args) -> int:
    import uvicorn

    from sammie.bench.reference_server import ReferencePredictor, build_reference_app

    app = build_reference_app(ReferencePredictor(args.checkpoint, args.device, args.dtype))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)
    return 0
