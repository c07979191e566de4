"""`sammie` command line: `serve` (the segmentation server), `synth` (synthetic checkpoints),
`gate` (numerics against transformers' Sam3Model), `bench` (the load client), `reference` (the
reference server it measures against). docs/sammie.md is the manual."""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("sammie")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve SAM 3 segmentation over HTTP")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="SAM 3 checkpoint directory (config.json, model.safetensors, tokenizer "
                        "files) (default: a tiny synthetic model on the CPU, random weights)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 to expose it (default: %(default)s, "
                        "loopback only)")
    p.add_argument("--port", type=int, default=8100,
                   help="port to listen on (default: %(default)s, beside tailored serve's 8000)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when a checkpoint is given and a GPU is present), cpu, "
                        "cuda[:N] (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--served-model-name", default="sam3",
                   help="the model name answers and /v1/models report (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="most images in one model batch (default: 16 on cuda, 4 on cpu)")
    p.add_argument("--batch-wait-ms", type=float, default=None,
                   help="how long the first request of a batch may wait for others "
                        "(default: 5 on cuda, 2 on cpu)")
    p.add_argument("--max-prompts", type=int, default=16,
                   help="most prompts per image (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=32 * 2**20,
                   help="largest request body, else 413 (default: %(default)s)")
    p.add_argument("--max-image-pixels", type=int, default=40_000_000,
                   help="largest image (width x height, read from its header before "
                        "decoding), else 413 (default: %(default)s)")
    p.add_argument("--max-mask-pixels", type=int, default=2**30,
                   help="most mask pixels one answer may hold (masks x width x height), else "
                        "400 before any mask is computed (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request body must arrive whole within this, else 408 "
                        "(default: %(default)s)")
    p.add_argument("--decode-workers", type=int, default=4,
                   help="images decoded at once; each may hold ~0.3 GB at the pixel limit "
                        "(default: %(default)s)")
    p.add_argument("--text-cache-size", type=int, default=4096,
                   help="prompt strings whose text features stay cached (default: %(default)s)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but the "
                        "--api-key-exempt ones, else 401; repeatable. Also SAMMIE_API_KEY "
                        "(comma-separated) and --api-key-file (default: none)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="keys, one a line (blank lines and # comments skipped)")
    p.add_argument("--api-key-exempt", default="health,metrics,version", metavar="LIST",
                   help="routes open without a key: health, metrics, version, or none "
                        "(default: %(default)s)")
    p.add_argument("--allowed-hosts", default="auto", metavar="LIST",
                   help="names the Host header may carry (DNS-rebinding guard); '*' any; auto: "
                        "the loopback names when --host is loopback (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def _synth_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic SAM 3 checkpoint (official layout, "
                                     "random values)")
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    p.add_argument("--seed", type=int, default=0)


def serve_settings(args):
    """(checkpoint path, device, dtype name, ServeSettings, AccessPolicy) from serve's options;
    ValueError for a bad value, before anything loads."""
    import torch

    from tailored.server.guard import AccessPolicy
    from tailored.server.serve_options import allowed_hosts, exempt_paths, read_keys

    from sammie import flags
    from sammie.server.app import ServeSettings

    for name in ("max_batch", "max_prompts", "max_image_pixels", "max_mask_pixels",
                 "decode_workers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if args.batch_wait_ms is not None and not 0 <= args.batch_wait_ms <= 1000:
        raise ValueError(f"--batch-wait-ms must be in [0, 1000], got {args.batch_wait_ms}")
    if not 0 < args.body_timeout <= 3600:
        raise ValueError(f"--body-timeout must be in (0, 3600], got {args.body_timeout}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.device == "auto":
        device = "cuda" if args.checkpoint and torch.cuda.is_available() else "cpu"
    elif args.device == "cpu" or args.device.startswith("cuda"):
        device = args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU on this machine")
    else:
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {args.device!r}")
    gpu = device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    access = AccessPolicy(
        api_keys=read_keys(args.api_key, args.api_key_file, flags.current().api_key,
                           env_name="SAMMIE_API_KEY"),
        exempt_paths=exempt_paths(args.api_key_exempt),
        allowed_hosts=allowed_hosts(args.allowed_hosts, args.host))
    settings = ServeSettings(
        model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
        max_image_pixels=args.max_image_pixels, max_prompts=args.max_prompts,
        max_mask_pixels=args.max_mask_pixels, body_timeout_s=args.body_timeout,
        decode_workers=args.decode_workers,
        max_batch=args.max_batch or (16 if gpu else 4),
        max_wait_ms=args.batch_wait_ms if args.batch_wait_ms is not None else (5 if gpu else 2))
    return device, dtype, settings, access


def build_server(checkpoint, device: str, dtype: str, settings, access, text_cache_size=4096):
    """The FastAPI app serving `checkpoint` (None: the tiny synthetic one)."""
    import torch

    from sammie.checkpoint import ImageSettings, embedded_checkpoint, load_model, synthetic_info
    from sammie.config import SamConfig
    from sammie.engine.segmenter import Segmenter
    from sammie.server.app import build_app
    from sammie.tokenizer import PromptTokenizer

    ckpt = checkpoint or embedded_checkpoint()
    cfg = SamConfig.from_dir(ckpt)
    model = load_model(ckpt, device, getattr(torch, dtype))
    synth = synthetic_info(ckpt)
    settings.info = {"checkpoint": str(ckpt), "synthetic": synth is not None,
                     "preset": synth["preset"] if synth else None, "device": device,
                     "dtype": dtype, "image_size": cfg.image_size,
                     "num_queries": cfg.num_queries}
    segmenter = Segmenter(model, PromptTokenizer(ckpt), text_cache_size=text_cache_size)
    return build_app(segmenter, ImageSettings.from_dir(ckpt, cfg), settings, access)


def cmd_serve(args) -> int:
    import uvicorn

    from sammie import flags
    from tailored.server.guard import is_loopback

    flags.activate(flags.Flags.from_env())
    device, dtype, settings, access = serve_settings(args)
    from tailored.server.serve_options import check_port

    check_port(args.host, args.port)  # before the model loads, not after "serving on"
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.checkpoint is None:
        log.warning("no checkpoint given: serving the TINY SYNTHETIC model (random weights, "
                    "168 px input) on the CPU, so that the API answers; its masks mean nothing. "
                    "Give a SAM 3 checkpoint directory to segment for real.")
    app = build_server(args.checkpoint, device, dtype, settings, access, args.text_cache_size)
    log.info("serving %s on http://%s:%d/v1/segment (%s, %s); batches of up to %d images, "
             "%g ms wait; %s", settings.info["checkpoint"], args.host, args.port, device, dtype,
             settings.max_batch, settings.max_wait_ms,
             f"{len(access.api_keys)} API key(s)" if access.api_keys else "no API key")
    if not access.api_keys and not is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who reaches this port can use "
                    "it (--api-key)", args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0


def cmd_synth(args) -> int:
    from sammie.synth import write_synthetic_checkpoint

    out = write_synthetic_checkpoint(args.out_dir, args.preset, seed=args.seed)
    print(f"wrote a synthetic {args.preset} SAM 3 checkpoint (seed {args.seed}) to {out.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sammie", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _synth_parser(sub)
    from sammie.gate.run import add_parser as gate_parser

    gate_parser(sub)
    from sammie.bench.cli import add_parser as bench_parser

    bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "synth":
            return cmd_synth(args)
        return args.run(args)
    except ValueError as e:
        print(f"sammie {args.command}: {e}", file=sys.stderr)
        return 2
