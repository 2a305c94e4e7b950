"""Fixtures for the hosts harness: a root directory the postgres OS user can traverse, and the skip
(or, under CI=true, the failure) when this machine cannot make network namespaces."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from apiary.hosts.netns import netns_available


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture
def netns_root() -> Iterator[Path]:
    """A fresh directory for a harness (0711 under the system temp dir: pytest's own are 0700,
    which a server running as another OS user cannot traverse). Skips when this process cannot
    make network namespaces; under CI=true (root) that fails the test instead."""
    why = netns_available()
    if why is not None:
        if _in_ci():
            pytest.fail(f"CI=true but network namespaces are not available: {why}", pytrace=False)
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="apiary-hosts-test-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)

