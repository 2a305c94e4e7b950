"""Signed acknowledge / resolve links for notifications (PagerDuty's email "Acknowledge" button).

A link is ``{public_url}/api/v2/incidents/{id}/link/{action}?token=...``; the token is
itsdangerous' URL-safe timed signature (HMAC-SHA1 over the payload with a key derived from the
platform's secret: no hand-made crypto) of ``{"i": incident id, "a": action, "u": recipient}``.
Opening it shows a confirmation page (GET changes nothing: chat unfurlers and mail scanners
fetch links); its button POSTs the token back, and the action is recorded with actor
``<recipient> (signed link)``. A token is good for ``ttl_s`` seconds and only for its incident
and action.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer

from apiary.errors import ForbiddenError

ACTIONS = ("acknowledge", "resolve")
_SALT = "apiary-incident-link"


def load_secret(path: Path) -> str:
    """The signing secret kept in ``path`` (created with 32 random bytes, mode 0600, if missing)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path.read_text().strip()


class LinkSigner:
    """Makes and checks signed links. ``public_url``: how people reach the API (no trailing /)."""

    def __init__(self, secret: str, public_url: str, ttl_s: int = 7 * 86400) -> None:
        self._serializer = URLSafeTimedSerializer(secret, salt=_SALT)
        self.public_url = public_url.rstrip("/")
        self.ttl_s = ttl_s

    def url(self, incident_id: str, action: str, recipient: str) -> str:
        token = self._serializer.dumps({"i": str(incident_id), "a": action, "u": recipient})
        return f"{self.public_url}/api/v2/incidents/{incident_id}/link/{action}?token={token}"

    def verify(self, incident_id: str, action: str, token: str) -> str:
        """The recipient the token was made for. Raises ForbiddenError (403) for a bad, expired or
        mismatched token."""
        try:
            data = self._serializer.loads(token, max_age=self.ttl_s)
        except SignatureExpired as e:
            raise ForbiddenError("This link has expired; acknowledge with `apiary incident ack`.") from e
        except BadSignature as e:
            raise ForbiddenError("This link's signature is not valid.") from e
        if not isinstance(data, dict) or data.get("i") != str(incident_id) or data.get("a") != action:
            raise ForbiddenError("This link is for another incident or action.")
        return str(data.get("u") or "unknown")
