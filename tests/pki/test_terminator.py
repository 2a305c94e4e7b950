"""nginx terminating TLS in front of a plain-HTTP server on loopback (apiary.hosts.terminator):
a client verifying against the platform CA gets the upstream's answers, websockets included, and
the plain port is only on loopback."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
import websockets
from fastapi import FastAPI, Request, WebSocket
from tests.support.polling import until

from apiary import pki
from apiary.client import ApiaryClient, http_verify
from apiary.errors import PortInUseError, UnavailableError, ValidationError
from apiary.hosts.terminator import Terminator, TerminatorError, find_nginx
from apiary.tracking.prefect_server import free_port

pytestmark = pytest.mark.e2e


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(autouse=True)
def _nginx() -> None:
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        if _in_ci():
            pytest.fail("CI=true but nginx is not installed (.ci/run installs it)", pytrace=False)
        pytest.skip("apt-get install nginx")


def upstream_app() -> FastAPI:
    app = FastAPI()

    @app.get("/api/v2/nodes")
    def nodes(request: Request) -> list[dict]:
        return [{"name": "worker-1", "proto": request.headers.get("x-forwarded-proto"),
                 "host": request.headers.get("host")}]

    @app.websocket("/api/events/in")
    async def events_in(ws: WebSocket) -> None:
        await ws.accept()
        async for text in ws.iter_text():
            await ws.send_text(f"echo {text}")

    return app


@contextmanager
def plain_upstream() -> Iterator[str]:
    """``http://127.0.0.1:<port>``: the upstream app served in plain HTTP on loopback only."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(upstream_app(), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 30, f"the plain upstream on port {port}")
        assert {s.getsockname()[0] for srv in server.servers for s in srv.sockets} == {"127.0.0.1"}
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def certs(tmp_path: Path) -> tuple[Path, Path, Path]:
    ca = pki.init_ca(tmp_path / "ca")
    cert, key = pki.issue(tmp_path / "ca", tmp_path / "certs", "prefect", ["127.0.0.1", "localhost"])
    return ca, cert, key


def test_nginx_terminates_tls_for_a_plain_upstream(tmp_path: Path, certs: tuple[Path, Path, Path]) -> None:
    ca, cert, key = certs
    with plain_upstream() as upstream, \
            Terminator("127.0.0.1", free_port(), upstream, cert, key, tmp_path / "nginx") as t:
        assert t.url.startswith("https://127.0.0.1:")
        client = ApiaryClient(t.url, token="t", ca_cert=ca)
        nodes = client.nodes()
        client.close()
        assert nodes == [{"name": "worker-1", "proto": "https", "host": t.url.removeprefix("https://")}]
        # websockets pass through (Prefect's /api/events/in and /api/logs/out are websockets)
        context = http_verify(ca)
        assert isinstance(context, ssl.SSLContext)

        async def echo() -> str:
            async with websockets.connect(t.url.replace("https", "wss") + "/api/events/in", ssl=context) as ws:
                await ws.send("hello")
                return str(await asyncio.wait_for(ws.recv(), 30))

        assert asyncio.run(echo()) == "echo hello"
        # a client pinning another CA is refused
        other = pki.init_ca(tmp_path / "other")
        with pytest.raises(UnavailableError, match="certificate verification failed"):
            ApiaryClient(t.url, ca_cert=other).nodes()
        # plain HTTP to the TLS port gets nginx's 400, not the upstream
        assert httpx.get(t.url.replace("https", "http") + "/api/v2/nodes").status_code == 400
        pid = t._process.pid if t._process else None
    assert not t.running and pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "proxy_read_timeout 300s" in (tmp_path / "nginx" / "nginx.conf").read_text()


def test_a_taken_port_is_port_in_use(tmp_path: Path, certs: tuple[Path, Path, Path]) -> None:
    _, cert, key = certs
    port = free_port()
    with Terminator("127.0.0.1", port, "http://127.0.0.1:9", cert, key, tmp_path / "a"), \
            pytest.raises(PortInUseError):
        Terminator("127.0.0.1", port, "http://127.0.0.1:9", cert, key, tmp_path / "b").start()


@pytest.mark.parametrize(("upstream", "field"), [
    ("http://198.18.0.1:4200", "upstream_url"), ("https://127.0.0.1:4200", "upstream_url"),
    ("http://127.0.0.1:4200/api", "upstream_url"), ("http://127.0.0.1", "upstream_url")],
    ids=["not-loopback", "https", "a-path", "no-port"])
def test_bad_upstreams_are_refused(tmp_path: Path, certs: tuple[Path, Path, Path], upstream: str,
                                   field: str) -> None:
    _, cert, key = certs
    with pytest.raises(ValidationError) as caught:
        Terminator("127.0.0.1", 8443, upstream, cert, key, tmp_path)
    assert caught.value.field == field


@pytest.mark.netns
def test_in_a_host_the_plain_port_is_reachable_only_through_the_terminator(tmp_path: Path) -> None:
    """On a host of the netns harness: nginx on the host's address, the plain upstream on the
    host's own loopback. From the operator (another machine on the bridge) the TLS port answers
    with the upstream's answer and the plain port refuses the connection."""
    from apiary.hosts.netns import Hosts, netns_available

    why = netns_available()
    if why is not None:
        if _in_ci():
            pytest.fail(f"CI=true but network namespaces are not available: {why}", pytrace=False)
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="apiary-terminator-test-"))
    os.chmod(root, 0o711)
    try:
        with Hosts(["prefect"], root) as hosts:
            address = hosts.address("prefect")
            ca = pki.init_ca(root / "ca")
            cert, key = pki.issue(root / "ca", hosts.state_dir("prefect") / "tls", "prefect", [address, "prefect"])
            plain_port = 4200
            site = hosts.state_dir("prefect") / "site"
            site.mkdir()
            (site / "hello.txt").write_text("hello from the plain upstream\n")
            hosts.run("prefect", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                                  str(site), str(plain_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            probe = f"import socket; socket.create_connection(('127.0.0.1', {plain_port}), 1)"
            until(lambda: hosts.exec("prefect", [sys.executable, "-c", probe]).returncode == 0,
                  30, "the plain upstream inside the host")
            with Terminator(address, 8443, f"http://127.0.0.1:{plain_port}", cert, key,
                            hosts.state_dir("prefect") / "nginx",
                            runner=lambda argv: hosts.run("prefect", argv)) as t:
                assert t._process is not None and t._process.pid in hosts.pids("prefect")
                r = httpx.get(f"https://{address}:8443/hello.txt", verify=http_verify(ca), timeout=30)
                assert r.status_code == 200 and r.text == "hello from the plain upstream\n"
                with pytest.raises(httpx.ConnectError):
                    httpx.get(f"http://{address}:{plain_port}/hello.txt", timeout=10)
                assert t.running
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_without_nginx_the_error_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_nginx().name == "nginx"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(TerminatorError, match="apt-get install nginx"):
        find_nginx()
