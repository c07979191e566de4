"""PagePool / SlotPool accounting: pad sink never handed out, no leaks, double frees caught;
the cache budget (runner.plan_cache) and the kernel path's reserve in it."""

from __future__ import annotations

import random

import pytest
import torch

from tailored.engine.memory import PagePool, SlotPool


def test_page_pool_never_hands_out_zero_and_drains_exactly():
    pool = PagePool(9)
    assert pool.capacity == pool.num_free == 8
    got = pool.allocate(8)
    assert sorted(got) == list(range(1, 9))
    assert pool.num_free == 0 and pool.num_used == 8
    assert pool.allocate(1) is None  # short: nothing taken
    assert pool.allocate(0) == []
    pool.free(got)
    assert pool.num_free == 8
    pool.check_integrity()


def test_page_pool_short_allocation_takes_nothing():
    pool = PagePool(5)
    a = pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 4


def test_page_pool_double_free_and_bad_ids():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(AssertionError, match="double free"):
        pool.free(pages[:1])
    with pytest.raises(AssertionError):
        pool.free([0])  # the pad sink is never owned
    with pytest.raises(AssertionError):
        pool.free([4])
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_slot_pool():
    pool = SlotPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {1, 2}
    assert pool.allocate() is None
    pool.free(a)
    assert pool.allocate() == a  # LIFO reuse: stale-state bugs show up at once
    pool.free(b)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(b)
    with pytest.raises(AssertionError):
        pool.free(0)
    with pytest.raises(ValueError):
        SlotPool(1)


@pytest.mark.contract("pools-return-to-baseline")
def test_random_churn_returns_to_baseline():
    rng = random.Random(0)
    pool = PagePool(33)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            got = pool.allocate(rng.randint(1, 6))
            if got is not None:
                assert 0 not in got
                held.append(got)
        owned = [p for h in held for p in h]
        assert len(owned) == len(set(owned)) == pool.num_used
    for h in held:
        pool.free(h)
    assert pool.num_free == pool.capacity
    assert pool.num_allocs == pool.num_frees
    pool.check_integrity()


def test_plan_cache_keeps_the_kernel_paths_reserve_out_of_the_gpu_budget(monkeypatch, tiny_ckpt):
    """runner.plan_cache on a GPU (memory info faked): the pages that fit shrink by the bytes
    the kernel path allocates after the cache (FP8 dense weights dequantized, kb/0026), so
    that allocation cannot run out of memory after the cache took everything."""
    from tailored.config import EngineConfig, ModelConfig
    from tailored.worker.cache import HybridCache
    from tailored.worker.memory_plan import plan_cache

    cfg = ModelConfig.from_dir(tiny_ckpt)
    ec = EngineConfig(max_num_seqs=64, max_model_len=4096, max_num_batched_tokens=256,
                      gpu_memory_utilization=0.5)
    gib = 1024**3
    total = int(4.3 * gib)  # half of it, less the 2 GiB + activation reserves: ~90 MiB of pages
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    dev = torch.device("cuda")
    per_page = HybridCache.bytes_per_page(cfg, ec.page_size, torch.bfloat16)
    p0, slots = plan_cache(cfg, ec, torch.bfloat16, dev)
    p1, _ = plan_cache(cfg, ec, torch.bfloat16, dev, reserve_bytes=64 * 1024**2)
    want = ec.max_num_seqs * ec.max_model_len // ec.page_size + 1
    assert slots == 65 and p1 < p0 < want  # memory-bound, not capped by the request count
    assert p0 - p1 == pytest.approx(64 * 1024**2 / per_page, abs=1)


