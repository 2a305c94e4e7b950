"""``apiary node fault``: the GPU health fault kinds reach ``POST /api/v2/nodes/{node}/faults`` in the
API's names, flags only when given, and the API's 400 (a bad value) fails the command
(httpx.MockTransport, no server)."""

from __future__ import annotations

import io
import json

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from apiary.cli import main as cli
from apiary.client import ApiaryClient


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The fault bodies the CLI posts; a body with ``throttle: "cold"`` is answered 400, as the API does."""
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if body.get("throttle") == "cold":
            # the API's shape (apiary.errors.ValidationError.to_dict: the message names the field)
            return httpx.Response(400, json={"code": "InvalidParametersError", "field": "throttle",
                                             "message": "throttle: Input should be 'thermal' or 'power'"})
        return httpx.Response(200, json={"id": 1, "gpu": body["gpu"]})

    monkeypatch.setattr(cli, "_client", lambda: ApiaryClient("http://apiary.test",
                                                             transport=httpx.MockTransport(handler)))
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=120))
    return bodies


def given(body: dict) -> dict:
    return {k: v for k, v in body.items() if v not in (None, False)}


@pytest.mark.parametrize(("args", "expected"), [
    pytest.param(["--row-remap-failure"], {"rowRemapFailure": True}, id="row-remap-failure"),
    pytest.param(["--row-remap-pending", "--retired-pages", "2"], {"rowRemapPending": True, "retiredPages": 2},
                 id="pending-and-pages"),
    pytest.param(["--throttle", "power"], {"throttle": "power"}, id="throttle"),
    pytest.param(["--pcie-gen", "3", "--pcie-width", "8"], {"pcieGen": 3, "pcieWidth": 8}, id="pcie"),
])
def test_health_kinds_are_posted_in_the_api_s_names(sent: list[dict], args: list[str], expected: dict) -> None:
    result = CliRunner().invoke(cli.app, ["node", "fault", "hostname-dan", "--gpu", "1", *args])
    assert result.exit_code == 0, result.output
    (body,) = sent
    assert given(body) == {"gpu": 1, **expected}
    # a flag not given is not sent as false: it would unset a fault injected before
    assert "rowRemapFailure" not in body or body["rowRemapFailure"] is not False


def test_a_bad_value_is_the_api_s_400(sent: list[dict]) -> None:
    result = CliRunner().invoke(cli.app, ["node", "fault", "hostname-dan", "--gpu", "0", "--throttle", "cold"])
    assert result.exit_code != 0
    assert len(sent) == 1
    assert "throttle: Input should be" in result.output
