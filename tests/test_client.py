"""ApiaryClient and the CLI over it: error answers become :func:`apiary.errors.error_from_response`'s
classes and the CLI prints the server's message (httpx.MockTransport, no server)."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from apiary.cli import main as cli
from apiary.client import ApiaryClient
from apiary.errors import (
    ConflictError,
    NotFoundError,
    PlatformError,
    TooManyRequestsError,
    UnavailableError,
    UserError,
    ValidationError,
)


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
