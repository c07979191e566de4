"""Kernel switches read from the environment (README "Kernel switches under test"): a typo is a
clear error naming the variable, never a silent other setting."""

from __future__ import annotations

import pytest

from tailored.kernels import env_flag, env_int


def test_env_int_default_value_and_errors(monkeypatch):
    monkeypatch.delenv("TAILORED_X", raising=False)
    assert env_int("TAILORED_X", 8, 0, 64) == 8
    monkeypatch.setenv("TAILORED_X", " 32 ")
    assert env_int("TAILORED_X", 8, 0, 64) == 32
    for bad in ("abc", "65", "-1", "3.5"):
        monkeypatch.setenv("TAILORED_X", bad)
        with pytest.raises(ValueError, match="TAILORED_X"):
            env_int("TAILORED_X", 8, 0, 64)
    monkeypatch.setenv("TAILORED_X", "3")
    with pytest.raises(ValueError, match="power of 2"):
        env_int("TAILORED_X", 1, 1, 16, power_of_2=True)
    monkeypatch.setenv("TAILORED_X", "4")
    assert env_int("TAILORED_X", 1, 1, 16, power_of_2=True) == 4


def test_env_flag_default_value_and_errors(monkeypatch):
    monkeypatch.delenv("TAILORED_X", raising=False)
    assert env_flag("TAILORED_X", True) is True
    assert env_flag("TAILORED_X", False) is False
    monkeypatch.setenv("TAILORED_X", " 0 ")
    assert env_flag("TAILORED_X", True) is False
    monkeypatch.setenv("TAILORED_X", "1")
    assert env_flag("TAILORED_X", False) is True
    for bad in ("true", "yes", "on", "2", "off"):
        monkeypatch.setenv("TAILORED_X", bad)
        with pytest.raises(ValueError, match="TAILORED_X"):
            env_flag("TAILORED_X", False)


def test_session9_defaults():
    """The A/B winners of session 9 (kb/0024) are the defaults when the environment is silent."""
    import os

    from tailored.kernels import gdn_decode, moe
    from tailored.model import fast

    for name in ("TAILORED_ROUTE_ALIGN_UP_TO", "TAILORED_GDN_DV_SPLIT",
                 "TAILORED_COMBINE_NEXT_NORM"):
        if os.environ.get(name):
            pytest.skip(f"{name} is set in this environment")
    assert moe.ROUTE_ALIGN_USE_UP_TO == moe.ROUTE_ALIGN_MAX_TOKENS == 64
    assert gdn_decode.DV_SPLIT == 2
    assert fast.COMBINE_NEXT_NORM is True


def test_session18_defaults():
    """Session 18's A/B winners (kb/0036): the shared expert as expert E at one row, routing
    inside the gate_up programs up to two rows."""
    import os

    from tailored.model import fast

    for name in ("TAILORED_SHARED_IN_MOE", "TAILORED_SHARED_IN_MOE_UP_TO",
                 "TAILORED_MOE_ROUTE_IN_GATE_UP_UP_TO"):
        if os.environ.get(name):
            pytest.skip(f"{name} is set in this environment")
    assert fast.SHARED_IN_MOE is True and fast.SHARED_IN_MOE_UP_TO == 1
    assert fast.ROUTE_IN_GATE_UP_UP_TO == 2


def test_session21_defaults():
    """Session 21 (kb/0039): the FP8 experts of 1-2 row MoE inputs run as GEMVs, and so do
    the FP8 dense projections of 1-2 rows."""
    import os

    from tailored.model import fast

    for name in ("TAILORED_MOE_GEMV_UP_TO", "TAILORED_FP8_GEMV_UP_TO",
                 "TAILORED_BF16_GEMV_UP_TO"):
        if os.environ.get(name):
            pytest.skip(f"{name} is set in this environment")
    assert fast.MOE_GEMV_UP_TO == 2 and not hasattr(fast, "MOE_GEMV_BF16")  # deleted, kb/0044
    assert fast.FP8_GEMV_UP_TO == 2


