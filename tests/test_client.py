"""ApiaryClient and the CLI over it: error answers become :func:`apiary.errors.error_from_response`'s
classes and the CLI prints the server's message (httpx.MockTransport, no server); the transport
rules: no token over plain HTTP off loopback, failover across replicas, HTTPS verified against the
platform CA (a real uvicorn on loopback with a certificate of :mod:`apiary.pki`)."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from tests.support.polling import until
from typer.testing import CliRunner

from apiary import pki
from apiary.cli import main as cli
from apiary.client import ApiaryClient, check_token_transport, http_verify
from apiary.errors import (
    ConflictError,
    NotFoundError,
    PlaintextTokenError,
    PlatformError,
    TooManyRequestsError,
    UnavailableError,
    UserError,
    ValidationError,
)
from apiary.tracking.prefect_server import free_port


def answering(status: int, payload: dict | str) -> ApiaryClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(payload, str):
            return httpx.Response(status, text=payload)
        return httpx.Response(status, json=payload)

    return ApiaryClient("http://apiary.test", transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(("status", "payload", "cls"), [
    pytest.param(400, {"code": "InvalidParametersError", "message": "taskRoles: required", "field": "taskRoles"},
                 ValidationError, id="400"),
    pytest.param(404, {"code": "NoJobError", "message": "Job alice~x not found."}, NotFoundError, id="404"),
    pytest.param(409, {"code": "ConflictJobError", "message": "Job name x already exists for user alice."},
                 ConflictError, id="409"),
    pytest.param(429, {"code": "TooManyRequestsError", "message": "too many faults"}, TooManyRequestsError, id="429"),
    pytest.param(418, "teapot", UserError, id="418-text"),
    pytest.param(500, "Internal Server Error", PlatformError, id="500-text"),
    pytest.param(503, {"code": "UnavailableError", "message": "store down"}, UnavailableError, id="503"),
])
def test_error_answers_are_the_shared_classes_with_the_servers_message(status: int, payload, cls: type) -> None:
    with pytest.raises(cls) as caught:
        answering(status, payload).get("alice~x")
    message = payload if isinstance(payload, str) else payload["message"]
    assert type(caught.value) is cls and caught.value.status_code == status and caught.value.message == message


def test_unreachable_server_is_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(UnavailableError):
        ApiaryClient("http://apiary.test", transport=httpx.MockTransport(refuse)).nodes()


@pytest.mark.parametrize(("status", "message"), [(404, "Job alice~x not found."), (409, "Job name x exists."),
                                                 (503, "store down")])
def test_cli_prints_the_servers_message_and_exits_1(monkeypatch: pytest.MonkeyPatch, status: int,
                                                    message: str) -> None:
    monkeypatch.setattr(cli, "_client", lambda: answering(status, {"code": "X", "message": message}))
    result = CliRunner().invoke(cli.app, ["job", "get", "alice~x"])
    assert result.exit_code == 1
    assert f"error ({status}): {message}" in " ".join(result.output.split())


def test_an_unhealthy_platform_answers_health_with_its_reason_and_cluster_id() -> None:
    """/healthz is 503 while the store cannot write: the CLI still learns which platform it is."""
    body = {"status": "unhealthy", "reason": "store cannot write", "clusterId": "c-1",
            "code": "UnavailableError", "message": "store cannot write"}
    assert answering(503, body).health() == body
    assert answering(200, {"status": "ok", "clusterId": "c-1"}).health()["status"] == "ok"
    with pytest.raises(UnavailableError):
        answering(503, {"code": "UnavailableError", "message": "starting"}).health()


# ---------------------------------------------------------------------- transport: TLS, tokens, replicas


def test_a_token_over_plain_http_to_loopback_is_allowed() -> None:
    for url in ("http://127.0.0.1:8080", "http://127.3.4.5:1", "http://localhost:9", "http://[::1]:8080"):
        check_token_transport(url, "secret")
        ApiaryClient(url, token="secret").close()


def test_a_token_over_plain_http_to_another_host_is_refused_naming_the_settings() -> None:
    with pytest.raises(PlaintextTokenError) as caught:
        ApiaryClient("http://198.18.0.1:8080", token="s3cret-token")
    message = caught.value.message
    assert "APIARY_API_URL" in message and "https://" in message and "APIARY_CA_CERT" in message
    assert "http://198.18.0.1:8080" in message and "s3cret-token" not in message
    assert caught.value.status_code == 400 and caught.value.url == "http://198.18.0.1:8080"
    # one plain replica among several is enough to refuse; as_token checks the new token too
    with pytest.raises(PlaintextTokenError):
        ApiaryClient("https://198.18.0.2:8080,http://198.18.0.3:8080", token="t")
    anonymous = ApiaryClient("http://198.18.0.1:8080")  # no token: plain HTTP is allowed
    with pytest.raises(PlaintextTokenError):
        anonymous.as_token("t")
    check_token_transport("http://198.18.0.1:8080", None)
    check_token_transport("https://198.18.0.1:8080", "t")


def test_bad_api_urls_name_the_setting() -> None:
    for bad in ("", " , ", "ftp://x", "198.18.0.1:8080"):
        with pytest.raises(ValidationError) as caught:
            ApiaryClient(bad)
        assert caught.value.field == "APIARY_API_URL"


def replicas(answers: dict[str, object]) -> tuple[httpx.MockTransport, list[str]]:
    """A transport where each host answers per ``answers``: an exception class is raised (a dead
    replica), an int is the status of a JSON answer; ``calls`` lists the hosts called."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        answer = answers[request.url.host]
        if isinstance(answer, type):
            raise answer("down", request=request)
        assert isinstance(answer, int)
        return httpx.Response(answer, json={"code": "X", "message": f"from {request.url.host}"})

    return httpx.MockTransport(handler), calls


