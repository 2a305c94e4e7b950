"""Scrape-time benchmark: a node's ``/metrics`` with N simulated GPUs and N running tasks.

``python -m apiary.monitoring.bench [--gpus 8] [--scrapes 200]`` starts N real task process groups
(``sh -c 'sleep & sleep; wait'``, like the process runtime's wrapper), serves the node's registry
with :func:`~apiary.monitoring.serve_metrics` and times ``GET /metrics`` over loopback (p50/p95/max),
plus the in-process render alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import time
import urllib.request

from apiary.monitoring.node import NodeExporter
from apiary.monitoring.server import serve_metrics


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=200)
    args = ap.parse_args()
    procs = [
        subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600; wait"], start_new_session=True)
        for _ in range(args.gpus)
    ]
    tasks = [
        {"job": f"bench~job{i}", "user": "bench", "virtual_cluster": "default", "task_role": "worker",
         "index": 0, "pid": p.pid, "gpus": [i]}
        for i, p in enumerate(procs)
    ]
    node = NodeExporter("bench-node", lambda: tasks, gpus=args.gpus, simulated=True)
    node.inject(0, xid=79, ecc_dbe=1)
    server, thread = serve_metrics(node.registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        time.sleep(0.2)
        for _ in range(5):  # warm-up
            urllib.request.urlopen(url).read()
        http, render = [], []
        size = 0
        for _ in range(args.scrapes):
            t = time.perf_counter()
            size = len(urllib.request.urlopen(url).read())
            http.append((time.perf_counter() - t) * 1000)
        for _ in range(args.scrapes):
            t = time.perf_counter()
            node.render()
            render.append((time.perf_counter() - t) * 1000)
        print(f"{args.gpus} simulated GPUs, {len(tasks)} running tasks, {size} bytes, {args.scrapes} scrapes")
        for name, xs in (("GET /metrics", http), ("render()", render)):
            p50, p95 = statistics.median(xs), _pct(xs, 0.95)
            print(f"{name:13s} p50 {p50:6.2f} ms  p95 {p95:6.2f} ms  max {max(xs):6.2f} ms")
    finally:
        server.shutdown()
        server.server_close()
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


if __name__ == "__main__":
    main()
