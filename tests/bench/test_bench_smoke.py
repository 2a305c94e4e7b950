"""Smoke test of the benchmark runner: ``bench/run.py --quick --only lifecycle.start_latency``
runs end to end on loopback and writes well-formed numbers. No timing assertions: the targets
(bench/thresholds.yaml) are the benchmark's business, so exit code 1 (a target missed) is fine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.prefect, pytest.mark.timeout(600)]


def test_quick_start_latency_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"scheduler": {"kept": True}}))  # other benchmarks' sections survive
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--quick",
            "--only",
            "lifecycle.start_latency",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["scheduler"] == {"kept": True}
    life = data["lifecycle"]
    for key in ("start_latency_p50_s", "start_latency_p99_s"):
        assert isinstance(life[key], float) and life[key] > 0, (key, life[key])
    assert life["start_latency_p99_s"] >= life["start_latency_p50_s"]
    assert life["start_latency_samples"] == 20
    assert life["quick"] is True
    assert life["measured_at"] and life["machine"] and life["method"]
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout
