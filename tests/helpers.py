"""Plain helpers the tests share (imported by name: `from helpers import new_cache`): cache and
checkpoint builders, one sequence through the model, relative error. Fixtures live in
conftest.py, which tests never import (a second conftest.py, tests/clients/, would shadow it)."""

from __future__ import annotations

import torch

from tailored.model.batch import ForwardBatch
from tailored.worker.cache import HybridCache


def checkpoint_tensors(ckpt) -> dict:
    """Every tensor of a checkpoint directory (all shards), by name."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def copy_checkpoint(src, dst, edit):
    """Copy a checkpoint (config.json + all tensors merged into one shard), the tensor dict
    edited in place by `edit(dict)` first (tests of the loader's refusals)."""
    import shutil

    from safetensors.torch import save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    sd = checkpoint_tensors(src)
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def load_cpu_fp32(ckpt):
    """The checkpoint at `ckpt` loaded into a model on the CPU in fp32 (the kernel-path tests'
    models: Triton's interpreter runs fp32)."""
    from tailored.config import ModelConfig
    from tailored.model.loader import load_checkpoint
    from tailored.synth import build_empty_model

    m = build_empty_model(ModelConfig.from_dir(ckpt), "cpu", torch.float32)
    load_checkpoint(m, ckpt, progress=False)
    return m


def new_cache(cfg, num_pages=256, page_size=16, num_slots=8, dtype=torch.float32,
              state_dtype=torch.float32):
    return HybridCache(cfg, num_pages=num_pages, page_size=page_size, num_slots=num_slots,
                       dtype=dtype, device="cpu", state_dtype=state_dtype)


def run_seq(model, cache, ids, start, slot, pages, logits_rows=None):
    """Run one sequence's tokens `ids` at `start` through the model; returns logits of the rows."""
    rows = list(range(len(ids))) if logits_rows is None else logits_rows
    b = ForwardBatch.build([(list(ids), start, slot, start == 0, pages)], rows, "cpu")
    h = model(b, cache)
    return model.compute_logits(h[rows])


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def stop_id_cases(ids, ref, positions: int) -> dict:
    """Requests of prompt `ids` that stop on a token of its greedy output `ref`: for each of
    ref's first `positions` tokens not seen before in it, stop_token_ids=[that token] with
    max_tokens just before, at and after its position (a stop inside, at the end of and past
    an accepted block of drafts)."""
    from tailored.engine.types import SamplingParams

    cases = {}
    for cut in range(positions):
        if ref[cut] not in ref[:cut]:
            for mt in (cut, cut + 1, cut + 2):
                if mt >= 1:
                    cases[f"id{cut}-{mt}"] = (ids, SamplingParams(
                        max_tokens=mt, temperature=0, ignore_eos=True, stop_token_ids=[ref[cut]]))
    return cases
