"""A node's ``/metrics`` over HTTPS (:func:`apiary.runtime.agent.serve_node_metrics` with its serving
certificate): a scraper that trusts the platform CA reads it, one that trusts another CA or speaks
plain HTTP is refused, and the server keeps serving after each refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge

from apiary import pki
from apiary.client import http_verify
from apiary.errors import ValidationError
from apiary.runtime.agent import metrics_ssl_context, metrics_url, serve_node_metrics


def _node_cert(tmp: Path, ca_dir: Path, node: str, hosts: list[str]) -> tuple[Path, Path]:
    """As ``apiary agent join`` leaves them: node.key made on the node, node.crt signed from its CSR."""
    key_pem, csr_pem = pki.make_node_csr(node, hosts)
    cert, key = tmp / "node.crt", tmp / "node.key"
    pki.write_private(key, key_pem)
    pki.write_public(cert, pki.sign_csr(ca_dir / "ca.crt", ca_dir / "ca.key", csr_pem, node=node))
    return cert, key


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Any, Path, Path]]:
    ca = pki.init_ca(tmp_path / "ca")
    cert, key = _node_cert(tmp_path, tmp_path / "ca", "node-a", ["127.0.0.1"])
    registry = CollectorRegistry()
    Gauge("apiary_test_gpus", "GPUs of the test node", registry=registry).set(4)
    server = serve_node_metrics("node-a", registry, "127.0.0.1", 0, health=lambda: True,
                                tls=metrics_ssl_context(cert, key))
    try:
        yield server, ca, cert
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_and_healthz_over_https_verify_against_the_platform_ca(served: tuple[Any, Path, Path],
                                                                       tmp_path: Path) -> None:
    server, ca, _ = served
    base = f"https://127.0.0.1:{server.server_port}"
    other = pki.init_ca(tmp_path / "other-ca")
    with httpx.Client(verify=http_verify(other), timeout=10) as stranger:  # trusts another CA: refused
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            stranger.get(f"{base}/metrics")
    with httpx.Client(timeout=10) as plain:  # plain HTTP gets no metrics
        with pytest.raises(httpx.TransportError):
            plain.get(f"http://127.0.0.1:{server.server_port}/metrics")
    with httpx.Client(verify=http_verify(ca), timeout=10) as scraper:  # and the server still serves
        r = scraper.get(f"{base}/metrics")
        assert r.status_code == 200 and "apiary_test_gpus 4.0" in r.text
        r = scraper.get(f"{base}/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_the_reported_url_is_https_at_a_name_the_certificate_holds(served: tuple[Any, Path, Path]) -> None:
    _, _, cert = served
    assert metrics_url("127.0.0.1", 9400, tls=True, cert=cert) == "https://127.0.0.1:9400/metrics"
    assert metrics_url("0.0.0.0", 9400, tls=True, cert=cert, node="node-a") == "https://127.0.0.1:9400/metrics"
    assert metrics_url("::1", 9400, tls=False) == "http://[::1]:9400/metrics"


def test_missing_or_mismatched_files_name_the_option(tmp_path: Path) -> None:
    pki.init_ca(tmp_path / "ca")
    cert, key = _node_cert(tmp_path, tmp_path / "ca", "node-a", ["127.0.0.1"])
    with pytest.raises(ValidationError) as e:
        metrics_ssl_context(tmp_path / "nope.crt", key)
    assert e.value.field == "metrics-cert"
    with pytest.raises(ValidationError) as e:
        metrics_ssl_context(cert, tmp_path / "nope.key")
    assert e.value.field == "metrics-key"
    other_key, _ = pki.make_node_csr("node-a", [])
    pki.write_private(tmp_path / "other.key", other_key)
    with pytest.raises(ValidationError) as e:
        metrics_ssl_context(cert, tmp_path / "other.key")
    assert e.value.field == "metrics-cert"


def test_run_agents_serves_metrics_over_https_and_reports_the_https_url(tmp_path: Path) -> None:
    """A real control plane (loopback HTTP) and ``run_agents(..., metrics_tls=...)``: the node's
    reported ``metricsUrl`` is https and a scraper trusting the CA reads it."""
    import asyncio
    import threading

    import uvicorn
    from tests.support.auth import Principals
    from tests.support.builders import LAB6
    from tests.support.polling import until

    from apiary.api import create_app
    from apiary.auth import Directory
    from apiary.client import ApiaryClient
    from apiary.control import ControlPlane
    from apiary.ops.alerts import ActionsConfig, AlertReceiver
    from apiary.runtime.agent import run_agents
    from apiary.spec.cluster import load_cluster_config
    from apiary.store import make_engine, migrate, session_factory
    from apiary.tracking.prefect_server import free_port

    node = "hostname-carol"
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    directory = Directory(plane.sessions)
    principals = Principals(directory, ["default", "vc1"])
    agent_token, admin = principals.agent(node), principals.admin()
    ca = pki.init_ca(tmp_path / "ca")
    tls = _node_cert(tmp_path, tmp_path / "ca", node, ["127.0.0.1"])
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), directory=directory)
    port = free_port()
    # A long poll the agent left is cut after 1 s, not waited for (uvicorn's graceful shutdown).
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=1))
    served = threading.Thread(target=server.run, daemon=True)
    served.start()
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: server.started, 30, "the test control plane")
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()

        async def agents() -> None:
            await run_agents(url, {node: 1}, tmp_path / "agents", simulated_gpus=True, stop=stop,
                             metrics_ports={node: 0}, tokens={node: agent_token}, self_fence=False,
                             metrics_tls=tls)

        thread = threading.Thread(target=loop.run_until_complete, args=(agents(),), daemon=True)
        thread.start()
        try:
            client = ApiaryClient(url, token=admin)

            def reported() -> str | None:
                return next((n.get("metricsUrl") for n in client.nodes() if n["name"] == node), None)

            until(reported, 60, "the agent's report of its metrics URL")
            metrics = reported()
            assert metrics is not None and metrics.startswith("https://127.0.0.1:") and metrics.endswith("/metrics")
            with httpx.Client(verify=http_verify(ca), timeout=10) as scraper:
                r = scraper.get(metrics)
            assert r.status_code == 200 and "apiary_" in r.text
            client.close()
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
    finally:
        server.should_exit = True
        served.join(10)
        engine.dispose()
