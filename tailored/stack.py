"""Assemble the serving stack from a checkpoint directory: config → weights → runner → engine.

Used by `tailored serve`, the tests and the GPU scripts, so that they all run the same objects.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tailored import flags
from tailored.config import EngineConfig, ModelConfig
from tailored.engine.engine import Engine
from tailored.model.loader import load_checkpoint
from tailored.synth import build_empty_model, init_dummy_weights, write_synthetic_checkpoint
from tailored.tokenizer import Tokenizer, load_tokenizer
from tailored.worker.runner import ModelRunner

log = logging.getLogger("tailored")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class Stack:
    engine: Engine
    tokenizer: Tokenizer
    model_config: ModelConfig
    engine_config: EngineConfig
    checkpoint_dir: Path


def cache_dir() -> Path:
    """Where generated files go: the `cache` switch (TAILORED_CACHE), else ~/.cache/tailored."""
    return Path(flags.current().cache or Path.home() / ".cache" / "tailored")


def embedded_checkpoint() -> Path:
    """The embedded default: the packaged nano checkpoint (tailored/data/nano, a small trained
    model of this architecture, lab/train_nano.py) when present, else a tiny synthetic
    checkpoint (random weights) generated once into the cache dir."""
    nano = Path(__file__).resolve().parent / "data" / "nano"
    if (nano / "config.json").is_file() and (nano / "model.safetensors").is_file():
        return nano
    d = cache_dir() / "tiny-seed0"
    if not (d / "model.safetensors.index.json").is_file() or not (d / "tokenizer.json").is_file():
        log.info("generating the embedded tiny synthetic checkpoint in %s (once)", d)
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        write_synthetic_checkpoint(tmp, "tiny", seed=0, progress=False)
        if d.exists():
            import shutil

            shutil.rmtree(d)
        tmp.rename(d)
    return d


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def prefill_graphs_auto(device: torch.device, kernels: str = "auto",
                        enforce_eager: bool = False) -> bool:
    """What `--prefill-graphs auto` means: on where the kernel path runs with CUDA graphs (on
    CUDA, not --kernels off, not --enforce-eager), for bf16 and FP8 alike; else off, so that
    no activation reserve is kept for graphs that are never captured (worker/memory_plan.py).

    Both precisions passed the accuracy gate with prefill graphs (kb/0024), and a 1024-token
    bf16 prompt takes 59 ms replayed against ~90-155 ms eager (kb/0013: the eager prefill is
    host-bound). FP8's prefill GEMM tunings are one per shape, not per token bucket (M > 64
    rows share a key), and `tuned.json` holds them, so capturing its buckets costs what
    bf16's does (kb/0026)."""
    return device.type == "cuda" and kernels != "off" and not enforce_eager


def build_stack(checkpoint_dir: str | Path | None, *, load_format: str = "auto",
                num_layers: int | None = None, device: str | None = None, dtype: str | None = None,
                seed: int = 0, progress: bool = True, dummy_init: str = "default",
                switches: flags.Flags | None = None, **engine_kwargs) -> Stack:
    """Build model, runner, engine and tokenizer.

    checkpoint_dir None → the embedded tiny synthetic model on the CPU.
    load_format: 'auto' reads safetensors; 'dummy' reads only config.json + tokenizer files and
    draws the weights on the device with the synthetic statistics (dummy_init: 'default', or
    'stable' for the gate's full-size fixture, synth.init_spec).
    engine_kwargs: EngineConfig fields (max_model_len, max_num_seqs, page_size, ...);
    prefill_graphs may also be "auto": on where the kernel path runs with CUDA graphs
    (`prefill_graphs_auto`).
    switches: the switch record to activate (tailored/flags.py); None keeps the active one
    (parsed from the environment on first use).
    """
    if switches is not None:
        flags.activate(switches)
    flags.current()  # a bad TAILORED_* variable stops here, before any weight is loaded
    if checkpoint_dir is None:
        checkpoint_dir = embedded_checkpoint()
        device = device or "cpu"
        if checkpoint_dir.name == "nano":
            log.info("no checkpoint given: serving the embedded nano model (a small model of this "
                     "architecture trained on Python source, docs/nano.md) from %s on the CPU",
                     checkpoint_dir)
        else:
            log.info("no checkpoint given: serving the embedded tiny synthetic model (random "
                     "weights, meaningless text) from %s on the CPU", checkpoint_dir)
    ckpt = Path(checkpoint_dir)
    cfg = ModelConfig.from_dir(ckpt)
    if num_layers is not None:
        cfg = cfg.with_num_layers(num_layers)
    dev = pick_device(device)
    dt_name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    dt = DTYPES[dt_name]
    if engine_kwargs.get("prefill_graphs") == "auto":
        engine_kwargs["prefill_graphs"] = prefill_graphs_auto(
            dev, engine_kwargs.get("kernels", "auto"), engine_kwargs.get("enforce_eager", False))
    ec = EngineConfig(device=str(dev), dtype=dt_name, **engine_kwargs)
    if ec.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {ec.max_model_len} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    tok = load_tokenizer(ckpt)
    t0 = time.monotonic()
    # the MTP head only where MTP drafts run: without drafts, or with prompt-lookup drafts
    # alone, its weights (a whole MoE layer, ~1.7 GB bf16 at full size) are not loaded
    model = build_empty_model(cfg, dev, dt,
                              with_mtp=ec.uses_mtp)
    if load_format == "dummy":
        init_dummy_weights(model, seed, init=dummy_init)
        log.info("dummy weights drawn on %s in %.1f s", dev, time.monotonic() - t0)
    elif load_format == "auto":
        load_checkpoint(model, ckpt, progress=progress,
                        max_layers=cfg.load_max_layers)
        log.info("weights loaded from %s in %.1f s", ckpt, time.monotonic() - t0)
    else:
        raise ValueError(f"unknown --load-format {load_format!r}; use auto or dummy")
    if cfg.fp8 is not None:
        log.info("block-FP8 checkpoint: e4m3 weights with 128x128 scales stay FP8, activations "
                 "%s (W8A16; activation_scheme %r of the config is not used)", dt_name,
                 cfg.fp8.activation_scheme)
    if cfg.nvfp4 is not None:
        q = cfg.nvfp4
        log.info("NVFP4 checkpoint (%s layout): 4-bit weights with e4m3 scales per 16 stay "
                 "packed, activations %s (W4A16)%s", q.format, dt_name,
                 f"; {q.activations_note}" if q.activations_note else "")
    runner = ModelRunner(model, cfg, ec, dev, dt)
    engine = Engine(cfg, ec, runner, tok)
    return Stack(engine, tok, cfg, ec, ckpt)


def build_engine(checkpoint_dir: str | Path | None, **kwargs) -> Engine:
    """`build_stack(...).engine`: what the engine process builds (server/engine_process.py);
    the HTTP process loads only the tokenizer."""
    return build_stack(checkpoint_dir, **kwargs).engine
