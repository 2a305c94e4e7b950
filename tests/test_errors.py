"""``apiary.errors.error_from_response``: the one HTTP status -> error mapping every caller shares."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import apiary.errors
from apiary.errors import (
    ApiaryError,
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PlatformError,
    TooManyRequestsError,
    UnauthorizedError,
    UnavailableError,
    UserError,
    ValidationError,
    error_from_response,
)


def body(message: str, code: str = "X", **extra) -> bytes:
    return json.dumps({"code": code, "message": message, **extra}).encode()


# (status, body, class, field or None when the class has none, message)
CASES = [
    pytest.param(400, body("taskRoles.train.gpu: must be >= 0", field="taskRoles.train.gpu"), ValidationError,
                 "taskRoles.train.gpu", "taskRoles.train.gpu: must be >= 0", id="400-field-key"),
    pytest.param(400, body("virtualClusters.vc1.virtualCells[0]: VC vc1 does not fit: 3 cells"), ValidationError,
                 "virtualClusters.vc1.virtualCells[0]", "virtualClusters.vc1.virtualCells[0]: VC vc1 does not fit: "
                 "3 cells", id="400-field-from-message"),
    pytest.param(400, body("Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default."), ValidationError, "",
                 "Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default.", id="400-no-field"),
    pytest.param(400, body("user: missing: send the header", field=""), ValidationError, "",
                 "user: missing: send the header", id="400-empty-field-key-wins"),
    pytest.param(422, body("agentId: Field required"), ValidationError, "agentId", "agentId: Field required",
                 id="422"),
    pytest.param(404, body("Job alice~x not found.", code="NoJobError"), NotFoundError, None,
                 "Job alice~x not found.", id="404"),
    pytest.param(409, body("Job name x already exists for user alice.", code="ConflictJobError"), ConflictError,
                 None, "Job name x already exists for user alice.", id="409-already-exists"),
    pytest.param(429, body("too many faults queued"), TooManyRequestsError, None, "too many faults queued",
                 id="429"),
    pytest.param(401, b"Unauthorized", UnauthorizedError, None, "Unauthorized", id="401-plain-text"),
    pytest.param(403, b"Forbidden", ForbiddenError, None, "Forbidden", id="403-plain-text"),
    pytest.param(503, body("db down"), UnavailableError, None, "db down", id="503"),
    pytest.param(500, b"Internal Server Error", PlatformError, None, "Internal Server Error", id="500-plain-text"),
    pytest.param(502, b"", PlatformError, None, "HTTP 502", id="502-empty-body"),
    pytest.param(504, b"[1, 2]", PlatformError, None, "[1, 2]", id="504-json-not-an-object"),
]


@pytest.mark.parametrize(("status", "raw", "cls", "field", "message"), CASES)
def test_status_maps_to_one_error_class(status: int, raw: bytes, cls: type, field: str | None, message: str) -> None:
    err = error_from_response(status, raw)
    assert type(err) is cls
    assert err.status_code == status and err.message == message and str(err) == message
    if field is not None:
        assert err.field == field
    for other in (raw.decode(), json.loads(raw) if raw.startswith(b"{") else raw.decode()):
        again = error_from_response(status, other)  # str and parsed bodies mean the same
        assert (type(again), again.message) == (cls, message)


@pytest.mark.parametrize(("status", "retry"), [(400, False), (404, False), (409, False), (429, False),
                                               (500, True), (502, True), (503, True), (599, True)])
def test_every_5xx_is_a_platform_error_to_retry(status: int, retry: bool) -> None:
    assert isinstance(error_from_response(status, ""), PlatformError) is retry
    assert isinstance(error_from_response(status, ""), UserError) is not retry


def test_what_prefixes_the_message_and_the_server_code_is_kept() -> None:
    err = error_from_response(409, body("Job name x exists.", code="ConflictJobError"), "submit")
    assert isinstance(err, ConflictError)
    assert err.message == "submit: HTTP 409: Job name x exists." and err.code == "ConflictJobError"
    err = error_from_response(400, body("gpu: bad", field="gpu"), "submit")
    assert (err.field, err.reason, err.message) == ("gpu", "bad", "submit: HTTP 400: gpu: bad")


def test_a_validation_error_survives_the_round_trip_through_its_body() -> None:
    sent = ValidationError("taskRoles.train.resourcePerInstance.gpu", "must be >= 0")
    assert sent.to_dict() == {"code": "InvalidParametersError", "message": sent.message, "field": sent.field}
    got = error_from_response(sent.status_code, sent.to_dict())
    assert isinstance(got, ValidationError) and got.to_dict() == sent.to_dict()
    assert set(NotFoundError("x").to_dict()) == {"code", "message"}


def test_not_an_error_answer_is_refused() -> None:
    with pytest.raises(ValueError):
        error_from_response(204, b"")
    assert issubclass(UserError, ApiaryError)


def test_errors_imports_only_the_standard_library() -> None:
    # Pure modules (scheduler, spec, lifecycle) import apiary.errors: no httpx, fastapi, pydantic here.
    tree = ast.parse(Path(apiary.errors.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "json", "re", "collections", "typing"}
