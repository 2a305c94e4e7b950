"""What the end-to-end tests of monitoring need from the machine."""

from __future__ import annotations

import os

import pytest


def require_monitoring() -> None:
    """Skip without Debian's prometheus and prometheus-alertmanager; fail under CI=true (.ci/run
    installs them)."""
    from apiary.monitoring.stack import find_binaries

    if find_binaries() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but prometheus / prometheus-alertmanager are not installed")
        pytest.skip("apt-get install prometheus prometheus-alertmanager")