def test_a_dead_first_replica_fails_over_to_the_next_which_the_client_keeps() -> None:
    transport, calls = replicas({"cp-1": httpx.ConnectError, "cp-2": 200})
    client = ApiaryClient("https://cp-1:8443, https://cp-2:8443/", transport=transport, token="t")
    assert client.api_url == "https://cp-1:8443"
    assert client.nodes() == {"code": "X", "message": "from cp-2"}
    assert client.api_url == "https://cp-2:8443" and calls == ["cp-1", "cp-2"]
    client.submit("name: x")
    assert calls == ["cp-1", "cp-2", "cp-2"]  # sticks to the replica that answered
    assert client.as_token("u").api_url == "https://cp-2:8443"


def test_all_replicas_dead_is_unavailable_naming_each() -> None:
    transport, calls = replicas({"cp-1": httpx.ConnectError, "cp-2": httpx.ConnectTimeout})
    with pytest.raises(UnavailableError) as caught:
        ApiaryClient("https://cp-1,https://cp-2", transport=transport).health()
    assert "https://cp-1" in caught.value.message and "https://cp-2" in caught.value.message
    assert calls == ["cp-1", "cp-2"]


def test_error_answers_are_not_retried_on_another_replica() -> None:
    transport, calls = replicas({"cp-1": 503, "cp-2": 200})
    with pytest.raises(UnavailableError, match="from cp-1"):
        ApiaryClient("https://cp-1,https://cp-2", transport=transport).nodes()
    assert calls == ["cp-1"]


def test_a_write_that_failed_in_transit_is_not_resent_but_a_read_is() -> None:
    """A POST whose connection broke after it was sent may have been committed: not sent twice."""
    transport, calls = replicas({"cp-1": httpx.ReadTimeout, "cp-2": 200})
    client = ApiaryClient("https://cp-1,https://cp-2", transport=transport)
    with pytest.raises(UnavailableError, match="ReadTimeout"):
        client.submit("name: x")
    assert calls == ["cp-1"]
    assert client.get("alice~x") == {"code": "X", "message": "from cp-2"}
    assert calls == ["cp-1", "cp-1", "cp-2"]


def test_http_verify_trusts_only_the_given_ca(tmp_path: Path) -> None:
    assert http_verify(None) is True
    context = http_verify(pki.init_ca(tmp_path))
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname and len(context.get_ca_certs()) == 1
    with pytest.raises(ValidationError) as caught:
        http_verify(tmp_path / "missing.crt")
    assert caught.value.field == "APIARY_CA_CERT"