def test_session25_defaults():
    """Session 25 (kb/0042): projections with bf16 weights at one row through the bf16 GEMV
    (PDL-capable, unlike cuBLAS), with the FP8 GEMV's configs by shape."""
    import os

    from tailored.kernels import fp8_gemv, moe
    from tailored.model import fast

    for name in ("TAILORED_BF16_GEMV_UP_TO", "TAILORED_BF16_GEMV_FP8_CFGS",
                 "TAILORED_MOE_FP8_DOWN_F16", "TAILORED_FP8_DENSE_SPLITK_UP_TO"):
        if os.environ.get(name):
            pytest.skip(f"{name} is set in this environment")
    assert fast.BF16_GEMV_UP_TO == 1 and fp8_gemv.BF16_CFGS == fp8_gemv.fp8_cfgs_for_bf16()
    # on since session 28: the dot kind in the decode down config (kb/0044 §4 A/B, gate passed)
    assert moe.FP8_DOWN_F16 is True
    assert not hasattr(fast, "FP8_DENSE_F16_UP_TO")  # deleted: lost (kb/0043)
    assert not hasattr(fast, "FP8_MOE_GROUP_TILED_UP_TO")  # deleted: no gain (kb/0044)
    assert not hasattr(moe, "DECODE_CFG")  # the A/B hook went once its config became a candidate
    assert fast.FP8_DENSE_SPLITK_UP_TO == 8  # kb/0049: A/B -2.2 % at B=8, FP8 gate passed


def test_shared_in_moe_up_to_is_a_strict_integer_switch():
    """Read at import of the kernel path (in a child: no module reload in this process)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = "from tailored.model import fast; print(fast.SHARED_IN_MOE_UP_TO)"
    for raw, ok in (("0", False), ("x", False), ("2", True), ("", True)):
        env = {**os.environ, "TAILORED_SHARED_IN_MOE_UP_TO": raw}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120)
        if ok:
            assert r.returncode == 0 and r.stdout.split()[-1] == (raw or "1"), r.stderr[-300:]
        else:
            assert r.returncode != 0 and "TAILORED_SHARED_IN_MOE_UP_TO" in r.stderr


@pytest.mark.parametrize("name,value", [("TAILORED_CTX_GRAPHS", "yes"),
                                        ("TAILORED_PROMPTS_IN_GRAPHS_CHUNKS", "1")])
def test_bad_switches_stop_the_start_before_the_weights_load(name, value, monkeypatch, tiny_ckpt):
    """`stack.check_kernel_switches` (session 36, found by a new-user trial): where the kernel
    path will run (here `--kernels on`), the switches are read before the model is built, so a
    typo costs no weight load, warm-up or graph capture; TAILORED_CTX_GRAPHS was read only at
    the context graphs' capture (never with --enforce-eager). The plain path ignores them. A
    server process imports the kernel modules there for the first time; here they are
    imported already, so they are taken out of sys.modules (and the package) for the call
    (monkeypatch puts the originals back)."""
    import sys

    import tailored.model as model_pkg
    from tailored import stack as stack_mod

    monkeypatch.setenv(name, value)
    for mod in ("fast", "fast_ctx"):
        monkeypatch.delitem(sys.modules, f"tailored.model.{mod}", raising=False)
        monkeypatch.delattr(model_pkg, mod, raising=False)

    def no_build(*a, **k):
        raise AssertionError("the model was built before the switches were read")

    monkeypatch.setattr(stack_mod, "build_empty_model", no_build)
    with pytest.raises(ValueError, match=name):
        stack_mod.build_stack(tiny_ckpt, device="cpu", dtype="float32", kernels="on",
                              progress=False, max_model_len=64, max_num_seqs=2)
    with pytest.raises(AssertionError, match="built"):  # the plain path does not read them
        stack_mod.build_stack(tiny_ckpt, device="cpu", dtype="float32", kernels="off",
                              progress=False, max_model_len=64, max_num_seqs=2)
