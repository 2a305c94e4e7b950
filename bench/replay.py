"""Trace replay: the Philly trace through the simulator (``apiary sim trace``) under each policy.

The simulator is run as a subprocess through its CLI (decoupled from its internals)::

    python -m apiary sim trace --trace philly.csv --machines philly_machines.csv \\
        --policy hived --policy quota --policy fifo --json OUT --plots bench/plots

and the per-policy objects of ``OUT`` are returned as they are (``jobs``, ``rejected``, ``wall_s``,
``queue_delay_s`` / ``jct_s`` ``{mean, p50, p95, p99}``, ``gpu_utilization``, ``preemptions``,
``sharing_anomaly_s``, ...). Nothing is computed here; if the CLI is missing or fails, or its JSON
has no object for a policy, :func:`run_replay` raises (the runner reports the benchmark as not run).

The trace files live in the shared folder: ``$APIARY_SHARED/traces`` when ``APIARY_SHARED`` is set,
else ``<checkout>/../shared/traces`` (``/work/shared/traces`` on the dev box, next to the checkout
in CI).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("bench.replay")

REPO_ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("hived", "quota", "fifo")
TRACE = "philly.csv"
MACHINES = "philly_machines.csv"
QUICK_JOBS = 2000


def traces_dir() -> Path:
    env = os.environ.get("APIARY_SHARED")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "shared"
    return base / "traces"


def head_csv(src: Path, dst: Path, rows: int) -> int:
    """Copy the header and the first ``rows`` data rows (file order) of ``src`` to ``dst``."""
    n = 0
    with src.open(newline="") as f, dst.open("w", newline="") as g:
        g.write(f.readline())
        for line in f:
            if n >= rows:
                break
            g.write(line)
            n += 1
    return n


def _python_env() -> dict[str, str]:
    env = dict(os.environ)
    plat = str(REPO_ROOT / "platform")
    env["PYTHONPATH"] = plat + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def check_cli(timeout_s: float = 120.0) -> None:
    """Raise RuntimeError unless ``python -m apiary sim trace --help`` works."""
    cmd = [sys.executable, "-m", "apiary", "sim", "trace", "--help"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=_python_env(), capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr).strip()[-800:]
        raise RuntimeError(f"the simulator CLI is not available ({' '.join(cmd[1:])} exited {p.returncode}):\n{tail}")


def policy_objects(data: object, policies: tuple[str, ...]) -> dict[str, dict]:
    """The per-policy result objects of the simulator's JSON: ``{policy: {...}}`` at the top, under
    ``policies`` / ``results``, or a list of objects with a ``policy`` field."""
    candidates: list[object] = [data]
    if isinstance(data, dict):
        candidates += [data.get(k) for k in ("policies", "results", "runs")]
    for c in candidates:
        if isinstance(c, list):
            c = {o.get("policy"): o for o in c if isinstance(o, dict)}
        if isinstance(c, dict) and all(isinstance(c.get(p), dict) for p in policies):
            return {p: c[p] for p in policies}
    keys = list(data)[:20] if isinstance(data, dict) else type(data).__name__
    raise RuntimeError(f"simulator JSON has no object for each of {', '.join(policies)} (top level: {keys})")


@dataclass
class ReplayResult:
    policies: dict[str, dict] = field(default_factory=dict)
    jobs_in_trace: int | None = None  # rows fed to the simulator (None = the whole file)
    trace: str = ""
    machines: str = ""
    command: str = ""
    elapsed_s: float = 0.0  # the whole subprocess, all policies, including start-up and plots


def run_replay(
    *,
    quick: bool = False,
    policies: tuple[str, ...] = POLICIES,
    plots: Path | None = None,
    timeout_s: float = 1200.0,
) -> ReplayResult:
    """Replay the Philly trace (``quick``: its first :data:`QUICK_JOBS` rows) under ``policies``
    with ``apiary sim trace``; bounded by ``timeout_s``. Plots go to ``plots`` (default
    ``bench/plots``; a temporary folder for ``quick``)."""
    tdir = traces_dir()
    trace, machines = tdir / TRACE, tdir / MACHINES
    for f in (trace, machines):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found (set APIARY_SHARED to the folder holding traces/)")
    check_cli()
    res = ReplayResult(trace=str(trace), machines=str(machines))
    with tempfile.TemporaryDirectory(prefix="apiary-replay-") as tmp:
        tmpd = Path(tmp)
        if quick:
            sub = tmpd / f"philly-first-{QUICK_JOBS}.csv"
            res.jobs_in_trace = head_csv(trace, sub, QUICK_JOBS)
            trace = sub
            if plots is None:
                plots = tmpd / "plots"
        if plots is None:
            plots = REPO_ROOT / "bench" / "plots"
        out = tmpd / "sim.json"
        cmd = [sys.executable, "-m", "apiary", "sim", "trace", "--trace", str(trace), "--machines", str(machines)]
        for p in policies:
            cmd += ["--policy", p]
        cmd += ["--json", str(out), "--plots", str(plots)]
        res.command = " ".join(["python", *cmd[1:]])
        logger.info("replay: %s", res.command)
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=REPO_ROOT, env=_python_env(), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"apiary sim trace did not finish within {timeout_s:.0f} s") from e
        res.elapsed_s = time.monotonic() - t0
        if p.returncode != 0:
            tail = (p.stdout + p.stderr).strip()[-2000:]
            raise RuntimeError(f"apiary sim trace exited {p.returncode}:\n{tail}")
        if not out.is_file():
            raise RuntimeError(f"apiary sim trace exited 0 but wrote no {out.name}")
        res.policies = policy_objects(json.loads(out.read_text()), policies)
    return res
