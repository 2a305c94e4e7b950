"""The shipped configs in a real Prometheus and Alertmanager on loopback (a few seconds).

Copies of deploy/prometheus and deploy/alertmanager run with only addresses and timings changed
(scrape/evaluation every second, Alertmanager group_wait 1s). Fake node agents and a fake control
plane serve fixed /metrics; a small HTTP server stands in for Apiary's alert webhook. Proven:

* the scrape relabeling: node-agent samples carry `node` (from `Hostname`), `up` carries `node`
  (from nodes.json, or from the target address), and Apiary's own `job` / `instance` labels
  survive scraping (honor_labels);
* the pipeline: a double-bit ECC error fires ApiaryGpuEccDoubleBitError (`for: 0s`) at once, and
  Alertmanager delivers it to the webhook with its labels and annotations;
* the inhibition: with ApiaryNodeDown firing for a node, that node's other alerts are
  suppressed, while the same alert for another node is delivered.

Skipped without the binaries, failed under CI=true (.ci/run installs them).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from tests.deploy.tools import ALERTMANAGER_DIR, PROMETHEUS_DIR, require_tool

# A real Prometheus and Alertmanager on loopback (not in `make test-fast`).
pytestmark = pytest.mark.prometheus

WAIT_S = 45.0

NODE0_METRICS = """\
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100",Hostname="worker-0"} 2
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",UUID="GPU-bbbb",device="nvidia1",modelName="NVIDIA A100",Hostname="worker-0"} 0
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100",Hostname="worker-0"} 40
# TYPE apiary_task_gpu_utilization_ratio gauge
"""
NODE0_METRICS += (
    'apiary_task_gpu_utilization_ratio{job="bert",user="alice",virtual_cluster="default",'
    'task_role="worker",index="0",gpu="1",Hostname="worker-0"} 0.5\n'
)
NODE1_METRICS = """\
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0",UUID="GPU-cccc",device="nvidia0",modelName="NVIDIA A100",Hostname="worker-1"} 0
# TYPE apiary_host_memory_used_ratio gauge
apiary_host_memory_used_ratio{Hostname="worker-1"} 0.25
"""


def _control_plane_metrics() -> str:
    now = time.time()
    return (
        "# TYPE apiary_job_waiting_seconds gauge\n"
        'apiary_job_waiting_seconds{job="resnet",user="bob",virtual_cluster="default"} 12\n'
        "# TYPE apiary_service_heartbeat_timestamp_seconds gauge\n"
        f'apiary_service_heartbeat_timestamp_seconds{{service="node-agent",instance="worker-0"}} {now}\n'
        "# TYPE apiary_scheduling_last_cycle_timestamp_seconds gauge\n"
        f"apiary_scheduling_last_cycle_timestamp_seconds {now}\n"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(get: Callable[[], str] | None = None, posts: list | None = None,
           auth: list | None = None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (get() if get else "").encode()
            self.send_response(200 if get else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if posts is not None:
                posts.append(json.loads(data))
            if auth is not None:
                auth.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _addr(server: ThreadingHTTPServer) -> str:
    return f"127.0.0.1:{server.server_address[1]}"


def _get_json(url: str) -> dict | list:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _wait_for(what: str, check: Callable[[], object], proc: list[subprocess.Popen], logs: list[Path]):
    deadline = time.monotonic() + WAIT_S
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        for p in proc:
            if p.poll() is not None:
                pytest.fail(f"{p.args[0]} exited with {p.returncode} while waiting for {what}:\n"
                            + "\n".join(f.read_text()[-3000:] for f in logs))
        try:
            got = check()
            if got:
                return got
        except Exception as e:  # servers still starting
            last_exc = e
        time.sleep(0.25)
    pytest.fail(f"timed out after {WAIT_S:.0f} s waiting for {what} (last error: {last_exc!r})\n"
                + "\n".join(f.read_text()[-3000:] for f in logs))


def _fast_routes(route: dict) -> None:
    # Not 0s: Alertmanager's inhibitor learns of new alerts asynchronously, so a group flushed the
    # instant its alert arrives can beat the inhibiting alert (real group_wait is 0s..30s).
    route["group_wait"] = "1s"
    route["group_interval"] = "1s"
    for child in route.get("routes", []):
        _fast_routes(child)


WEBHOOK_TOKEN = "apiary_0123456789ab_" + "x" * 43


class Stack:
    def __init__(self, prom_url: str, am_url: str, hook: list, procs: list, logs: list) -> None:
        self.prom_url, self.am_url, self.hook, self.procs, self.logs = prom_url, am_url, hook, procs, logs
        self.hook_auth: list[str | None] = []

    def wait(self, what: str, check: Callable[[], object]):
        return _wait_for(what, check, self.procs, self.logs)

    def query(self, q: str) -> list[dict]:
        url = f"{self.prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        return _get_json(url)["data"]["result"]

    def delivered(self) -> list[dict]:
        """Every alert the webhook received, newest last."""
        return [a for msg in list(self.hook) for a in msg["alerts"]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = require_tool("prometheus")
    alertmanager = require_tool("alertmanager")
    tmp = tmp_path_factory.mktemp("monitoring")
    servers = [
        node0 := _serve(lambda: NODE0_METRICS),
        node1 := _serve(lambda: NODE1_METRICS),
        cp := _serve(_control_plane_metrics),
    ]
    hook_posts: list = []
    hook_auth: list = []
    servers.append(hook := _serve(posts=hook_posts, auth=hook_auth))
    am_port, prom_port = _free_port(), _free_port()

    # Alertmanager: the shipped file with the webhook on our sink and no real SMTP server.
    am_cfg = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    am_cfg["global"]["smtp_smarthost"] = f"127.0.0.1:{_free_port()}"
    (tmp / "alertmanager.token").write_text(WEBHOOK_TOKEN + "\n")
    for r in am_cfg["receivers"]:
        for w in r.get("webhook_configs", []):
            w["url"] = f"http://{_addr(hook)}/api/v2/alerts/webhook"
            w["http_config"]["authorization"]["credentials_file"] = str(tmp / "alertmanager.token")
    _fast_routes(am_cfg["route"])
    (tmp / "am").mkdir()
    (tmp / "am" / "alertmanager.yml").write_text(yaml.safe_dump(am_cfg))

    # Prometheus: the shipped directory (rules, targets) with our addresses and 1 s intervals.
    prom_dir = tmp / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, prom_dir, ignore=shutil.ignore_patterns("tests", "README*"))
    cfg = yaml.safe_load((prom_dir / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{am_port}"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["apiary-control-plane"]["static_configs"][0]["targets"] = [_addr(cp)]
    jobs["apiary-node"]["file_sd_configs"][0]["refresh_interval"] = "1s"
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    # worker-0 is named in nodes.json; the second target is not (its `node` comes from the address).
    (prom_dir / "targets" / "nodes.json").write_text(json.dumps([
        {"targets": [_addr(node0)], "labels": {"node": "worker-0"}},
        {"targets": [_addr(node1)]},
    ]))

    logs = [tmp / "alertmanager.log", tmp / "prometheus.log"]
    procs: list[subprocess.Popen] = []
    try:
        with logs[0].open("w") as out:
            procs.append(subprocess.Popen(
                [alertmanager, f"--config.file={tmp / 'am' / 'alertmanager.yml'}", f"--storage.path={tmp / 'am'}",
                 f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                stdout=out, stderr=subprocess.STDOUT))
        with logs[1].open("w") as out:
            procs.append(subprocess.Popen(
                [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=out, stderr=subprocess.STDOUT))
        s = Stack(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", hook_posts, procs, logs)
        s.hook_auth = hook_auth
        s.wait("Alertmanager to be ready", lambda: urllib.request.urlopen(f"{s.am_url}/-/ready", timeout=2))
        s.wait("Prometheus to be ready", lambda: urllib.request.urlopen(f"{s.prom_url}/-/ready", timeout=2))
        yield s
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for srv in servers:
            srv.shutdown()
            srv.server_close()


def test_scrape_relabeling(stack: Stack) -> None:
    up = stack.wait("both node targets up",
                    lambda: (r := stack.query('up{job="apiary-node"} == 1')) and len(r) == 2 and r)
    assert {s["metric"]["node"] for s in up} == {"worker-0", "127.0.0.1"}

    temp = stack.wait("a DCGM sample", lambda: stack.query("DCGM_FI_DEV_GPU_TEMP"))
    assert temp[0]["metric"]["node"] == "worker-0"
    assert temp[0]["metric"]["job"] == "apiary-node"
    # Hostname beats the address-derived target label.
    mem = stack.wait("worker-1's host metric", lambda: stack.query("apiary_host_memory_used_ratio"))
    assert mem[0]["metric"]["node"] == "worker-1"

    task = stack.wait("a task sample", lambda: stack.query("apiary_task_gpu_utilization_ratio"))
    assert task[0]["metric"]["job"] == "bert", "honor_labels must keep the Apiary job name"
    hb = stack.wait("a heartbeat", lambda: stack.query("apiary_service_heartbeat_timestamp_seconds"))
    assert hb[0]["metric"]["instance"] == "worker-0" and hb[0]["metric"]["job"] == "apiary-control-plane"
    waiting = stack.wait("a waiting job", lambda: stack.query("apiary_job_waiting_seconds"))
    assert waiting[0]["metric"]["job"] == "resnet"


def test_ecc_alert_reaches_the_webhook(stack: Stack) -> None:
    def ecc():
        return [a for a in stack.delivered() if a["labels"]["alertname"] == "ApiaryGpuEccDoubleBitError"]

    (alert, *_) = stack.wait("ApiaryGpuEccDoubleBitError at the webhook", ecc)
    assert alert["status"] == "firing"
    assert alert["labels"]["severity"] == "fatal"
    assert alert["labels"]["node"] == "worker-0" and alert["labels"]["gpu"] == "0"
    assert alert["annotations"]["summary"] == "GPU 0 on node worker-0 has 2 double-bit ECC errors"
    assert alert["annotations"]["description"]
    # GPU 1 and worker-1 have no DBE errors; nothing else is firing on this healthy stack.
    assert {(a["labels"]["node"], a["labels"]["gpu"]) for a in ecc()} == {("worker-0", "0")}
    firing = stack.query("ALERTS{alertstate=\"firing\"}")
    assert {s["metric"]["alertname"] for s in firing} == {"ApiaryGpuEccDoubleBitError"}, firing
    # The shipped config sends the service token (Apiary answers 401 without it).
    assert set(stack.hook_auth) == {f"Bearer {WEBHOOK_TOKEN}"}


def test_node_down_inhibits_that_nodes_alerts(stack: Stack) -> None:
    starts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    alerts = [
        {"labels": {"alertname": "ApiaryNodeDown", "severity": "fatal", "node": "worker-9", "job": "apiary-node"}},
        {"labels": {"alertname": "ApiaryGpuTooHot", "severity": "warn", "node": "worker-9", "gpu": "1"}},
        {"labels": {"alertname": "ApiaryGpuTooHot", "severity": "warn", "node": "worker-8", "gpu": "1"}},
    ]
    for a in alerts:
        a["startsAt"] = starts
        a["annotations"] = {"summary": "test", "description": "test"}

    def post(batch: list[dict]) -> None:
        req = urllib.request.Request(f"{stack.am_url}/api/v2/alerts", data=json.dumps(batch).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=5).close()

    # The node-down alert first (as Prometheus would: the node is down before its alerts are sent).
    post(alerts[:1])
    stack.wait("ApiaryNodeDown in Alertmanager", lambda: _get_json(
        f"{stack.am_url}/api/v2/alerts?" + urllib.parse.urlencode({"filter": 'alertname="ApiaryNodeDown"'})))
    post(alerts[1:])

    def hot_states():
        got = _get_json(f"{stack.am_url}/api/v2/alerts?" + urllib.parse.urlencode(
            {"filter": 'alertname="ApiaryGpuTooHot"', "inhibited": "true", "active": "true"}))
        states = {a["labels"]["node"]: a["status"] for a in got}
        return states if {"worker-8", "worker-9"} <= set(states) and states["worker-9"]["state"] == "suppressed" \
            else None

    states = stack.wait("worker-9's ApiaryGpuTooHot to be inhibited", hot_states)
    assert states["worker-9"]["inhibitedBy"], states
    assert states["worker-8"]["state"] == "active", states

    def delivered_hot():
        return [a for a in stack.delivered() if a["labels"]["alertname"] == "ApiaryGpuTooHot"]

    stack.wait("worker-8's ApiaryGpuTooHot at the webhook", delivered_hot)
    stack.wait("ApiaryNodeDown at the webhook",
               lambda: [a for a in stack.delivered() if a["labels"]["alertname"] == "ApiaryNodeDown"])
    time.sleep(2)  # several group intervals
    assert {a["labels"]["node"] for a in delivered_hot()} == {"worker-8"}