def test_plan_cache_keeps_speculative_headroom(monkeypatch, tiny_ckpt):
    """With speculative decoding the GPU budget also loses SPEC_HEADROOM_BYTES (on the H200
    the memory-bound spec serve ran out of memory without it, session 15); the CPU's does
    not change."""
    from tailored.config import EngineConfig, ModelConfig
    from tailored.worker.cache import HybridCache
    from tailored.worker.memory_plan import SPEC_HEADROOM_BYTES, plan_cache

    cfg = ModelConfig.from_dir(tiny_ckpt)
    gib = 1024**3
    total = 12 * gib  # memory-bound both ways: 64 requests of 2^19 tokens do not fit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    kw = dict(max_num_seqs=64, max_model_len=1 << 19, max_num_batched_tokens=256,
              gpu_memory_utilization=0.9)
    off, _ = plan_cache(cfg, EngineConfig(**kw), torch.bfloat16, torch.device("cuda"))
    ec = EngineConfig(num_speculative_tokens=2, **kw)
    on, _ = plan_cache(cfg, ec, torch.bfloat16, torch.device("cuda"))
    per_off = HybridCache.bytes_per_page(cfg, 16, torch.bfloat16)
    per_on = HybridCache.bytes_per_page(cfg, 16, torch.bfloat16, 1)
    assert on * per_on <= off * per_off - SPEC_HEADROOM_BYTES + per_on
    assert on * per_on > off * per_off - SPEC_HEADROOM_BYTES - 2 * per_on
    cpu_off, _ = plan_cache(cfg, EngineConfig(**kw), torch.bfloat16, torch.device("cpu"))
    cpu_on, _ = plan_cache(cfg, ec, torch.bfloat16, torch.device("cpu"))
    assert cpu_on == pytest.approx(cpu_off * per_off / per_on, abs=2)


def test_kernel_path_reserve_only_where_the_kernel_path_runs(monkeypatch, switches, tiny_fp8_ckpt):
    """runner.kernel_path_reserve: the FP8 dense-dequant bytes on CUDA with the kernel path;
    0 on the CPU, with --kernels off, and without Triton (that start falls back to the plain
    path and must not import the kernels, review of session 10)."""
    from tailored import kernels
    from tailored.config import EngineConfig, ModelConfig
    from tailored.model.loader import load_checkpoint
    from tailored.model.projections import dense_dequant_bytes
    from tailored.synth import build_empty_model
    from tailored.worker.memory_plan import kernel_path_reserve

    model = build_empty_model(ModelConfig.from_dir(tiny_fp8_ckpt), "cpu", torch.float32)
    load_checkpoint(model, tiny_fp8_ckpt, progress=False)
    switches(fp8_dense_dequant=True, moe_grouped=False)  # the grouped path: its own test below
    ec = EngineConfig()
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "unavailable_reason", lambda *a: None)
    want = dense_dequant_bytes(model, torch.float32)
    assert want > 0 and kernel_path_reserve(model, ec, cuda) == want
    assert kernel_path_reserve(model, ec, torch.device("cpu")) == 0
    assert kernel_path_reserve(model, EngineConfig(kernels="off"), cuda) == 0
    monkeypatch.setattr(kernels, "unavailable_reason", lambda *a: "triton is not installed")
    assert kernel_path_reserve(model, ec, cuda) == 0
    switches(fp8_dense_dequant=False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda *a: None)
    assert kernel_path_reserve(model, ec, cuda) == 0


def test_kernel_path_reserve_holds_the_grouped_experts_scratch(monkeypatch, switches, tiny_fp8_ckpt):
    """The `moe_grouped` switch (kb/0031): the reserve adds, for a step budget that reaches the
    grouped experts, k rows per token of gathered input, gate|up, activation and output, and
    for FP8 experts one layer's bf16 copy of them; nothing below `moe_grouped_from` or when
    off."""
    from tailored import kernels
    from tailored.config import EngineConfig, ModelConfig
    from tailored.model.kernel_moe import moe_grouped_reserve_bytes
    from tailored.model.loader import load_checkpoint
    from tailored.model.projections import dense_dequant_bytes
    from tailored.synth import build_empty_model
    from tailored.worker.memory_plan import kernel_path_reserve

    model = build_empty_model(ModelConfig.from_dir(tiny_fp8_ckpt), "cpu", torch.float32)
    load_checkpoint(model, tiny_fp8_ckpt, progress=False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda *a: None)
    switches(moe_grouped=True, moe_grouped_from=64)
    cfg, ex = model.config, model.model.layers[0].mlp.experts
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    scratch = (ex.gate_up_proj.numel() + ex.down_proj.numel()) * 2
    assert moe_grouped_reserve_bytes(model, torch.bfloat16, 100) == \
        100 * k * (2 * H + 3 * I) * 2 + scratch
    assert moe_grouped_reserve_bytes(model, torch.bfloat16, 63) == 0
    # the path is bf16 only: an fp32 model reserves nothing for it
    assert moe_grouped_reserve_bytes(model, torch.float32, 100) == 0
    ec = EngineConfig(max_num_batched_tokens=100)
    assert kernel_path_reserve(model, ec, torch.device("cuda")) == \
        dense_dequant_bytes(model, torch.float32)
    bf = build_empty_model(ModelConfig.from_dir(tiny_fp8_ckpt), "cpu", torch.bfloat16)
    assert kernel_path_reserve(bf, ec, torch.device("cuda")) == \
        dense_dequant_bytes(bf, torch.bfloat16) + \
        moe_grouped_reserve_bytes(bf, torch.bfloat16, 100)
    switches(moe_grouped=False)
    assert moe_grouped_reserve_bytes(model, torch.bfloat16, 100) == 0


