"""kernels/tuning.py: saved autotune choices pre-fill a launcher's cache (CPU: a stand-in tuner
with Triton's `configs`/`cache` attributes)."""

from __future__ import annotations

import json

import pytest
import triton

from tailored.kernels import tuning


class FakeTuner:
    """What tuning uses of triton's Autotuner: its candidate configs and its key → config cache."""

    def __init__(self, configs):
        self.configs = configs
        self.cache = {}


def _cfgs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": 128}, num_warps=4, num_stages=st)
            for bn in (16, 32) for st in (3, 4)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(tuning, "_REGISTRY", {})
    monkeypatch.setattr(tuning, "_TABLE", None)


def _write(path, gpu, entries):
    path.write_text(json.dumps({"gpu": gpu, "triton": triton.__version__,
                                "launchers": {"lin": entries}}))


def test_table_prefills_known_keys_with_offered_configs_only(tmp_path, monkeypatch, switches):
    p = tmp_path / "t.json"
    _write(p, tuning._device_name(), [
        {"key": [2048, 4096, 16, 1, "torch.bfloat16"], "kwargs": {"BLOCK_N": 32, "BLOCK_K": 128},
         "num_warps": 4, "num_stages": 4},
        # a config the launcher no longer offers: ignored (that key tunes as usual)
        {"key": [2048, 4096, 16, 2, "torch.bfloat16"], "kwargs": {"BLOCK_N": 64, "BLOCK_K": 128},
         "num_warps": 4, "num_stages": 4},
        {"bad": "entry"},
    ])
    switches(tuning=str(p))
    t = tuning.register("lin", FakeTuner(_cfgs()))
    assert list(t.cache) == [(2048, 4096, 16, 1, "torch.bfloat16")]
    c = t.cache[(2048, 4096, 16, 1, "torch.bfloat16")]
    assert c.kwargs == {"BLOCK_N": 32, "BLOCK_K": 128} and c.num_warps == 4 and c.num_stages == 4


def test_table_of_another_gpu_or_off_or_missing_is_not_used(tmp_path, monkeypatch, switches):
    p = tmp_path / "t.json"
    _write(p, "some other GPU", [{"key": [1], "kwargs": {"BLOCK_N": 16, "BLOCK_K": 128},
                                  "num_warps": 4, "num_stages": 3}])
    for env in (str(p), "off", str(tmp_path / "missing.json")):
        switches(tuning=env)
        monkeypatch.setattr(tuning, "_TABLE", None)
        assert tuning.register("lin", FakeTuner(_cfgs())).cache == {}
    (tmp_path / "junk.json").write_text("{not json")
    switches(tuning=str(tmp_path / "junk.json"))
    monkeypatch.setattr(tuning, "_TABLE", None)
    assert tuning.register("lin", FakeTuner(_cfgs())).cache == {}


def test_dump_then_load_round_trips_and_merges(tmp_path, monkeypatch, switches):
    switches(tuning="off")
    a = tuning.register("lin", FakeTuner(_cfgs()))
    a.cache[(2048, 4096, 16, 1, "torch.bfloat16", True)] = _cfgs()[3]
    p = tmp_path / "t.json"
    assert tuning.dump(p, {"commit": "x"}) == 1
    # a second process tunes another key: the file keeps both
    monkeypatch.setattr(tuning, "_REGISTRY", {})
    b = tuning.register("lin", FakeTuner(_cfgs()))
    b.cache[(512, 2048, 16, 1, "torch.bfloat16", False)] = _cfgs()[0]
    assert tuning.dump(p, {"fp8": True}) == 2
    # the first manifest's fields stay beside the second's (a table's provenance survives)
    assert json.loads(p.read_text())["manifest"] == {"commit": "x", "fp8": True}
    switches(tuning=str(p))
    monkeypatch.setattr(tuning, "_TABLE", None)
    c = tuning.register("lin", FakeTuner(_cfgs()))
    assert set(c.cache) == {(2048, 4096, 16, 1, "torch.bfloat16", True),
                            (512, 2048, 16, 1, "torch.bfloat16", False)}
    assert c.cache[(2048, 4096, 16, 1, "torch.bfloat16", True)].num_stages == 4


