"""The one exception root of Apiary.

Every error Apiary raises on purpose derives from :class:`ApiaryError` and is either a
:class:`UserError` (the caller sent something wrong: HTTP 4xx, the message names the field)
or a :class:`PlatformError` (Apiary or its infrastructure failed: HTTP 5xx). HiveD draws the
same line at its web boundary ("User Error" vs "Platform Error").
"""

from __future__ import annotations


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


class NotFoundError(UserError):
    status_code = 404
    code = "NoJobError"


class ConflictError(UserError):
    status_code = 409
    code = "ConflictJobError"


class QuotaExceededError(UserError):
    """A gang job larger than its virtual cluster (OpenPAI rejects it at submission)."""

    code = "InvalidParametersError"


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