def test_model_runner_hands_the_kernel_paths_reserve_to_plan_cache(monkeypatch, tiny_model):
    """The wiring: ModelRunner sizes its cache with plan_cache(..., kernel_path_reserve(...))
    (without it the FP8 dense-dequant copies would be allocated out of the activation
    reserve after the cache took its share)."""
    from tailored.worker import runner as runner_mod
    from tailored.config import EngineConfig

    seen = {}
    real = runner_mod.plan_cache

    def plan(cfg, ec, dtype, device, reserve_bytes=0):
        seen["reserve"] = reserve_bytes
        return real(cfg, ec, dtype, device, reserve_bytes)

    monkeypatch.setattr(runner_mod, "kernel_path_reserve", lambda model, ec, device: 12345)
    monkeypatch.setattr(runner_mod, "plan_cache", plan)
    ec = EngineConfig(max_num_seqs=2, max_model_len=64, device="cpu", dtype="float32",
                      kernels="off")
    runner_mod.ModelRunner(tiny_model, tiny_model.config, ec, "cpu", torch.float32)
    assert seen == {"reserve": 12345}


def test_gdn_state_dtype_auto_follows_the_model_and_sizes_the_slots(switches, tiny_model):
    """EngineConfig.gdn_state_dtype (kb/0056): "auto" (the default) stores the recurrent states
    in bf16 for a bf16 model, as vLLM does, and in fp32 otherwise; TAILORED_GDN_STATE_DTYPE
    sets the default; a bad name fails at the config, before any weight loads. A bf16 slot
    holds half the recurrent bytes, and the runner's cache has the dtype asked for."""
    from tailored.config import EngineConfig
    from tailored.worker.cache import HybridCache
    from tailored.worker.memory_plan import state_dtype
    from tailored.worker.runner import ModelRunner

    from tailored.flags import Flags

    assert EngineConfig().gdn_state_dtype == "auto"
    assert state_dtype(EngineConfig(dtype="bfloat16")) == torch.bfloat16
    assert state_dtype(EngineConfig(dtype="float32")) == torch.float32
    assert state_dtype(EngineConfig(dtype="bfloat16", gdn_state_dtype="float32")) == torch.float32
    assert state_dtype(EngineConfig(dtype="float32", gdn_state_dtype="bfloat16")) == torch.bfloat16
    switches(gdn_state_dtype="float32")  # the default's switch (TAILORED_GDN_STATE_DTYPE)
    assert state_dtype(EngineConfig(dtype="bfloat16")) == torch.float32
    switches(gdn_state_dtype="auto")
    with pytest.raises(ValueError, match="TAILORED_GDN_STATE_DTYPE"):
        Flags.from_env({"TAILORED_GDN_STATE_DTYPE": "fp16"})
    with pytest.raises(ValueError, match="gdn_state_dtype"):
        EngineConfig(gdn_state_dtype="half")
    cfg = tiny_model.config
    conv = HybridCache.bytes_per_slot(cfg, torch.bfloat16, torch.bfloat16) * 2 \
        - HybridCache.bytes_per_slot(cfg, torch.bfloat16)
    rec32 = HybridCache.bytes_per_slot(cfg, torch.bfloat16) - conv
    assert conv > 0 and rec32 == 4 * len(cfg.gdn_layers) * cfg.linear_num_value_heads \
        * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    ec = EngineConfig(max_num_seqs=2, max_model_len=64, device="cpu", dtype="float32",
                      kernels="off", gdn_state_dtype="bfloat16")
    runner = ModelRunner(tiny_model, cfg, ec, "cpu", torch.float32)
    assert runner.cache.rec.dtype == torch.bfloat16 and runner.cache.conv.dtype == torch.float32
