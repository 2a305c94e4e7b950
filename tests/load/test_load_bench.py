"""Smoke test of the load benchmark: ``bench/run.py --quick --only load`` (10 people for 30 s against
an embedded platform) writes a well-formed ``load`` section. No timing assertions: the targets
(bench/thresholds.yaml) are the benchmark's business, so exit code 1 (a target missed) is fine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_quick_load_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"api": {"kept": True}}))  # other benchmarks' sections survive
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--only", "load", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["api"] == {"kept": True}
    load = data["load"]
    assert (load["users"], load["duration_s"], load["agents"], load["quick"]) == (10, 30.0, 0, True)
    assert load["requests"] > 0 and load["requests_per_s"] > 0
    assert load["accepted"] > 0 and load["listed"] + load["lost"] == load["accepted"]
    assert load["submit_p99_ms"] >= load["submit_p95_ms"] > 0
    submit = load["endpoints"]["POST /api/v2/jobs"]
    assert submit["p99_ms"] == load["submit_p99_ms"] and submit["requests"] >= load["accepted"]
    assert "GET /api/v2/jobs/[id]" in load["endpoints"]
    assert not any("/nodes/[node]/" in k for k in load["endpoints"])  # no simulated agents: the real ones
    assert load["method"].startswith("Locust 10 simulated people") and load["measured_at"] and load["machine"]
    assert "load.submit_p99_ms" in proc.stdout and "load.lost" in proc.stdout
