"""The metric names the deploy configs use are the ones the exporters document.

``tests/deploy/promql.KNOWN_METRICS`` (what the rules and dashboards may use) must be listed in
``platform/apiary/monitoring/METRICS.md``, the exporters' own list.
"""

from __future__ import annotations

import re

import pytest
from tests.deploy.promql import KNOWN_METRICS, PROMETHEUS_METRICS
from tests.deploy.tools import REPO

METRICS_MD = REPO / "platform" / "apiary" / "monitoring" / "METRICS.md"


def test_known_metrics_are_documented_by_the_exporters() -> None:
    if not METRICS_MD.exists():
        pytest.skip(f"{METRICS_MD.relative_to(REPO)} not present")
    documented = set(re.findall(r"`([A-Za-z_:][A-Za-z0-9_:]*)`", METRICS_MD.read_text()))
    missing = []
    for name in sorted(KNOWN_METRICS - PROMETHEUS_METRICS):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in documented and base not in documented:
            missing.append(name)
    assert not missing, f"used by deploy/ but not in METRICS.md: {missing}"