@contextmanager
def serving_tls(cert: Path, key: Path) -> Iterator[str]:
    """``https://127.0.0.1:<port>`` while a tiny app answering ``GET /api/v2/nodes`` is served with
    ``cert`` there (uvicorn in a thread, with the platform's own TLS arguments)."""
    app = FastAPI()

    @app.get("/api/v2/nodes")
    def nodes() -> list[dict]:
        return [{"name": "worker-1"}]

    port = free_port()
    # timeout_graceful_shutdown: a TLS connection the client left open would hold the shutdown 10 s
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1,
                            **pki.server_ssl_kwargs(cert, key))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-tls-{port}", daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 30, f"the TLS test server on port {port}")
        yield f"https://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_https_verifies_against_the_platform_ca_and_refuses_another_cas_certificate(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    other_ca = pki.init_ca(tmp_path / "other-ca")
    cert, key = pki.issue(tmp_path / "ca", tmp_path / "certs", "cp-1", ["127.0.0.1", "localhost"])
    with serving_tls(cert, key) as url:
        client = ApiaryClient(url, token="t", ca_cert=ca)
        assert client.nodes() == [{"name": "worker-1"}]
        client.close()
        with pytest.raises(UnavailableError) as caught:
            ApiaryClient(url, token="t", ca_cert=other_ca).nodes()
        message = caught.value.message
        assert "certificate verification failed" in message and str(other_ca) in message
        assert "APIARY_CA_CERT" in message
    # a certificate of the right CA but for another host is refused too (SANs are checked)
    cert2, key2 = pki.issue(tmp_path / "ca", tmp_path / "certs", "cp-2", ["198.18.0.9"])
    with serving_tls(cert2, key2) as url, pytest.raises(UnavailableError, match="certificate verification failed"):
        ApiaryClient(url, ca_cert=ca).nodes()


def test_the_cli_refuses_a_token_over_plain_http_naming_the_setting(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("APIARY_HOME", str(tmp_path))
    monkeypatch.setenv("APIARY_API_URL", "http://198.18.0.1:8080")
    monkeypatch.setenv("APIARY_TOKEN", "s3cret-token")
    result = CliRunner().invoke(cli.app, ["job", "list"])
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and "error (400)" in output
    assert "APIARY_API_URL" in output and "APIARY_CA_CERT" in output and "s3cret-token" not in output


def test_the_cli_verifies_against_apiary_ca_cert_and_fails_over(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    cert, key = pki.issue(tmp_path / "ca", tmp_path / "certs", "cp-1", ["127.0.0.1"])
    dead = f"https://127.0.0.1:{free_port()}"
    with serving_tls(cert, key) as url:
        monkeypatch.setenv("APIARY_HOME", str(tmp_path))
        monkeypatch.setenv("APIARY_API_URL", f"{dead},{url}")
        monkeypatch.setenv("APIARY_TOKEN", "t")
        monkeypatch.setenv("APIARY_CA_CERT", str(ca))
        result = CliRunner().invoke(cli.app, ["node", "list", "--json"])
        assert result.exit_code == 0, result.output
        assert "worker-1" in result.output


def test_an_in_process_fake_transport_may_carry_a_token_to_any_name() -> None:
    """httpx.MockTransport answers inside the process: nothing reaches a network to protect."""
    transport, calls = replicas({"apiary.test": 200})
    assert ApiaryClient("http://apiary.test", transport=transport, token="t").nodes()["message"] == "from apiary.test"
    with pytest.raises(PlaintextTokenError):
        ApiaryClient("http://apiary.test", transport=httpx.HTTPTransport(), token="t")


def test_bootstrap_token_calls_send_the_apis_shapes() -> None:
    seen: list[tuple[str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.content))
        return httpx.Response(200, json={"id": "abcdef"} if request.method != "GET" else [])

    client = ApiaryClient("http://127.0.0.1:1", transport=httpx.MockTransport(handler), token="admin")
    assert client.create_bootstrap_token(ttl_s=600, node="worker-1") == {"id": "abcdef"}
    assert client.bootstrap_tokens() == []
    assert client.revoke_bootstrap_token("abcdef") == {"id": "abcdef"}
    assert [(m, p) for m, p, _ in seen] == [("POST", "/api/v2/bootstrap-tokens"), ("GET", "/api/v2/bootstrap-tokens"),
                                            ("DELETE", "/api/v2/bootstrap-tokens/abcdef")]
    assert json.loads(seen[0][2]) == {"ttlSeconds": 600, "node": "worker-1", "description": ""}


def test_with_several_replicas_a_connection_waits_briefly_before_the_next() -> None:
    from apiary.client import FAILOVER_CONNECT_TIMEOUT_S

    single = ApiaryClient("https://cp-1", timeout=30)
    several = ApiaryClient("https://cp-1,https://cp-2", timeout=30)
    assert single._http.timeout.connect == 30 and single._http.timeout.read == 30
    assert several._http.timeout.connect == FAILOVER_CONNECT_TIMEOUT_S and several._http.timeout.read == 30
