"""The engine's named contracts (tailored/tune/invariants.py): docs/contracts.md is generated
from the table and the tests' markers, every marker names a contract, every contract is
checked by a test or says why not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailored.tune import invariants

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.contract("house-rules")
def test_docs_contracts_md_is_generated():
    """Regenerate with `python -m tailored.tune.invariants > docs/contracts.md`."""
    assert (REPO / "docs" / "contracts.md").read_text() == invariants.markdown()


def test_markers_name_known_contracts_and_each_contract_is_checked():
    marks = invariants.marked_tests()
    unknown = sorted(set(marks) - set(invariants.CONTRACTS))
    assert not unknown, f"markers name no contract of invariants.CONTRACTS: {unknown}"
    unchecked = [n for n, (_, _, _, why) in invariants.CONTRACTS.items()
                 if n not in marks and not why]
    assert not unchecked, f"contracts with neither a marked test nor a reason: {unchecked}"
    assert set(invariants.touched(list(invariants.TOUCHED_BY))) <= set(invariants.CONTRACTS)


def test_the_contract_option_selects_marked_tests(pytester=None):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--collect-only", "--contract", "house-rules", "tests/house"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    listed = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert r.returncode == 0 and listed
    assert all("test_layout.py" in ln or "test_contracts.py" in ln for ln in listed)
    assert not any("test_flags.py" in ln for ln in listed)
