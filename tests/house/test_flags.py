"""The switch table (tailored/flags.py): parsed strictly once, recorded whole, documented.

A typo in a `TAILORED_*` name or value is a clear error naming the variable, never a silent
other setting: an A/B that measured the default is worse than one that did not run.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailored import flags
from tailored.flags import Flags

REPO = Path(__file__).resolve().parents[2]


def test_every_switch_is_declared_once_with_its_why():
    names = [f.metadata["env"] for f in dataclasses.fields(Flags)]
    assert len(names) == len(set(names))
    for f in dataclasses.fields(Flags):
        m = f.metadata
        assert m["env"].startswith("TAILORED_") and m["why"], f.name
        assert f.type in ("bool", "int", "str"), f.name
        if f.type == "int":
            assert m["lo"] <= f.default <= m["hi"], f.name


def test_parse_defaults_values_and_errors():
    assert Flags.from_env({}) == Flags()
    got = Flags.from_env({"TAILORED_PDL": "0", "TAILORED_GDN_DV_SPLIT": " 4 ",
                          "TAILORED_TUNING": "off", "PATH": "/bin", "TAILORED_AUTOTUNE": ""})
    assert got.pdl is False and got.gdn_dv_split == 4 and got.tuning == "off"
    assert got.autotune is True  # empty = unset
    assert got.changed() == {"TAILORED_PDL": False, "TAILORED_GDN_DV_SPLIT": 4,
                             "TAILORED_TUNING": "off"}
    bad = [("TAILORED_PDL", "yes"), ("TAILORED_PDL", "2"), ("TAILORED_GDN_DV_SPLIT", "3"),
           ("TAILORED_GDN_DV_SPLIT", "32"), ("TAILORED_FP8_GEMV_UP_TO", "abc"),
           ("TAILORED_FP8_GEMV_UP_TO", "-1"), ("TAILORED_MOE_GROUPED_FROM", "3.5"),
           ("TAILORED_GDN_STATE_DTYPE", "float16")]
    for name, raw in bad:
        with pytest.raises(ValueError, match=name):
            Flags.from_env({name: raw})
    with pytest.raises(ValueError, match="did you mean TAILORED_PDL"):
        Flags.from_env({"TAILORED_PLD": "1"})
    with pytest.raises(ValueError, match="TAILORED_SHARED_IN_MOE_UP_TO"):
        Flags().replace(shared_in_moe_up_to=0)
    with pytest.raises(TypeError):
        Flags().replace(no_such_switch=1)


def test_snapshot_names_every_switch():
    snap = Flags().snapshot()
    assert set(snap) == {f.metadata["env"] for f in dataclasses.fields(Flags)}
    assert snap["TAILORED_COMBINE_NEXT_NORM"] is True


def test_override_and_the_fixture_restore_the_active_record(switches):
    before = flags.current()
    with flags.override(moe_gemv_up_to=0) as f:
        assert flags.current() is f and f.moe_gemv_up_to == 0
    assert flags.current() is before
    switches(pdl=False)
    assert flags.current().pdl is False and flags.current().combine_next_norm is True


def test_docs_switches_md_is_generated_from_the_table():
    """docs/switches.md is `python -m tailored.flags` (regenerate it when a switch changes)."""
    assert (REPO / "docs" / "switches.md").read_text() == flags.markdown()


def test_a_bad_switch_stops_the_server_before_anything_loads(tmp_path):
    """`tailored serve` parses the table first: exit 2, one line naming the variable, no
    weights read (the checkpoint path does not even exist)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILORED_")}
    env["TAILORED_CTX_GRAPHS"] = "yes"
    r = subprocess.run([sys.executable, "-m", "tailored", "serve", str(tmp_path / "none")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "TAILORED_CTX_GRAPHS" in r.stderr, r.stderr[-500:]


def test_build_stack_keeps_the_active_record_and_activates_a_given_one(tiny_ckpt, switches):
    """A test's (or the CLI's) record is what the stack builds with; an explicit one replaces
    it (the engine process receives the parent's this way)."""
    from tailored.stack import build_stack

    switches(proj_row_align=8)
    build_stack(tiny_ckpt, device="cpu", dtype="float32", kernels="off", progress=False,
                max_model_len=64, max_num_seqs=2)
    assert flags.current().proj_row_align == 8
    given = Flags(proj_row_align=16)
    build_stack(tiny_ckpt, device="cpu", dtype="float32", kernels="off", progress=False,
                max_model_len=64, max_num_seqs=2, switches=given)
    assert flags.current() is given


def test_set_in_env_names_only_switches_given_a_value():
    env = {"TAILORED_PDL": "0", "TAILORED_GDN_DV_SPLIT": "  ", "PATH": "/bin"}
    assert flags.set_in_env(env) == frozenset({"TAILORED_PDL"})


def test_sammie_table_keeps_its_own_active_record_with_the_same_machinery():
    """sammie/flags.py's current / activate are tailored's Active over sammie's table: the two
    records are apart, a record of the other table is refused, a secret shows as "(set)"."""
    from sammie import flags as sammie_flags

    before, ours = sammie_flags.current(), flags.current()
    try:
        got = sammie_flags.activate(sammie_flags.Flags(cache="/x", api_key="k"))
        assert sammie_flags.current() is got and flags.current() is ours
        assert got.snapshot() == {"SAMMIE_API_KEY": "(set)", "SAMMIE_CACHE": "/x"}
        with pytest.raises(TypeError, match="sammie.flags.Flags"):
            sammie_flags.activate(Flags())
    finally:
        sammie_flags.activate(before)
