"""`tailored` command line: `serve` (OpenAI HTTP server), `synth` (synthetic checkpoints), `gate` (accuracy gate),
`bench` (load generator and roofline), `cluster` (N replicas behind a gateway, docs/scale-out.md),
`tune` (search the engine's configuration for a deployment contract, docs/tune.md)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "qwen36-35b-a3b"


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a checkpoint over the OpenAI HTTP API")
    from tailored.server import serve_rules

    def arg(flag, **kw):  # an option with its type or words from serve_rules.py
        p.add_argument(flag, **serve_rules.parser_kwargs(flag[2:].replace("-", "_")), **kw)

    p.add_argument("checkpoint_dir", nargs="?", default=None,
                   help="Hugging Face checkpoint directory: config.json, safetensors shards, "
                        "tokenizer files (default: the embedded nano model, on the CPU)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 to expose the server (default: "
                        "%(default)s, loopback only)")
    arg("--port", default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help=f"model name in the API (default: {DEFAULT_MODEL_NAME})")
    arg("--load-format", default="auto",
        help="auto: read the weights from the checkpoint; dummy: read only "
             "config.json and the tokenizer files, draw random weights on the device "
             "(default: %(default)s)")
    arg("--num-layers", default=None,
        help="run only the first N decoder layers, full width (default: all)")
    arg("--device", default="auto",
        help="auto (cuda if present; the embedded model runs on the CPU), cuda or "
             "cpu (default: %(default)s)")
    arg("--dtype", default=None,
        help="the model's compute dtype; an FP8 checkpoint keeps its FP8 weights "
             "(default: bfloat16 on cuda, float32 on cpu)")
    arg("--max-model-len", default=None,
        help="prompt + completion limit in tokens (default: 16384 on cuda, 4096 on "
             "cpu)")
    arg("--max-num-seqs", default=None,
        help="most concurrent running requests (default: 64 on cuda, 16 on cpu)")
    arg("--max-num-batched-tokens", default=None,
        help="token budget of one engine step (default: 8192 on cuda, as the vLLM "
             "baseline; 2048 on cpu)")
    arg("--prefill-stall-factor", default=None, metavar="F",
        help="while requests decode, a step that also carries prompt tokens is cut "
             "to take at most F x the measured decode-only step, its first chunk at "
             "least TAILORED_MIN_PREFILL_CHUNK tokens (docs/scheduling.md); 0 = "
             "off, the token budget alone (default: 0 until a GPU A/B decides; the simulator's choice is 2.5, kb/0063)")
    arg("--page-size", default=16,
        help="tokens per KV cache page (default: %(default)s)")
    arg("--gpu-memory-utilization", default=0.90,
        help="share of GPU memory for weights, KV pages and GDN state slots "
             "(default: %(default)s)")
    arg("--seed", default=0,
        help="seed of --load-format dummy weights (default: %(default)s)")
    arg("--dummy-init", default="default",
        help="statistics of --load-format dummy weights; stable: the scaled "
             "residual init of `tailored gate`'s full-size fixture (kb/0008), whose "
             "40 layers stay well-conditioned (docs/evaluation.md serves it) "
             "(default: %(default)s)")
    arg("--kernels", default="auto",
        help="Triton kernel path with decode CUDA graphs. auto: on CUDA only; off: "
             "the plain PyTorch path everywhere; on: also on the CPU, in Triton's "
             "interpreter (tests only: needs TRITON_INTERPRET=1 and --dtype "
             "float32, very slow) (default: %(default)s)")
    arg("--enforce-eager",
        help="kernel path without decode CUDA graphs; no effect on the plain path "
             "(default: off, graphs are used)")
    arg("--prefill-graphs", default="auto",
        help="replay CUDA graphs for a fresh prompt alone in its step, padded to a "
             "bucket of 128..2048 (step 128), 3072, 4096, 6144, 8192 tokens (kernel "
             "path with graphs only). auto: on where the kernel path runs CUDA "
             "graphs, bf16 and FP8, else off (default: %(default)s)")
    arg("--async-scheduling", default="auto",
        help="launch each pure decode step before the previous step's tokens are "
             "read, feeding them on the device, so host work overlaps the GPU. "
             "auto: on on CUDA, off on the CPU (there the forward runs at launch, so "
             "nothing overlaps and each token would arrive a step later) (default: "
             "%(default)s)")
    arg("--num-speculative-tokens", default=0, metavar="N",
        help="speculative decoding, N in 0..8 (0 = off): up to N tokens are drafted "
             "per decode step of each greedy request without penalties (by the "
             "checkpoint's MTP head, or prompt lookup: --speculative-method), and "
             "the model verifies them in the same step, so the output stays the "
             "greedy output. Drafting pauses while more than --spec-max-running "
             "requests run. On CUDA the verify and drafting steps replay CUDA "
             "graphs. Every 10 s the log reports the share of drafts kept since "
             "start (default: %(default)s)")
    arg("--speculative-method", default=None,
        help="with --num-speculative-tokens, where drafts come from. mtp: the "
             "checkpoint's MTP head; ngram: prompt lookup (vLLM's method of that "
             "name), the tokens that followed the last earlier occurrence of the "
             "request's last n tokens in its own prompt and output, for repetitive "
             "text (code edits, JSON, quoting); no MTP head is loaded; ngram+mtp: "
             "prompt lookup where it finds a match, else the MTP head "
             "(default: mtp)")
    arg("--prompt-lookup-max", default=None, metavar="N",
        help="with --speculative-method ngram or ngram+mtp: the longest n-gram "
             "looked up; the longest that matches wins (default: 4)")
    arg("--prompt-lookup-min", default=None, metavar="N",
        help="with --speculative-method ngram or ngram+mtp: the shortest n-gram "
             "that may match (default: 2, at most --prompt-lookup-max)")
    arg("--spec-min-acceptance", default=None, metavar="RATE",
        help="with --num-speculative-tokens: adaptive draft length. A request's "
             "next step verifies the largest k <= N drafts with a_1 x ... x a_k >= RATE, "
             "a_j being its recent share of drafts kept at position j; below RATE "
             "for one draft it pauses drafting (4, then 8, ... up to 64 steps) and "
             "probes again. 0 = always N drafts (default: 0.5)")
    arg("--spec-max-running", default=None, metavar="B",
        help="with --num-speculative-tokens: requests draft only while at most B "
             "run; verify steps replay CUDA graphs up to B sequences. Each sequence "
             "of such a graph keeps N GDN state snapshots of ~33 MB each at full "
             "size (~64 MB with --gdn-state-dtype float32). On an H100 two drafts "
             "made c=1 faster and c=8 27%% slower (kb/0062) (default: 2, at most "
             "--max-num-seqs)")
    arg("--spec-synthetic-acceptance", default=None, metavar="RATE",
        help="benchmarks on random weights only, needs --num-speculative-tokens: "
             "keep each draft with probability RATE in [0, 1] instead of verifying "
             "it (as vLLM's synthetic rejection sampler in the baseline kit's "
             "`serve mtp`); the text is then not the model's (default: none, drafts "
             "are verified)")
    arg("--gdn-state-dtype", default=None,
        help="storage of the GDN layers' recurrent states (the kernels compute in "
             "float32 either way). auto: bfloat16 for a bfloat16 model, as vLLM "
             "stores them, else float32. bfloat16 halves the state bytes every "
             "decode step reads and writes (c=32 step 3-4%% faster on the H200) and "
             "each request's state memory; float32 keeps the states unrounded "
             "between steps (default: auto, or TAILORED_GDN_STATE_DTYPE when set)")
    arg("--prefix-cache-entries", default=0, metavar="N",
        help="prefix caching (0 = off): keep the KV pages and GDN state of the last "
             "N prompts (least recently used dropped first), so a prompt that "
             "extends one of them (the next turn of a chat or agent loop) computes "
             "only its new tokens. Each entry costs one GDN state (~33 MB at full "
             "size, ~64 MB with float32 states, taken from the KV cache's memory) "
             "plus its pages while kept; size N above the conversations in flight "
             "(~2x). Prompts are saved up to their last chat message, and up to a "
             "leading system message of 64+ tokens, so a new chat with the same "
             "system prompt hits there too. On CUDA with prefill graphs, the rest "
             "of a prompt after a cached prefix (up to 2048 tokens) replays CUDA "
             "graphs (docs/serving.md) (default: %(default)s)")
    arg("--gil-switch-interval-ms", default=None,
        help="sys.setswitchinterval in the server and engine processes: how long "
             "the engine loop may wait for the GIL held by the HTTP side after each "
             "GPU sync; an experiment knob (default: Python's 5 ms)")
    arg("--engine-process", default="on",
        help="on: the engine loop runs in its own process, so the HTTP server's "
             "Python and the engine's do not share one GIL; off: a thread of the "
             "server process (default: %(default)s)")
    arg("--shutdown-timeout", default=30.0,
        help="seconds that SIGTERM or a first Ctrl-C lets in-flight requests run "
             "before they end with an error event; a second Ctrl-C exits at once "
             "(default: %(default)s)")
    arg("--max-body-bytes", default=None,
        help="largest request body in bytes, else 413. Bodies are parsed on the "
             "event loop, so a larger cap lets one huge body stall every stream "
             "longer (default: 256 a token of --max-model-len, within 2 to 32 MiB: "
             "4 MiB at 16k)")
    arg("--reasoning-parser", default=None,
        help="qwen3: chat answers split into reasoning / reasoning_content (the "
             "thinking, up to </think>, under both names) and content (the answer "
             "after it), streamed too, as vLLM's parser of that name (default: none, "
             "content is the raw text)")
    arg("--access-log", default="on",
        help="one log line per request: method, path, status, prompt and "
             "completion tokens, latency (default: %(default)s)")
    arg("--log-level", default="info",
        help="Python log level (default: %(default)s)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="apply a profile written by `tailored tune` (docs/tune.md): its engine "
                        "options and TAILORED_* switches; options given on this command line "
                        "and switches set in the environment win over it. Refused when it was "
                        "made for another checkpoint, precision or GPU kind (default: none)")
    from tailored.server.serve_options import add_front_door_options

    add_front_door_options(p)  # API keys, allowed hosts, the health bound (docs/serving.md)
    return p


def _synth_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic checkpoint (official layout, random values)")
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None,
                   help="fewer decoder layers (keeps full width), e.g. 4 for a full-width file test")
    p.add_argument("--device", default="cpu", help="draw the random values on this device (cuda is faster)")
    p.add_argument("--config-only", action="store_true",
                   help="write config and tokenizer files only (for serve --load-format dummy)")
    p.add_argument("--dtype", choices=["bf16", "fp8", "nvfp4"], default="bf16",
                   help="fp8: Qwen's block-FP8 layout (e4m3 weights + 128x128 weight_scale_inv, "
                        "per-expert experts, quantization_config): the bf16 values quantized; "
                        "nvfp4: NVFP4 (4-bit E2M1 + e4m3 scale per 16 + fp32 global) in the "
                        "layout of --format (docs/nvfp4.md)")
    p.add_argument("--format", choices=["modelopt", "compressed-tensors"], default="modelopt",
                   dest="nvfp4_format",
                   help="--dtype nvfp4 only: modelopt (the official release's: experts, shared "
                        "expert and lm_head NVFP4, GDN and attention projections FP8 per tensor) "
                        "or compressed-tensors (llm-compressor's nvfp4-pack-quantized)")


def _check_serve_args(args) -> None:
    """Reject bad flag values in one line before anything slow (weights) happens: each option
    on its own (server/serve_rules.py, which tune's preflight shares), then the options
    together, then what this machine offers."""
    from tailored.server import serve_rules

    serve_rules.check_all(args)
    _check_combinations(args)
    _require_cuda_if_asked(args.device)
    if args.kernels == "on":  # the runner checks too; here it fails before the weights load
        from tailored import kernels
        from tailored.stack import DTYPES, pick_device

        dev = pick_device(None if args.device == "auto" else args.device)
        dt = DTYPES[args.dtype or ("bfloat16" if dev.type == "cuda" else "float32")]
        why = kernels.unavailable_reason(dev.type, dt)
        if why:
            raise ValueError(f"--kernels on: {why}")
    # a busy port would only show after the weights are loaded: check it first
    from tailored.server.serve_options import check_port

    check_port(args.host, args.port)


def _check_combinations(args) -> None:
    """The rules between options: drafting's options need drafting on, prompt lookup's
    need its method, and its n-gram bounds are ordered."""
    for flag in ("spec_max_running", "speculative_method", "prompt_lookup_max",
                 "prompt_lookup_min", "spec_min_acceptance", "spec_synthetic_acceptance"):
        if getattr(args, flag) is not None and args.num_speculative_tokens == 0:
            raise ValueError(f"--{flag.replace('_', '-')} needs --num-speculative-tokens >= 1")
    lo = 2 if args.prompt_lookup_min is None else args.prompt_lookup_min
    hi = 4 if args.prompt_lookup_max is None else args.prompt_lookup_max
    if (args.prompt_lookup_min is not None or args.prompt_lookup_max is not None) and (
            args.speculative_method or "mtp") == "mtp":
        raise ValueError("--prompt-lookup-max/min need --speculative-method ngram or ngram+mtp")
    if not 1 <= lo <= hi:
        raise ValueError(f"--prompt-lookup-min must be in 1..--prompt-lookup-max, got {lo} "
                         f"and {hi} (defaults 2 and 4)")


def speculative_options(args) -> dict:
    """EngineConfig fields of the speculative-decoding flags that were given (the others keep
    EngineConfig's defaults)."""
    return {k: getattr(args, k) for k in ("spec_max_running", "speculative_method",
                                          "prompt_lookup_max", "prompt_lookup_min",
                                          "spec_min_acceptance") if getattr(args, k) is not None}


def async_scheduling_on(mode: str, checkpoint_dir, device: str) -> bool:
    """--async-scheduling: on, off, or auto = on where the engine runs on CUDA. With no
    checkpoint the embedded model runs on the CPU unless --device names CUDA (build_stack)."""
    if mode != "auto":
        return mode == "on"
    from tailored.stack import pick_device

    return pick_device("cpu" if checkpoint_dir is None and device == "auto"
                       else device).type == "cuda"


def _apply_profile(args, switches):
    """--profile: the profile checked against this checkpoint, precision and GPU, its options
    set where the command line gave none; returns (profile or None, switches)."""
    if not args.profile:
        return None, switches
    from tailored import flags
    from tailored.config import ModelConfig
    from tailored.stack import embedded_checkpoint, pick_device
    from tailored.tune import profile as prof

    p = prof.load_profile(args.profile)
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir is not None else embedded_checkpoint()
    dev = pick_device("cpu" if args.checkpoint_dir is None and args.device == "auto"
                      else None if args.device == "auto" else args.device)
    prof.check_profile(p, checkpoint_dir=ckpt, precision=ModelConfig.from_dir(ckpt).precision,
                       device_name=prof.gpu_kind(str(dev)))
    p["applied"] = prof.apply_to_args(args, p, getattr(args, "explicit", set()),
                                      getattr(args, "option_types", {}))
    return p, prof.switches_with(p, switches, flags.set_in_env())


def cmd_serve(args) -> int:
    from tailored import flags

    # every TAILORED_* switch parsed once, strictly, before anything slow; the engine process
    # receives this record (tailored/flags.py)
    profile, switches = _apply_profile(args, flags.Flags.from_env())
    switches = flags.activate(switches)
    _check_serve_args(args)
    from tailored.server.serve_options import access_policy

    access = access_policy(args, switches.api_key)
    import uvicorn

    if args.gil_switch_interval_ms is not None:
        sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)

    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack, pick_device

    on_gpu = args.checkpoint_dir is not None and pick_device(args.device).type == "cuda"
    kw = dict(
        max_model_len=args.max_model_len if args.max_model_len is not None else (16384 if on_gpu else 4096),
        max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else (64 if on_gpu else 16),
        # large prefill steps on the GPU: every step streams all 256 experts' weights of each
        # layer, and its host cost is per layer, not per token (kb/0011)
        max_num_batched_tokens=args.max_num_batched_tokens or (8192 if on_gpu else 2048),
        # a prompt chunk holds every decode for its step: cut it to a time budget (kb/0063)
        # off by default until measured on the GPU: the simulator predicts TTFT p50 -3x but
        # output tok/s -12 % and TTFT p99 x1.5-2.5 at c=64-128
        prefill_stall_factor=args.prefill_stall_factor if args.prefill_stall_factor is not None
        else 0.0,
        page_size=args.page_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kernels=args.kernels,
        enforce_eager=args.enforce_eager,
        prefill_graphs="auto" if args.prefill_graphs == "auto" else args.prefill_graphs == "on",
        async_scheduling=async_scheduling_on(args.async_scheduling, args.checkpoint_dir,
                                             args.device),
        num_speculative_tokens=args.num_speculative_tokens,
        spec_synthetic_acceptance=args.spec_synthetic_acceptance,
        **speculative_options(args),
        grammar_warmup=True,
        prefix_cache_entries=args.prefix_cache_entries,
    )
    if args.gdn_state_dtype is not None:
        kw["gdn_state_dtype"] = args.gdn_state_dtype
    build_kwargs = dict(load_format=args.load_format, num_layers=args.num_layers,
                        device=None if args.checkpoint_dir is None and args.device == "auto" else args.device,
                        dtype=args.dtype, seed=args.seed, dummy_init=args.dummy_init,
                        switches=switches, **kw)
    if args.engine_process == "on":
        from tailored.server.engine_process import EngineProcess
        from tailored.stack import build_engine, embedded_checkpoint
        from tailored.tokenizer import load_tokenizer

        # the embedded checkpoint is generated (once) here, before the child looks for it
        ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir is not None else embedded_checkpoint()
        tokenizer = load_tokenizer(ckpt)
        async_engine = EngineProcess(
            build_engine, dict(checkpoint_dir=args.checkpoint_dir, **build_kwargs),
            switch_interval_s=None if args.gil_switch_interval_ms is None
            else args.gil_switch_interval_ms / 1e3, stall_timeout_s=args.health_stall_timeout)
        async_engine.start()  # builds the model in the child; raises its build error here
        max_model_len = kw["max_model_len"]
    else:
        stack = build_stack(args.checkpoint_dir, **build_kwargs)
        ckpt, tokenizer = stack.checkpoint_dir, stack.tokenizer
        async_engine = AsyncEngine(stack.engine, stall_timeout_s=args.health_stall_timeout)
        max_model_len = stack.engine_config.max_model_len
    gen_cfg = ckpt / "generation_config.json"
    defaults = None
    if gen_cfg.is_file():
        g = json.loads(gen_cfg.read_text())
        # OpenAI semantics: an omitted temperature means 1.0; take the model's top_k/top_p like vLLM
        defaults = {k: g[k] for k in ("temperature", "top_p", "top_k") if k in g}
    app = build_app(async_engine, tokenizer, args.served_model_name or DEFAULT_MODEL_NAME,
                    max_model_len, sampling_defaults=defaults,
                    reasoning_parser=args.reasoning_parser,
                    max_body_bytes=args.max_body_bytes, access_log=args.access_log == "on",
                    access=access, profile=_profile_summary(profile))
    if profile is not None:
        logging.getLogger("tailored").info(
            "profile %s (sha256 %s, %s): applied %s; kept from the command line: %s",
            profile["name"], profile["sha256"][:12], profile["file"],
            ", ".join(f"{k}={v}" for k, v in profile["applied"].items()) or "nothing",
            ", ".join(f"{k}={v}" for k, v in profile["kept"].items()) or "nothing")
    logging.getLogger("tailored").info(
        "engine: max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, "
        "prefill_stall_factor %g, page_size %d, engine loop in %s%s",
        max_model_len, kw["max_num_seqs"], kw["max_num_batched_tokens"],
        kw["prefill_stall_factor"], kw["page_size"],
        f"process {async_engine.pid}" if args.engine_process == "on" else "a thread",
        f", GIL switch interval {sys.getswitchinterval() * 1e3:g} ms"
        if args.gil_switch_interval_ms is not None else "")
    changed = switches.changed()
    logging.getLogger("tailored").info(
        "switches: %s", ", ".join(f"{k}={v}" for k, v in changed.items()) if changed
        else "all at their defaults (docs/switches.md)")
    logging.getLogger("tailored").info(
        "serving on http://%s:%d/v1; %s; Host header: %s", args.host, args.port,
        f"{len(access.api_keys)} API key(s)" if access.api_keys else "no API key",
        ", ".join(sorted(access.allowed_hosts)) if access.allowed_hosts else "any")
    from tailored.server.guard import is_loopback

    if not access.api_keys and not is_loopback(args.host):
        logging.getLogger("tailored").warning(
            "listening on %s without an API key: anyone who reaches this port can use it "
            "(--api-key, docs/serving.md#security)", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False,  # ours (--access-log) counts the tokens
                            # a backstop: the engine shutdown below ends every stream first
                            timeout_graceful_shutdown=args.shutdown_timeout + 15)
    try:
        _bounded_shutdown_server(config, async_engine, args.shutdown_timeout).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        logging.getLogger("tailored").info("stopped (Ctrl-C)")
        return 130  # a shell's code for a Ctrl-C'd command, without a traceback
    finally:
        # a second Ctrl-C makes uvicorn skip the app's shutdown: stop the engine here (a no-op
        # after a normal shutdown), or the engine process would keep the interpreter's exit
        # waiting on it
        async_engine.shutdown(timeout=2)
    return 0


def _profile_summary(profile):
    if profile is None:
        return None
    from tailored.tune.profile import summary

    return summary(profile)


def _bounded_shutdown_server(config, async_engine, timeout_s: float):
    """uvicorn's Server with a bound on its graceful shutdown: uvicorn waits for open
    connections with no limit, and a stream can run for max_model_len tokens. When uvicorn
    starts shutting down (first SIGTERM / Ctrl-C), a timer is set on the event loop (not in
    the signal handler: starting a thread there can deadlock on threading's own lock); when
    it fires, the engine shuts down in a worker thread, which ends every pending request with
    an ERROR output (an error event and [DONE] on a stream, a 500 otherwise), so the
    connections close and uvicorn finishes. A request that ends before the timer is untouched."""
    import asyncio
    import threading

    import uvicorn

    log = logging.getLogger("tailored")

    def stop():
        log.info("shutdown timeout: ending the requests still in flight")
        async_engine.shutdown()

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            log.info("shutting down: in-flight requests have %g s to finish", timeout_s)
            asyncio.get_running_loop().call_later(
                timeout_s, lambda: threading.Thread(target=stop, daemon=True).start())
            await super().shutdown(sockets=sockets)

    return Server(config)


def _require_cuda_if_asked(device: str) -> None:
    """Raises ValueError when `device` names CUDA and this machine has no CUDA GPU."""
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is available on this machine")


def cmd_synth(args) -> int:
    from tailored.synth import write_synthetic_checkpoint

    if args.nvfp4_format != "modelopt" and args.dtype != "nvfp4":
        raise ValueError(f"--format {args.nvfp4_format} applies to --dtype nvfp4 only")
    if not args.config_only:  # before any directory is made (found by a new-user trial)
        _require_cuda_if_asked(args.device)
    out = write_synthetic_checkpoint(args.out_dir, args.preset, seed=args.seed,
                                     num_layers=args.num_layers, config_only=args.config_only, device=args.device,
                                     precision=args.dtype, nvfp4_format=args.nvfp4_format)
    what = "config and tokenizer files of the" if args.config_only else "a"
    kind = f"{args.dtype} ({args.nvfp4_format})" if args.dtype == "nvfp4" else args.dtype
    print(f"wrote {what} {args.preset} {kind} checkpoint to {Path(out).resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tailored", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _serve_parser(sub)
    _synth_parser(sub)
    from tailored.gate.run import add_parser as gate_parser

    gate_parser(sub)
    from tailored.bench import cli as bench_cli

    bench_cli.add_parser(sub)
    from tailored import cluster

    cluster.add_parser(sub)
    from tailored.tune import cli as tune_cli

    tune_cli.add_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.profile:  # explicit options win over the profile's
        from tailored.tune.profile import explicit_options

        args.explicit = explicit_options(serve_parser, argv[argv.index("serve") + 1:])
        args.option_types = {a.dest: a.type for a in serve_parser._actions if a.type}
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: thousands of lines a benchmark or tune run
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.command == "bench":
            return bench_cli.run(args)
        if args.command == "cluster":
            return cluster.run(args)
        if args.command == "tune":
            return tune_cli.run(args)
        if args.command == "gate":
            from tailored.gate.run import run as cmd_gate

            return cmd_gate(args)
        return {"serve": cmd_serve, "synth": cmd_synth}[args.command](args)
    except (ValueError, RuntimeError, OSError) as e:
        # config/checkpoint problems are user errors: one line, no traceback
        print(f"tailored {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
