"""Smoke test of the scheduler benchmark: ``bench/run.py --quick --only scheduler`` runs end to end
(pure algorithm, 200 nodes, 1,000 placements, a second or so) and writes well-formed numbers. No
timing assertions: the targets (bench/thresholds.yaml) are the benchmark's business, so exit code 1
(a target missed) is fine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_quick_scheduler_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"lifecycle": {"kept": True}}))  # other benchmarks' sections survive
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--only", "scheduler", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["lifecycle"] == {"kept": True}
    sched = data["scheduler"]
    assert sched["quick"] is True
    assert sched["measured_at"] and sched["machine"] and sched["method"]
    sizes = [k for k in sched if k.startswith("nodes_")]
    assert sizes == ["nodes_200"], sizes
    r = sched["nodes_200"]
    for key in ("placements_per_s", "p50_ms", "p99_ms", "max_ms", "build_s"):
        assert isinstance(r[key], int | float) and r[key] > 0, (key, r[key])
    assert r["samples"] == 1000
    assert r["attempts"] >= r["samples"]
    assert r["p99_ms"] >= r["p50_ms"]
    assert r["gc_max_pause_ms"] >= 0 and r["gc_full_collections"] >= 0
    assert 0.5 < r["utilization_mean"] < 1.0
    assert "scheduler nodes=200" in proc.stdout
