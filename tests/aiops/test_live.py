"""The Prometheus reader and one scan, against a tiny HTTP server on 127.0.0.1 (no sleeps)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from apiary.aiops import AiopsConfig, Predictor, PrometheusSource, scan_once
from apiary.aiops.live import QUERY
from apiary.errors import UnavailableError


def vector(*series: tuple[dict[str, str], float]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": labels, "value": [1700000000.0, str(value)]} for labels, value in series]}}


class FakePrometheus:
    """Answers /api/v1/query with ``self.answer`` (status, body); records the queries."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, Any]] = (200, vector())
        self.queries: list[dict[str, list[str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                fake.queries.append(parse_qs(url.query))
                status, body = fake.answer if url.path == "/api/v1/query" else (404, {"status": "error"})
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()
    thread.join(timeout=10)


def gpu(name: str, host: str, index: int, value: float) -> tuple[dict[str, str], float]:
    return {"__name__": name, "Hostname": host, "gpu": str(index), "UUID": f"GPU-{host}-{index}"}, value


def test_frame_from_prometheus(prom: FakePrometheus) -> None:
    prom.answer = (200, vector(
        gpu("DCGM_FI_DEV_GPU_TEMP", "n1", 0, 71), gpu("DCGM_FI_DEV_GPU_TEMP", "n1", 1, 64),
        gpu("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "n1", 0, 5), gpu("apiary_gpu_xid_errors_total", "n1", 0, 2),
        ({"__name__": "apiary_task_gpu_utilization_ratio", "job": "u~j", "virtual_cluster": "vc-a",
          "Hostname": "n1", "gpu": "0"}, 0.5),
        ({"__name__": "apiary_task_gpu_utilization_ratio", "job": "u~j", "virtual_cluster": "vc-a",
          "Hostname": "n1", "gpu": "1"}, 0.7),
        ({"__name__": "apiary_job_waiting_seconds", "job": "a", "virtual_cluster": "vc-a"}, 120),
        ({"__name__": "apiary_job_waiting_seconds", "job": "b", "virtual_cluster": "vc-a"}, 900),
    ))
    frame = PrometheusSource(prom.url).frame(at=1700000000.0)
    assert prom.queries == [{"query": [QUERY], "time": ["1700000000.0"]}]
    n1 = frame.nodes["n1"]
    assert [(g.index, g.temp_c) for g in n1.gpus] == [(0, 71.0), (1, 64.0)]
    assert n1.gpus[0].sbe_total == 5.0 and n1.gpus[0].xid_events == 2.0 and n1.gpus[1].sbe_total is None
    assert [(j.job, round(j.util_pct, 6)) for j in frame.jobs] == [("u~j", 60.0)]
    assert frame.vc_delay_s == {"vc-a": 900.0}


@pytest.mark.parametrize("answer", [
    (400, {"status": "error", "errorType": "bad_data", "error": "parse error"}),
    (200, {"status": "success", "data": {"resultType": "matrix", "result": []}}),
], ids=["error", "not-a-vector"])
def test_prometheus_errors_are_unavailable(prom: FakePrometheus, answer: tuple[int, dict[str, Any]]) -> None:
    prom.answer = answer
    with pytest.raises(UnavailableError):
        PrometheusSource(prom.url).frame()


def test_unreachable_prometheus_is_unavailable() -> None:
    server = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()  # nothing listens there now
    with pytest.raises(UnavailableError):
        PrometheusSource(f"http://127.0.0.1:{port}", timeout_s=2).frame()


def test_scan_once_posts_one_event_per_finding(prom: FakePrometheus, config: AiopsConfig) -> None:
    pred = Predictor(config)
    now = [0.0]
    source = PrometheusSource(prom.url, clock=lambda: now[0])
    posted: list[dict[str, Any]] = []
    findings = []
    for k in range(20):
        now[0] = 1_700_000_000.0 + k * 300
        prom.answer = (200, vector(gpu("DCGM_FI_DEV_GPU_TEMP", "n1", 0, 95.0 if k == 15 else 70.0 + k % 2)))
        findings += scan_once(source, pred, posted.append)
    assert [f.rule for f in findings] == ["gpu-temperature"] and findings[0].t == 1_700_000_000.0 + 15 * 300
    assert [e["dedup_key"] for e in posted] == ["aiops:gpu-temperature:n1/gpu0"]


def test_scan_once_survives_a_failing_post(prom: FakePrometheus, config: AiopsConfig) -> None:
    def boom(event: dict[str, Any]) -> None:
        raise ConnectionError("incident endpoint down")

    pred = Predictor(config)
    source = PrometheusSource(prom.url)
    for k in range(12):
        prom.answer = (200, vector(gpu("DCGM_FI_DEV_GPU_TEMP", "n1", 0, 99.0 if k == 11 else 70.0 + k % 2)))
        findings = scan_once(source, pred, boom)
    assert [f.rule for f in findings] == ["gpu-temperature"]
