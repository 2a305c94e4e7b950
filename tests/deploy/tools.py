"""Paths of deploy/ and the Prometheus tools the deploy tests run.

The tools (``promtool``, ``prometheus``, ``amtool``, ``alertmanager``) come from the Debian
packages ``prometheus`` and ``prometheus-alertmanager``. Without them the tests that need them
skip locally, but FAIL under ``CI=true``: ``.ci/run`` installs them, and CI must never silently
skip the checks of the alert rules.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
ALERTMANAGER_DIR = DEPLOY / "alertmanager"
GRAFANA_DIR = DEPLOY / "grafana"

# Debian ships Alertmanager as prometheus-alertmanager; upstream tarballs call it alertmanager.
_TOOL_NAMES = {
    "promtool": ("promtool",),
    "prometheus": ("prometheus",),
    "amtool": ("amtool",),
    "alertmanager": ("prometheus-alertmanager", "alertmanager"),
}
_PACKAGE = {"promtool": "prometheus", "prometheus": "prometheus", "amtool": "prometheus-alertmanager",
            "alertmanager": "prometheus-alertmanager"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_tool(tool: str) -> str:
    """The path of ``tool``; skips the test without it, or fails it under CI=true."""
    for name in _TOOL_NAMES[tool]:
        path = shutil.which(name)
        if path:
            return path
    reason = (f"{tool} not found on PATH (install the Debian package {_PACKAGE[tool]}: "
              f"apt-get install {_PACKAGE[tool]}; .ci/run does this)")
    if in_ci():
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)
