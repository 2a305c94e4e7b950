"""Smoke test of the API benchmarks: ``bench/run.py --quick --only api`` runs end to end on loopback
(submissions with tokens at an empty queue and behind a queue; the hostile corpus timed against a
live server) and writes well-formed numbers. No timing assertions: the targets
(bench/thresholds.yaml) are the benchmark's business, so exit code 1 (a target missed) is fine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_quick_api_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"lifecycle": {"kept": True}}))  # other benchmarks' sections survive
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--only", "api", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["lifecycle"] == {"kept": True}
    api = data["api"]
    for run in ("empty", "queued"):
        for key in ("per_s", "p50_ms", "p99_ms", "max_ms"):
            value = api[f"{run}_{key}"]
            assert isinstance(value, int | float) and value > 0, (run, key, value)
        assert api[f"{run}_max_ms"] >= api[f"{run}_p99_ms"] >= api[f"{run}_p50_ms"]
        assert api[f"{run}_submissions"] == 40
        assert api[f"{run}_accepted"] + api[f"{run}_errors"] == 40
        # every 202 is a durable job: all of them are listed afterwards
        assert api[f"{run}_listed"] == api[f"{run}_accepted"] and api[f"{run}_lost"] == 0
    assert api["empty_queue_before"] == 0
    assert api["queued_queue_before"] >= 50
    assert api["submit_per_s"] == min(api["empty_per_s"], api["queued_per_s"])
    assert api["submit_p99_ms"] == max(api["empty_p99_ms"], api["queued_p99_ms"])
    assert api["hostile_cases"] >= 46 and api["hostile_samples"] == api["hostile_cases"]
    assert api["hostile_max_ms"] >= api["hostile_p99_ms"] >= api["hostile_p50_ms"] > 0
    assert api["hostile_unexpected"] == 0
    assert api["quick"] is True
    assert api["measured_at"] and api["machine"]
    assert "submit_per_s" in api["method"] and "hostile_max_ms" in api["method"]
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout
