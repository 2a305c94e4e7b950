"""Monitoring benchmarks (the ``monitoring`` section of bench/results.json).

* :func:`measure_scrape`: a node agent's ``GET /metrics`` over loopback with N simulated GPUs and
  N running tasks. The tasks are real process groups (``sh -c 'sleep & sleep; wait'``, like the
  process runtime's wrapper), the node's :class:`~apiary.monitoring.node.NodeExporter` registry is
  served by :func:`~apiary.monitoring.server.serve_metrics` (what an agent serves), and every
  scrape is timed with ``perf_counter`` around a fresh ``urllib`` request; the in-process
  ``render()`` alone is timed too.
* :func:`measure_fault_to_cordon`: on an :class:`~apiary.embedded.Embedded` platform with real
  Prometheus and Alertmanager (Debian's binaries, deploy/'s configs, 1 s scrape and evaluation
  intervals), a double-bit ECC fault injected through the API into one node's simulated GPU ->
  ApiaryGpuEccDoubleBitError -> Alertmanager -> Apiary's webhook -> the ``cordon-node`` action ->
  the node shows ``cordoned: true`` in ``GET /api/v2/nodes``. One sample per node, one node at a
  time, on one platform.

Can be run alone: ``.venv/bin/python bench/monitoring.py [--quick]`` (prints, writes nothing).
Every wait is bounded; task processes and the platform are always stopped in ``finally``.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(REPO_ROOT / "platform"), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from apiary.monitoring.node import NodeExporter  # noqa: E402
from apiary.monitoring.server import serve_metrics  # noqa: E402
from apiary.monitoring.stack import find_binaries  # noqa: E402
from lifecycle import percentile  # noqa: E402  (bench/ is on sys.path above)

logger = logging.getLogger("bench.monitoring")

ALERT = "ApiaryGpuEccDoubleBitError"
# Only the cordon: the shipped default actions also email the admin, which needs an SMTP server.
ACTIONS_YAML = f"""\
rules:
  - match: {{alertname: {ALERT}}}
    actions: [cordon-node]
