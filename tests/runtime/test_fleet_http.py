"""The hollow fleet's aiohttp client answers as httpx does, so the node agent's code (failover on
transport errors, ``raise_for_status``, ``json()``) works unchanged over it."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from apiary.runtime.fleet_http import FleetClient


class Echo(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        if self.path.startswith("/slow"):
            time.sleep(3)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = 503 if self.path.startswith("/busy") else 200
        out = json.dumps({"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
                          "type": self.headers.get("Content-Type"), "body": body.decode()}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Apiary-Node-Lost-After-S", "40")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except OSError:  # the client gave up (the timeout test)
            pass

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def run(coro):
    return asyncio.run(coro)


def test_an_answer_is_an_httpx_response_with_the_request_as_sent(server: str) -> None:
    async def main():
        async with FleetClient() as c:
            post = await c.request("POST", f"{server}/api/v2/nodes/n1/status", json={"gpus": 8},
                                   headers={"Authorization": "Bearer t"}, timeout=5)
            get = await c.request("GET", f"{server}/a", params={"generation": 3, "wait": 10.0},
                                  timeout=httpx.Timeout(15, connect=2))
            raw = await c.request("POST", f"{server}/logs", content=b"\x00bytes",
                                  headers={"Content-Type": "application/octet-stream"}, timeout=5)
            return post, get, raw

    post, get, raw = run(main())
    assert isinstance(post, httpx.Response) and post.status_code == 200
    assert post.json() == {"method": "POST", "path": "/api/v2/nodes/n1/status", "auth": "Bearer t",
                           "type": "application/json", "body": '{"gpus": 8}'}
    assert post.headers["apiary-node-lost-after-s"] == "40"
    assert get.json()["path"] == "/a?generation=3&wait=10.0"
    assert raw.json()["body"] == "\x00bytes" and raw.json()["type"] == "application/octet-stream"


def test_an_error_answer_raises_as_httpx_does(server: str) -> None:
    async def main():
        async with FleetClient() as c:
            return await c.request("GET", f"{server}/busy", timeout=5)

    r = run(main())
    assert r.status_code == 503
    with pytest.raises(httpx.HTTPStatusError):
        r.raise_for_status()


def test_a_silent_server_is_a_read_timeout_and_a_closed_port_a_connect_error(server: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]

    async def main():
        async with FleetClient() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.request("GET", f"{server}/slow", timeout=0.5)
            with pytest.raises(httpx.ReadTimeout):
                await c.request("GET", f"{server}/slow", timeout=httpx.Timeout(0.5, connect=2))
            with pytest.raises(httpx.ConnectError):
                await c.request("GET", f"http://127.0.0.1:{closed}/", timeout=2)

    run(main())
    assert issubclass(httpx.ReadTimeout, httpx.TransportError)  # the agent fails over on these
    assert issubclass(httpx.ConnectError, httpx.TransportError)


def test_https_is_verified_against_the_given_ca(tmp_path: Path) -> None:
    from apiary import pki

    ca = pki.init_ca(tmp_path / "ca")
    pki.init_ca(tmp_path / "other")
    servers, urls = [], []
    for name, issuer in (("genuine", "ca"), ("impostor", "other")):
        cert, key = pki.issue(tmp_path / issuer, tmp_path / "certs", name, ["127.0.0.1"])
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)

        class Tls(ThreadingHTTPServer):
            daemon_threads = True

            def finish_request(self, request, client_address, ctx=ctx):
                request.settimeout(5)
                try:
                    conn = ctx.wrap_socket(request, server_side=True)
                except OSError:
                    return
                try:
                    super().finish_request(conn, client_address)
                finally:
                    self.shutdown_request(conn)

        srv = Tls(("127.0.0.1", 0), Echo)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        urls.append(f"https://127.0.0.1:{srv.server_address[1]}")

    async def main():
        async with FleetClient(verify=ssl.create_default_context(cafile=str(ca))) as c:
            ok = await c.request("GET", f"{urls[0]}/x", timeout=5)
            with pytest.raises(httpx.ConnectError):
                await c.request("GET", f"{urls[1]}/x", headers={"Authorization": "Bearer secret"}, timeout=5)
            return ok

    try:
        assert run(main()).json()["path"] == "/x"
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
