"""The node exporter end to end: exposition parses, collectors are guarded, HTTP endpoints."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry
from tests.monitoring.fake_nvml import FakeGpu, FakeNvml
from tests.monitoring.helpers import parse, value

from apiary.monitoring import GuardedCollectors, NodeExporter, PlatformCollector, make_app, serve_metrics

TASKS = [
    {"job": f"u~j{i}", "user": "u", "virtual_cluster": "vc1", "task_role": "worker", "index": i,
     "pid": os.getpid(), "gpus": [i]}
    for i in range(8)
]


def test_simulated_node_exposition_parses():
    node = NodeExporter("sim-0", lambda: TASKS, gpus=8, simulated=True)
    node.inject(3, xid=79)
    s = parse(node.render().decode())
    assert len(s["DCGM_FI_DEV_GPU_UTIL"]) == 8
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", gpu="3", Hostname="sim-0") == 79
    assert len(s["apiary_task_gpu_utilization_ratio"]) == 8
    assert s["apiary_host_cpu_utilization_ratio"]
    for c in ("gpu", "host", "tasks"):
        assert value(s, "apiary_exporter_collector_up", collector=c, Hostname="sim-0") == 1
    assert node.faults() == {3: {"xid": 79}}
    node.clear(3)
    assert node.faults() == {}


def test_nvml_node_with_fake_nvml():
    """A fake NVML -- no GPU here."""
    node = NodeExporter("gpu-0", lambda: [], gpus=2, nvml=FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")]))
    s = parse(node.render().decode())
    assert value(s, "apiary_nvml_available", Hostname="gpu-0") == 1
    assert value(s, "apiary_node_gpu_count", Hostname="gpu-0") == 2
    try:
        node.inject(0, xid=79)
    except ValueError:
        pass
    else:
        raise AssertionError("real GPUs take no injected faults")


def test_cpu_only_node_has_no_gpu_collector():
    s = parse(NodeExporter("cpu-0", lambda: [], gpus=0).render().decode())
    assert "apiary_node_gpu_count" not in s and "apiary_nvml_available" not in s


class Broken:
    def collect(self):
        yield from ()
        raise RuntimeError("boom")


def test_failing_collector_does_not_fail_the_scrape():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GuardedCollectors({"broken": Broken(), "platform": PlatformCollector(lambda: {})}))
    from prometheus_client import generate_latest

    s = parse(generate_latest(registry).decode())
    assert value(s, "apiary_exporter_collector_up", collector="broken") == 0
    assert value(s, "apiary_exporter_collector_up", collector="platform") == 1
    assert "apiary_scheduling_cycle_seconds_count" in s


def test_serve_metrics_and_healthz():
    node = NodeExporter("sim-0", lambda: TASKS, gpus=8, simulated=True)
    healthy = [True]
    server, thread = serve_metrics(node.registry, "127.0.0.1", 0, health=lambda: (healthy[0], "agent stopped"))
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            assert len(parse(r.read().decode())["DCGM_FI_DEV_GPU_UTIL"]) == 8
        with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
        healthy[0] = False
        try:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            assert json.loads(exc.read()) == {"status": "unhealthy", "reason": "agent stopped"}
        else:
            raise AssertionError("expected 503")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_asgi_app():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    node = NodeExporter("sim-0", lambda: TASKS, gpus=8, simulated=True)
    with TestClient(make_app(node.registry)) as client:
        r = client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert len(parse(r.text)["DCGM_FI_DEV_GPU_UTIL"]) == 8
        assert client.get("/healthz").json() == {"status": "ok"}
        r = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")

    api = FastAPI()

    @api.get("/api/v1/ping")
    def ping():
        return {"pong": True}

    def boom():
        raise RuntimeError("db down")

    node.add_routes(api, health=boom)
    with TestClient(api) as client:
        assert client.get("/api/v1/ping").json() == {"pong": True}
        assert "DCGM_FI_DEV_GPU_UTIL" in client.get("/metrics").text
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["reason"] == "RuntimeError: db down"
