"""Control-plane failover: kill -9 the leader, time until the next job is accepted and placed.

Method: an :class:`apiary.multihost.deployment.Deployment` (PostgreSQL on host ``db``, two
control-plane replicas on ``cp1``/``cp2``, one joined agent on ``n1``; network namespaces on this
machine, HTTPS everywhere, the default lease timings: 6 s lease, 4 s renew deadline, 1 s retry).
``kills`` times: find the leader (``/healthz`` role), kill -9 its process, then submit a 1-GPU job
through a client of both replicas every 0.1 s until one is accepted, and poll it until its task
has a node (placed by the new leader's scheduler). The figure is kill -> placed, seconds, on this
process's monotonic clock. The killed replica is then restarted (it comes back as a follower) and
the job left to finish before the next kill, so every probe finds the GPU free.

``python bench/failover.py [--kills N]`` prints the JSON; ``bench/run.py --only cluster`` records it
as ``cluster.failover_s``. Needs root (network namespaces), PostgreSQL and about 2-3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from apiary.client import Tenants  # noqa: E402
from apiary.demo.lab6 import job_text  # noqa: E402
from apiary.errors import ApiaryError  # noqa: E402
from apiary.multihost.deployment import Deployment  # noqa: E402

CLUSTER = REPO / "examples" / "multihost" / "hived-config-two-vcs.yaml"


def _until(pred, timeout_s: float, what: str, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} not within {timeout_s:g} s")


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def run(kills: int = 10) -> dict:
    """``{"failover_s": {"p50", "p99", "max", "n", "runs"}, "method": ...}`` over ``kills`` kills."""
    root = Path(tempfile.mkdtemp(prefix="apiary-bench-failover-"))
    os.chmod(root, 0o711)
    d = Deployment(root=root, cluster=CLUSTER, nodes=["hostname-carol"], prefect=False, monitoring=False)
    runs: list[float] = []
    try:
        d.start()
        c = Tenants(d.client(timeout=10))
        _until(lambda: any(n["ready"] for n in c.nodes()), 60, "the node agent")
        for i in range(kills):
            leader = _until(d.leader, 30, "a leader")
            d.signal(f"control-plane@{leader}", signal.SIGKILL)
            t0 = time.monotonic()

            def submit(i: int = i) -> str | None:
                try:
                    return c.submit(job_text(5, 1, name=f"failover-{i}-{time.monotonic_ns()}"), user="alice")["id"]
                except ApiaryError:
                    return None

            job = _until(submit, 60, "a submission accepted")
            _until(lambda job=job: any(t.get("node") for t in c.get(job)["tasks"]), 60, "the job placed")
            runs.append(time.monotonic() - t0)
            d.components[f"control-plane@{leader}"].proc.wait(10)  # type: ignore[union-attr]
            d.restart(f"control-plane@{leader}")
            _until(lambda: len(_healthy(d)) == d.replicas, 60, "both replicas healthy")
            c.wait(job, timeout=120, poll_s=0.5)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "failover_s": {"p50": round(statistics.median(runs), 3), "p99": round(_percentile(runs, 99), 3),
                       "max": round(max(runs), 3), "n": len(runs), "runs": [round(x, 3) for x in runs]},
        "method": "kill -9 of the leading control-plane replica (of 2, PostgreSQL lease 6 s / 4 s / 1 s, hosts "
                  "as network namespaces on one 2-core machine) -> the next 1-GPU job accepted through a client "
                  "of both replicas and placed by the new leader; seconds, monotonic clock",
    }


def _health(d: Deployment) -> dict[str, dict]:
    import httpx

    from apiary.client import http_verify

    out = {}
    with httpx.Client(verify=http_verify(d.ca_cert), timeout=3) as http:
        for host, url in zip(d.replica_hosts, d.api_urls(by_address=True), strict=True):
            try:
                r = http.get(f"{url}/healthz")
                if r.status_code == 200:
                    out[host] = r.json()
            except httpx.HTTPError:
                continue
    return out


def _healthy(d: Deployment) -> list[str]:
    return list(_health(d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    print(json.dumps(run(ap.parse_args().kills), indent=2))


if __name__ == "__main__":
    main()
