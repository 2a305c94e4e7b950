"""The one exception root of Apiary.

Every error Apiary raises on purpose derives from :class:`ApiaryError` and is either a
:class:`UserError` (the caller sent something wrong: HTTP 4xx, the message names the field)
or a :class:`PlatformError` (Apiary or its infrastructure failed: HTTP 5xx). HiveD draws the
same line at its web boundary ("User Error" vs "Platform Error").

:func:`error_from_response` is the way back: every HTTP caller of Apiary (the CLI's client, the
Prefect bridge, the ``apiary-job`` flow) turns an error answer into one of these classes with it,
so they agree on what each status means. This module imports nothing outside the standard
library: pure modules (scheduler, spec, lifecycle) import it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any


class ApiaryError(Exception):
    """Root of all Apiary errors. ``status_code`` is the HTTP status the API answers with."""

    status_code: int = 500
    code: str = "ApiaryError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        """The OpenPAI-shaped error body: ``{"code": str, "message": str}``."""
        return {"code": self.code, "message": self.message}


class UserError(ApiaryError):
    """The request is wrong; retrying it unchanged fails again. HTTP 400."""

    status_code = 400
    code = "BadRequestError"


class ValidationError(UserError):
    """A job spec, cluster config or request body is malformed.

    ``field`` is the dotted path of the offending field (``taskRoles.train.resourcePerInstance.gpu``)
    and always appears in the message.
    """

    code = "InvalidParametersError"

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}" if field else reason)

    def to_dict(self) -> dict:
        """``{"code", "message", "field"}``: the error body plus the offending field's path ("" if none)."""
        return {**super().to_dict(), "field": self.field}


class NotFoundError(UserError):
    status_code = 404
    code = "NoJobError"


class ConflictError(UserError):
    status_code = 409
    code = "ConflictJobError"


class NoUserError(NotFoundError):
    """No user of that name (OpenPAI's ``NoUserError``), e.g. ``X-Apiary-On-Behalf-Of: nobody``. HTTP 404."""

    code = "NoUserError"


class NoGroupError(NotFoundError):
    """No group of that name (OpenPAI's ``NoGroupError``). HTTP 404."""

    code = "NoGroupError"


class NoTokenError(NotFoundError):
    """No token with that id, or none the caller may see. HTTP 404."""

    code = "NoTokenError"


class NoIncidentError(NotFoundError):
    """No incident with that id. HTTP 404."""

    code = "NoIncidentError"


class NoVirtualClusterError(NotFoundError):
    """No virtual cluster of that name in the cluster config (OpenPAI's ``NoVirtualClusterError``). HTTP 404."""

    code = "NoVirtualClusterError"


class NoStorageError(NotFoundError):
    """No storage server or config of that name, or a file or directory that is not in a config
    (OpenPAI's ``NoStorageError``). HTTP 404."""

    code = "NoStorageError"


class NoSshKeyError(NotFoundError):
    """No SSH public key of that title on the user's account. HTTP 404."""

    code = "NoSshKeyError"


class ConflictUserError(ConflictError):
    """A user or group of that name exists already (OpenPAI's ``ConflictUserError``). HTTP 409."""

    code = "ConflictUserError"


class LastAdminError(ConflictError):
    """The change would leave no admin (nobody could manage users, groups or tokens). HTTP 409."""

    code = "LastAdminError"


class ConflictFlowRunError(ConflictError):
    """The Prefect flow run is attached to another job already. HTTP 409."""

    code = "ConflictFlowRunError"


class UnauthorizedError(UserError):
    """No credential, or one Apiary does not accept (unknown, expired, revoked). HTTP 401, with
    ``WWW-Authenticate: Bearer`` (RFC 6750)."""

    status_code = 401
    code = "UnauthorizedUserError"


class ForbiddenError(UserError):
    """The caller is known but may not do this (another user's job, a VC no group grants, an
    admin-only route, another node's agent). HTTP 403."""

    status_code = 403
    code = "ForbiddenUserError"


class QuotaExceededError(UserError):
    """A gang job larger than its virtual cluster (OpenPAI rejects it at submission)."""

    code = "InvalidParametersError"


class TooManyRequestsError(UserError):
    """The caller sent too much (a queue or rate limit is full); retry later. HTTP 429.

    ``retry_after`` is how long to wait, in whole seconds (>= 1), where the limit knows it (a rate
    limit's window, :mod:`apiary.api.guards`); the API sends it as the ``Retry-After`` header
    (RFC 9110 section 10.2.3). None where unknown (a full queue): no header.
    """

    status_code = 429
    code = "TooManyRequestsError"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PayloadTooLargeError(UserError):
    """A request body over the API's size limit (``APIARY_MAX_BODY_BYTES``). HTTP 413.

    ``limit_bytes`` is the limit in bytes. The body is ``{"code", "message", "field": "body"}``,
    the shape of a :class:`ValidationError`'s, so clients read one shape for every rejected body.
    """

    status_code = 413
    code = "PayloadTooLarge"
    field = "body"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(f"request body larger than {limit_bytes} bytes (the limit, APIARY_MAX_BODY_BYTES)")

    def to_dict(self) -> dict:
        """``{"code": "PayloadTooLarge", "message": str, "field": "body"}``."""
        return {**super().to_dict(), "field": self.field}


