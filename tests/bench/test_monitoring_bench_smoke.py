"""Smoke test of the monitoring benchmarks: ``bench/run.py --quick --only monitoring`` runs end to end
on loopback (a node's /metrics scrape time; fault -> alert -> cordon through real Prometheus and
Alertmanager) and writes well-formed numbers. No timing assertions: the targets
(bench/thresholds.yaml) are the benchmark's business, so exit code 1 (a target missed) is fine.
Skipped when Debian's prometheus / prometheus-alertmanager are not installed, unless CI=true."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apiary.monitoring.stack import find_binaries

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def test_quick_monitoring_writes_results(tmp_path: Path) -> None:
    if find_binaries() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but prometheus / prometheus-alertmanager are not installed")
        pytest.skip("apt-get install prometheus prometheus-alertmanager")
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"lifecycle": {"kept": True}}))  # other benchmarks' sections survive
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--only", "monitoring", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["lifecycle"] == {"kept": True}
    mon = data["monitoring"]
    for key in (
        "scrape_ms_8gpu",
        "scrape_p95_ms",
        "scrape_max_ms",
        "render_ms_p50",
        "fault_to_cordon_s",
        "fault_to_cordon_max_s",
        "fault_to_cordon_min_s",
        "fault_to_firing_s",
    ):
        assert isinstance(mon[key], int | float) and mon[key] > 0, (key, mon.get(key))
    assert mon["scrape_samples"] == 50
    assert mon["scrape_bytes"] > 0
    assert mon["scrape_p95_ms"] >= mon["scrape_ms_8gpu"]
    assert mon["fault_to_cordon_samples"] == 2
    assert len(mon["fault_to_cordon_by_node_s"]) == 2
    assert mon["fault_to_cordon_max_s"] >= mon["fault_to_cordon_s"] >= mon["fault_to_cordon_min_s"]
    assert mon["fault_to_cordon_interval_s"] == 1
    assert mon["quick"] is True
    assert mon["measured_at"] and mon["machine"] and "fault_to_cordon_s" in mon["method"]
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout
