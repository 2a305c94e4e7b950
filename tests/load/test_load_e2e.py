"""``apiary load run`` end to end: an embedded platform (no Prefect) on Lab 6's two-VC cluster, the
smoke profile run by Locust in a subprocess through the CLI, judged by its gate file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.auth.bootstrap import read_token
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """``(api url, admin token)`` of a started platform; stopped after the module."""
    home = tmp_path_factory.mktemp("load-platform") / "home"
    emb = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=False, workdir=str(REPO_ROOT))
    try:
        emb.start()
        emb.start_supervisor(period_s=0.2)
        client = emb.client()
        until(lambda: nodes_ready(client, 2), 60, "node agents")
        client.close()
        yield emb.api_url, read_token(home / "token") or ""
    finally:
        emb.stop()


def load_run(url: str, token: str, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "220"}  # rich: one table row per line in a pipe
    return subprocess.run([sys.executable, "-m", "apiary", "load", "run", "--target", url, "--token", token, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)


def test_smoke_profile_passes_its_gates(platform: tuple[str, str], tmp_path: Path) -> None:
    url, token = platform
    out = tmp_path / "smoke"
    proc = load_run(url, token, "--profile", "smoke", "--users", "4", "--duration", "30", "--agents", "--out",
                    str(out))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "Load gates: smoke, 4 people, 2 node agents, 30 s: PASS" in proc.stdout
    for endpoint in ("POST /api/v2/jobs", "GET /api/v2/jobs/[id]", "POST /api/v2/nodes/[node]/status", "jobs"):
        assert endpoint in proc.stdout
    assert "PASS: every gate passed" in proc.stdout and "FAIL" not in proc.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["passed"] and result["jobs"]["lost"] == [] and result["jobs"]["accepted"] >= 4
    assert result["agents"] == 2 and {Path(p).name for p in result["plots"]} == {"latency.png", "throughput.png"}
    assert (out / "stats.json").exists() and (out / "locust_stats_history.csv").exists()
    assert not (out / "tokens.json").exists()  # the run's tokens are revoked and their file deleted


def test_an_impossible_gate_fails_the_run(platform: tuple[str, str], tmp_path: Path) -> None:
    url, token = platform
    gates = tmp_path / "impossible.yaml"
    gates.write_text(yaml.safe_dump({"endpoints": {"POST /api/v2/jobs": {"max_p99_ms": 0.001}},
                                     "jobs": {"max_lost": 0}}))
    proc = load_run(url, token, "--profile", "smoke", "--users", "2", "--duration", "10", "--gates", str(gates),
                    "--out", str(tmp_path / "out"), "--no-plots")
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "FAIL" in proc.stdout and "<= 0.001" in proc.stdout
    assert "1 gate(s) failed" in proc.stdout