class PortInUseError(UserError):
    """A port Apiary was told to listen on is taken (another platform on this machine?). HTTP 409."""

    status_code = 409
    code = "PortInUseError"

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        super().__init__(f"port {port} on {host} is in use (another Apiary platform?)")


class PlaintextTokenError(UserError):
    """A client was about to send a token over plain HTTP to a host that is not loopback; it
    refuses before connecting (:func:`apiary.client.check_token_transport`). HTTP 400-like: the
    configuration is wrong and retrying unchanged fails again. The message names the settings to
    change (``APIARY_API_URL`` to ``https://``, ``APIARY_CA_CERT``); ``url`` is the refused URL
    (scheme, host and port only)."""

    code = "PlaintextTokenError"

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class PlatformError(ApiaryError):
    """Apiary or a backend failed; the request may succeed later. HTTP 500."""

    status_code = 500
    code = "PlatformError"


class InvalidTransitionError(PlatformError):
    """A state change outside the transition table in :mod:`apiary.lifecycle.states`."""

    code = "InvalidTransitionError"


class UnavailableError(PlatformError):
    """A backend or peer is not reachable right now; retry later. HTTP 503."""

    status_code = 503
    code = "UnavailableError"


# A message ``"<field path>: <reason>"`` as ValidationError writes it; the path has no spaces
# (``taskRoles.train.resourcePerInstance.gpu``, ``virtualClusters.vc1.virtualCells[0]``).
_FIELD_MESSAGE = re.compile(r"^(?P<field>[A-Za-z_][\w.\[\]~-]*): ")


def _parse_body(body: str | bytes | Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any]]:
    """``(text, json object or {})`` of an answer's body; a body that is not a JSON object is text."""
    if body is None:
        return "", {}
    if isinstance(body, Mapping):
        return json.dumps(dict(body)), body
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text, {}
    return text, data if isinstance(data, Mapping) else {}


def error_from_response(
    status: int, body: str | bytes | Mapping[str, Any] | None, what: str | None = None
) -> ApiaryError:
    """The :class:`ApiaryError` for an HTTP error answer of Apiary's API (status >= 400).

    ``body`` is the answer's body (raw or parsed); Apiary's is ``{"code", "message"[, "field"]}``
    and anything else is taken as the message text. The error carries the server's message (or
    ``"<what>: HTTP <status>: <message>"`` when ``what`` names the call), ``status_code = status``
    and the server's ``code`` when it sent one:

    ======================  ====================================================================
    status                  error
    ======================  ====================================================================
    400, 422                :class:`ValidationError`; ``field`` from the body's ``field``, else
                            from a ``"field: reason"`` message, else ``""``
    401                     :class:`UnauthorizedError`
    403                     :class:`ForbiddenError`
    404                     :class:`NotFoundError`
    409                     :class:`ConflictError` (e.g. the job already exists)
    429                     :class:`TooManyRequestsError`
    503                     :class:`UnavailableError`
    other 5xx               :class:`PlatformError`
    other 4xx               :class:`UserError`
    ======================  ====================================================================

    Callers that retry treat every :class:`PlatformError` (all 5xx) as "try again later". Raises
    ValueError for a status below 400 (not an error answer).
    """
    if status < 400:
        raise ValueError(f"HTTP {status} is not an error answer")
    text, data = _parse_body(body)
    message = str(data.get("message") or text or f"HTTP {status}")
    err: ApiaryError
    if status in (400, 422):
        field = data.get("field")
        if not isinstance(field, str):
            match = _FIELD_MESSAGE.match(message)
            field = match["field"] if match else ""
        prefix = f"{field}: "
        err = ValidationError(field, message[len(prefix):] if field and message.startswith(prefix) else message)
        err.message = message  # the server's words, also where they do not start with the field
    elif status == 401:
        err = UnauthorizedError(message)
    elif status == 403:
        err = ForbiddenError(message)
    elif status == 404:
        err = NotFoundError(message)
    elif status == 409:
        err = ConflictError(message)
    elif status == 429:
        err = TooManyRequestsError(message)
    elif status == 503:
        err = UnavailableError(message)
    elif status >= 500:
        err = PlatformError(message)
    else:
        err = UserError(message)
    if what:
        err.message = f"{what}: HTTP {status}: {err.message}"
    err.args = (err.message,)
    err.status_code = status
    if isinstance(data.get("code"), str):
        err.code = data["code"]
    return err
