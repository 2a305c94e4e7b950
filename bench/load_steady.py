"""Load benchmark (issue "Load, chaos and stress"): the ``steady`` load profile against a fresh
embedded platform.

:func:`measure_steady` starts an :class:`~apiary.embedded.Embedded` (``prefect=False``: the control
plane and the node agents, per-user rate limits lifted) on a generated 16-node x 8-GPU simulated
cluster (``lifecycle.start_platform``; 128 GPUs, so the 1-GPU ``sleep 1`` jobs run at once or queue
briefly), then runs :func:`apiary.load.runner.run_load` with profile ``steady``: 50 simulated people
(ML engineers and operators, Locust in a subprocess) for 90 s, judged by ``loadtests/gates/steady.yaml``.
The node-agent background is the platform's own 16 agents, which heartbeat, long-poll, launch every
job's task and report it; no simulated agents on top (they would double the heartbeats and turn each
into a store write: loadtests/README.md). It returns the numbers ``bench/run.py`` writes to the ``load``
section of ``bench/results.json``. Runs alone too: ``.venv/bin/python bench/load_steady.py [--quick]``
(prints, writes nothing).
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
for _p in (str(_BENCH.parent / "platform"), str(_BENCH)):  # run alone: python bench/load_steady.py
    if _p not in sys.path:
        sys.path.insert(0, _p)

from apiary.auth.bootstrap import read_token  # noqa: E402
from apiary.load.runner import LoadResult, run_load  # noqa: E402
from lifecycle import start_platform  # noqa: E402

logger = logging.getLogger("bench.load_steady")

NODES, GPUS_PER_NODE = 16, 8
USERS, DURATION_S = 50, 90.0
QUICK_USERS, QUICK_DURATION_S = 10, 30.0
SUBMIT = "POST /api/v2/jobs"


def summarize(r: LoadResult) -> dict:
    """The ``load`` section's numbers from one result."""
    agg = r.endpoint("Aggregated")
    submit = r.endpoint(SUBMIT)
    endpoints = {
        e.key: {"requests": e.requests, "failures": e.failures, "rps": round(e.rps, 2), "p50_ms": e.p50_ms,
                "p95_ms": e.p95_ms, "p99_ms": e.p99_ms, "max_ms": round(e.max_ms, 1) if e.max_ms else e.max_ms}
        for e in r.endpoints if e.key != "Aggregated"
    }
    return {
        "profile": r.profile,
        "users": r.users,
        "agents": r.agents,
        "duration_s": r.duration_s,
        "requests": agg.requests if agg else 0,
        "requests_per_s": round(agg.rps, 2) if agg else 0.0,
        "failures": agg.failures if agg else 0,
        "submit_per_s": round(submit.rps, 2) if submit else 0.0,
        "submit_p95_ms": submit.p95_ms if submit else None,
        "submit_p99_ms": submit.p99_ms if submit else None,
        "accepted": r.jobs.accepted,
        "listed": r.jobs.listed,
        "lost": len(r.jobs.lost),
        "gates_passed": r.passed,
        "gates_failed": [f"{x.endpoint} {x.metric} {x.measured} (threshold {x.threshold})"
                         for x in r.rows if not x.passed],
        "endpoints": endpoints,
        "wall_s": round(r.wall_s, 1),
    }


def measure_steady(users: int = USERS, duration_s: float = DURATION_S, *, nodes: int = NODES,
                   gpus_per_node: int = GPUS_PER_NODE, out_dir: Path | None = None,
                   figures: Path | None = None) -> dict:
    """One steady run on a fresh platform (always stopped); the ``load`` section's numbers.
    ``out_dir``: keep Locust's output and the plots there (default: a temporary folder, deleted).
    ``figures``: copy the run's latency and throughput plots there as ``load_steady_<name>.png``."""
    plat = start_platform(nodes, gpus_per_node, prefect=False)
    out = out_dir or Path(tempfile.mkdtemp(prefix="apiary-bench-load-"))
    try:
        logger.info("load: platform up in %.1f s; steady, %d people, %g s", plat.startup_s, users, duration_s)
        token = read_token(plat.emb.home / "token") or ""
        r = run_load(plat.emb.api_url, token, profile="steady", users=users, duration_s=duration_s, out_dir=out)
        d = summarize(r)
        d["nodes"], d["gpus_per_node"] = nodes, gpus_per_node
        if figures is not None:
            figures.mkdir(parents=True, exist_ok=True)
            for plot in r.plots:
                shutil.copyfile(plot, figures / f"load_steady_{plot.name}")
            d["figures"] = sorted(f"bench/plots/load_steady_{plot.name}" for plot in r.plots)
        return d
    finally:
        plat.close()
        if out_dir is None:
            shutil.rmtree(out, ignore_errors=True)


def method(section: dict) -> str:
    """One sentence per metric group in the ``load`` section, saying exactly what was measured."""
    if "submit_p99_ms" not in section:
        return ""
    return (
        f"Locust {section.get('users')} simulated people (ML engineers weight 9: submit a 1-GPU 'sleep 1' job "
        "with their own token, poll it, read its logs, list their jobs, 1-4 s apart; operators weight 1: node "
        "list and cluster status with the admin token, 2-5 s apart), no simulated node agents (the background is "
        "the platform's own agents: heartbeats, assignment long polls, every job's launch, run reports and log "
        "upload), profile 'steady' (all people spawned at users/10 per second, held for "
        f"{section.get('duration_s')} s), Locust headless in a subprocess (FastHttpUser) against an embedded "
        f"platform without Prefect on a generated {section.get('nodes')}-node x {section.get('gpus_per_node')}-GPU "
        "simulated cluster, per-user rate limits lifted, on the same machine. requests_per_s, failures, "
        "submit_p95_ms/submit_p99_ms and endpoints.*: Locust's own statistics of the whole run (JSON output: "
        "percentiles from its response-time histogram, client side, request to response read; requests/s over "
        "the run's span). accepted: 202 answers to POST /api/v2/jobs; listed: of those, the ones GET "
        "/api/v2/jobs?username=<user> listed right after the run; lost = accepted - listed. gates_passed: "
        "loadtests/gates/steady.yaml (every endpoint's thresholds and no lost job)."
    )


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_USERS} people for {QUICK_DURATION_S:g} s")
    ap.add_argument("--out", type=Path, help="keep Locust's output and the plots in this folder")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(json.dumps(measure_steady(*((QUICK_USERS, QUICK_DURATION_S) if args.quick else (USERS, DURATION_S)),
                                    out_dir=args.out), indent=2))
