"""Kernel switches read from the environment (README "Kernel switches under test"): a typo is a
clear error naming the variable, never a silent other setting."""

from __future__ import annotations

import pytest

from tailored.kernels import env_int


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