"""


class MonitoringUnavailable(RuntimeError):
    """Prometheus / Alertmanager are not installed or did not come up: no numbers, not fake ones."""


# ---------------------------------------------------------------------- scrape time
@dataclass
class ScrapeResult:
    gpus: int
    tasks: int
    bytes: int = 0
    http_ms: list[float] = field(default_factory=list)
    render_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "scrape_ms_8gpu" if self.gpus == 8 else f"scrape_ms_{self.gpus}gpu": round(
                statistics.median(self.http_ms), 3
            ),
            "scrape_p95_ms": round(percentile(self.http_ms, 95), 3),
            "scrape_max_ms": round(max(self.http_ms), 3),
            "scrape_samples": len(self.http_ms),
            "scrape_bytes": self.bytes,
            "scrape_gpus": self.gpus,
            "scrape_tasks": self.tasks,
            "render_ms_p50": round(statistics.median(self.render_ms), 3),
            "render_ms_p95": round(percentile(self.render_ms, 95), 3),
        }


def measure_scrape(gpus: int = 8, scrapes: int = 500, warmup: int = 5) -> ScrapeResult:
    """``scrapes`` timed ``GET /metrics`` of one node with ``gpus`` simulated GPUs, each busy with one
    running task (a real process group), one fault injected (GPU 0: XID 79, one DBE), after
    ``warmup`` untimed scrapes; then ``scrapes`` timed in-process ``render()`` calls."""
    res = ScrapeResult(gpus=gpus, tasks=gpus)
    procs: list[subprocess.Popen] = []
    server = None
    try:
        for _ in range(gpus):
            procs.append(subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600; wait"], start_new_session=True))
        tasks = [
            {
                "job": f"bench~job{i}",
                "user": "bench",
                "virtual_cluster": "default",
                "task_role": "worker",
                "index": 0,
                "pid": p.pid,
                "gpus": [i],
            }
            for i, p in enumerate(procs)
        ]
        node = NodeExporter("bench-node", lambda: tasks, gpus=gpus, simulated=True)
        node.inject(0, xid=79, ecc_dbe=1)
        server, _thread = serve_metrics(node.registry, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        time.sleep(0.2)  # the sleeps are running (each task's group has its two children)
        for _ in range(warmup):
            with urllib.request.urlopen(url, timeout=10) as r:
                r.read()
        for _ in range(scrapes):
            t = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read()
            res.http_ms.append((time.perf_counter() - t) * 1000)
            res.bytes = len(body)
        for _ in range(scrapes):
            t = time.perf_counter()
            node.render()
            res.render_ms.append((time.perf_counter() - t) * 1000)
        return res
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# ---------------------------------------------------------------------- fault -> cordon
@dataclass
class CordonResult:
    nodes: int
    interval_s: float
    samples: dict[str, float] = field(default_factory=dict)  # node -> fault POST .. cordoned seen (s)
    firing: dict[str, float] = field(default_factory=dict)  # node -> fault POST .. alert firing in Prometheus
    startup_s: float = 0.0
    targets_up_s: float = 0.0

    def to_dict(self) -> dict:
        xs = list(self.samples.values())
        out = {
            "fault_to_cordon_s": round(statistics.median(xs), 3),
            "fault_to_cordon_max_s": round(max(xs), 3),
            "fault_to_cordon_min_s": round(min(xs), 3),
            "fault_to_cordon_samples": len(xs),
            "fault_to_cordon_by_node_s": {n: round(v, 3) for n, v in self.samples.items()},
            "fault_to_cordon_interval_s": self.interval_s,
            "fault_to_cordon_nodes": self.nodes,
        }
        if self.firing:
            out["fault_to_firing_s"] = round(statistics.median(self.firing.values()), 3)
        return out


def _up_targets(prom: str) -> int:
    try:
        r = httpx.get(f"{prom}/api/v1/query", params={"query": "up == 1"}, timeout=2).json()
        return len(r["data"]["result"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def _firing_nodes(prom: str) -> set[str]:
    try:
        alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=2).json()["data"]["alerts"]
    except (httpx.HTTPError, KeyError, ValueError):
        return set()
    return {
        a["labels"].get("node", "") for a in alerts if a["labels"].get("alertname") == ALERT and a["state"] == "firing"
    }


def _until(pred, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(poll_s)


def measure_fault_to_cordon(
    samples: int = 4,
    *,
    nodes: int = 4,
    gpus_per_node: int = 8,
    interval_s: float = 1.0,
    poll_s: float = 0.1,
    per_sample_timeout_s: float = 60.0,
    ready_timeout_s: float = 90.0,
) -> CordonResult:
    """One Embedded (prefect=False, monitoring=True, ``monitoring_interval_s=interval_s``) on a
    generated ``nodes``-node cluster, actions config = cordon-node on ApiaryGpuEccDoubleBitError only.
    After every node agent is ready and Prometheus has every target up (the control plane and each
    node), for ``samples`` distinct nodes in turn: t0 = just before ``POST
    /api/v2/nodes/{node}/faults {"gpu": 0, "eccDbe": 1}``; then every ``poll_s`` ``GET
    /api/v2/nodes`` until the node shows ``cordoned: true`` (the sample) -- the same loop also
    notes when Prometheus first lists the node's alert as firing. Raises MonitoringUnavailable when
    the binaries are missing or Prometheus does not come up."""
    from apiary.embedded import Embedded
    from lifecycle import cluster_config

    if samples > nodes:
        raise ValueError(f"{samples} samples need as many nodes (got {nodes})")
    if find_binaries() is None:
        raise MonitoringUnavailable(
            "prometheus / prometheus-alertmanager are not installed (apt-get install prometheus "
            "prometheus-alertmanager): fault_to_cordon_s not measured"
        )
    res = CordonResult(nodes=nodes, interval_s=interval_s)
    with tempfile.TemporaryDirectory(prefix="apiary-bench-mon-") as tmp:
        root = Path(tmp)
        cfg = root / "cluster.yaml"
        cfg.write_text(cluster_config(nodes, gpus_per_node))
        actions = root / "actions.yaml"
        actions.write_text(ACTIONS_YAML)
        workdir = root / "work"
        workdir.mkdir()
        emb = Embedded(
            home=root / "home",
            cluster=cfg,
            prefect=False,
            monitoring=True,
            monitoring_interval_s=interval_s,
            workdir=str(workdir),
            env={"APIARY_ALERT_ACTIONS": str(actions)},
        )
        client = None
        t_start = time.monotonic()
        try:
            emb.start()
            emb.start_supervisor(period_s=0.2)
            if not emb.prometheus_url:
                raise MonitoringUnavailable("the platform started without Prometheus (see its log)")
            client = emb.client(timeout=30)  # the admin: faults are admin-only
            _until(
                lambda: sum(1 for n in client.nodes() if n.get("ready")) >= nodes,
                ready_timeout_s,
                f"{nodes} node agents ready",
            )
            res.startup_s = time.monotonic() - t_start
            prom = emb.prometheus_url
            try:
                _until(
                    lambda: _up_targets(prom) >= nodes + 1,
                    ready_timeout_s,
                    f"Prometheus scraping the control plane and {nodes} nodes",
                )
            except TimeoutError as e:
                raise MonitoringUnavailable(f"{e} (logs: {emb.home / 'logs'})") from e
            res.targets_up_s = time.monotonic() - t_start
            names = sorted(n["name"] for n in client.nodes())
            if any(n.get("cordoned") for n in client.nodes()):
                raise RuntimeError("a node is cordoned before any fault was injected")
            logger.info(
                "fault_to_cordon: platform up in %.1f s, %d targets up at %.1f s",
                res.startup_s,
                nodes + 1,
                res.targets_up_s,
            )
            for node in names[:samples]:
                t0 = time.monotonic()
                client._call("POST", f"/api/v2/nodes/{node}/faults", json={"gpu": 0, "eccDbe": 1})
                deadline = t0 + per_sample_timeout_s
                while True:
                    states = {n["name"]: n for n in client.nodes()}
                    now = time.monotonic()
                    if states[node].get("cordoned"):
                        res.samples[node] = now - t0
                        break
                    if node not in res.firing and node in _firing_nodes(prom):
                        res.firing[node] = time.monotonic() - t0
                    if now > deadline:
                        raise TimeoutError(
                            f"{node} not cordoned {per_sample_timeout_s:.0f} s after its fault "
                            f"(alert firing: {node in res.firing}; logs: {emb.home / 'logs'})"
                        )
                    time.sleep(poll_s)
                logger.info(
                    "fault_to_cordon: %s cordoned after %.2f s (firing after %s s)",
                    node,
                    res.samples[node],
                    None if node not in res.firing else round(res.firing[node], 2),
                )
            return res
        finally:
            if client is not None:
                client.close()
            emb.stop()


# ---------------------------------------------------------------------- method text
def method(section: dict) -> str:
    out = []
    if "scrape_ms_8gpu" in section:
        out.append(
            f"scrape_ms_8gpu / scrape_p95_ms / scrape_max_ms: median / 95th percentile (linear interpolation) / max "
            f"over {section.get('scrape_samples')} sequential GET /metrics requests (urllib, a new loopback "
            f"connection each, after 5 untimed ones) to one node's NodeExporter registry (8 simulated GPUs, GPU 0 "
            "with an injected XID 79 and one double-bit ECC error; GPU, host and task collectors) served by "
            "apiary.monitoring.serve_metrics in the benchmark process, with 8 running tasks, one per GPU, each a "
            "real process group 'sh -c \"sleep 600 & sleep 600; wait\"'; time = perf_counter around request and "
            "full body read. render_ms_p50/p95: NodeExporter.render() alone, in process, same count."
        )
    if "fault_to_cordon_s" in section:
        out.append(
            f"fault_to_cordon_s / fault_to_cordon_max_s: median / max over {section.get('fault_to_cordon_samples')} "
            "samples, each on a different node, one at a time, of one embedded platform (prefect=False, "
            f"monitoring=True: Debian's prometheus and prometheus-alertmanager with deploy/'s configs, scrape and "
            f"evaluation interval {section.get('fault_to_cordon_interval_s'):g} s, Alertmanager's shipped routing "
            f"incl. group_wait) on a generated {section.get('fault_to_cordon_nodes')}-node x 8-GPU simulated cluster, "
            "alert actions config = cordon-node on ApiaryGpuEccDoubleBitError only; after every node agent was "
            "ready and Prometheus had every target up: time from just before POST /api/v2/nodes/{node}/faults "
            "{gpu: 0, eccDbe: 1} to the first GET /api/v2/nodes poll (every 0.1 s) showing the node cordoned. "
            "fault_to_firing_s: median time from the same POST until Prometheus's /api/v1/alerts first listed "
            "the node's alert as firing (checked in the same poll loop)."
        )
    return " ".join(out)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    s = measure_scrape(scrapes=50 if args.quick else 500)
    print(s.to_dict())
    print(measure_fault_to_cordon(2 if args.quick else 4).to_dict())


if __name__ == "__main__":
    main()