def _shipped_table_and_launchers(monkeypatch, switches) -> dict:
    """The shipped table's launchers ({name: rows}), every autotuned launcher registered
    afresh (none prefilled) with the default switches, whatever the environment."""
    from tailored.kernels import fp8_linear, moe

    table = json.loads(tuning.DEFAULT_TABLE.read_text())["launchers"]
    switches(tuning="off")
    monkeypatch.setattr(tuning, "_TABLE", None)  # (the autouse fixture resets _REGISTRY)
    monkeypatch.setattr(fp8_linear, "_TUNED", {})
    monkeypatch.setattr(moe, "_LAUNCHERS", {})
    switches(moe_fp8_down_f16=True)
    for small in (True, False):
        fp8_linear._tuned(small)
    for name in ("gate_up", "down", "route_gate_up"):
        for decode in (True, False):
            for w8 in (True, False):
                moe._launcher(name, decode, w8)
    return table


def test_shipped_table_keys_have_the_launchers_key_layout(monkeypatch, switches):
    """Every entry of tailored/kernels/tuned.json is keyed as its launcher's autotuner keys
    today: one value per `key` name (in order), then one dtype string per tensor argument
    (the kernel's *_ptr arguments). A launcher whose key gained or lost a name (fp8_linear's NB
    and DOT_F16 in kb/0043, DOT_F16 gone in kb/0044) silently re-tunes every stale entry at
    server start (minutes on the H200): the table must be migrated with the key."""
    table = _shipped_table_and_launchers(monkeypatch, switches)
    for name, rows in table.items():
        tuner = tuning._REGISTRY[name]
        n_ptr = sum(a.endswith("_ptr") for a in tuner.arg_names)
        for r in rows:
            key = r["key"]
            assert len(key) == len(tuner.keys) + n_ptr, (name, key)
            assert all(isinstance(v, str) and v.startswith("torch.") for v in key[-n_ptr:])
            assert not any(isinstance(v, str) for v in key[:len(tuner.keys)]), (name, key)
    # fp8_linear's layout by name: N, K, BLOCK_M, M_BUCKET, then the dtypes of x, weight,
    # scale_rows and y, in argument order (NB and the bf16 rows' dtype left in session 28)
    assert tuning._REGISTRY["fp8_linear/small"].keys == ["N", "K", "BLOCK_M", "M_BUCKET"]
    dtypes = ["torch.bfloat16", "torch.float8_e4m3fn", "torch.float32", "torch.bfloat16"]
    for name in ("fp8_linear/small", "fp8_linear/large"):
        for r in table[name]:
            N, K, bm, bucket, *dt = r["key"]
            assert dt == dtypes, r["key"]
            assert K % 128 == 0 and bm in (16, 32, 64, 128) and N > 0, r["key"]


def test_shipped_table_configs_are_offered(monkeypatch, switches):
    """Every entry of tailored/kernels/tuned.json names a config its launcher still offers
    (with the default switches): `register` drops any other, and the key then re-tunes at
    server start (minutes on the H200). Session 28 (kb/0045) put DOT_F16 into the FP8 decode
    down configs, so those entries carry it; session 30's re-tune (kb/0047) picked float16
    dots for most buckets, among them the two the A/B measured (B=8 and B=32)."""
    table = _shipped_table_and_launchers(monkeypatch, switches)
    for name, rows in table.items():
        offered = {tuning._config_id(c.kwargs, c.num_warps, c.num_stages)
                   for c in tuning._REGISTRY[name].configs}
        for r in rows:
            assert tuning._config_id(r["kwargs"], r["num_warps"], r["num_stages"]) in offered, \
                (name, r)
    down = table["moe/down/decode/fp8"]
    assert all("DOT_F16" in r["kwargs"] for r in down)
    f16 = {(r["key"][3], r["key"][4]) for r in down if r["kwargs"]["DOT_F16"]}
    assert {(64, True), (256, False)} <= f16  # B=8 and B=32, as measured (kb/0044 §4, 0047)


def test_the_shipped_table_is_chosen_by_gpu_model(tmp_path):
    """One table per GPU model beside the others: the one measured on this card is loaded; an
    unknown card falls back to tuned.json (whose GPU check then declines it)."""
    _write(tmp_path / "tuned.json", "NVIDIA H200", [])
    _write(tmp_path / "tuned-h100.json", "NVIDIA H100 80GB HBM3", [])
    (tmp_path / "tuned-broken.json").write_text("{not json")
    assert tuning.shipped_table("NVIDIA H100 80GB HBM3", tmp_path).name == "tuned-h100.json"
    assert tuning.shipped_table("NVIDIA H200", tmp_path).name == "tuned.json"
    assert tuning.shipped_table("NVIDIA B200", tmp_path).name == "tuned.json"
