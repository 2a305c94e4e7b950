"""Test data: the committed samples under ``tests/data`` and the project's ``shared/`` folder.

``shared/`` sits beside the checkout, as in CI (``APIARY_SHARED`` overrides).  A test that needs a
file from it calls :func:`shared_file`: the test skips when the file is missing, except under
``CI=true``, where a missing file is a failure (CI has ``shared/``, and must never skip silently).
Tests that need only a few rows use a committed sample instead (``tests/data/``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
SHARED = Path(os.environ.get("APIARY_SHARED") or REPO.parent / "shared")

#: The first 2,000 jobs of shared/traces/philly.csv and the two Philly machine lists.
PHILLY_2K = DATA / "philly" / "philly-2k.csv"
PHILLY_MACHINES = DATA / "philly" / "philly_machines.csv"
PHILLY_MACHINES_REVISED = DATA / "philly" / "philly_machines_revised.csv"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def shared_file(relative: str) -> Path:
    """``shared/<relative>``; skips the test when it is missing, or fails it under CI=true."""
    path = SHARED / relative
    if not path.is_file():
        reason = f"{path} not present (shared/ sits beside the checkout; APIARY_SHARED overrides)"
        if in_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    return path
