"""Opaque bearer tokens: ``apiary_<id>_<secret>``.

``id`` (12 hex characters) names the row; ``secret`` is 32 random bytes (``secrets.token_urlsafe``,
256 bits, so a fast digest is enough: there is nothing to brute-force, the reasoning of GitHub's and
Stripe's API tokens). The store keeps only ``sha256(secret)``; comparison is constant-time
(``hmac.compare_digest``). No hand-made crypto: the standard library's ``secrets``, ``hashlib``
and ``hmac``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

PREFIX = "apiary_"
_TOKEN = re.compile(r"^apiary_(?P<id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class Minted:
    """A new token: ``token`` is the only copy of the secret (shown once); ``id`` and ``digest`` go to the store."""

    id: str
    token: str
    digest: str


def digest(secret: str) -> str:
    """Hex SHA-256 of a token's secret part."""
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def mint() -> Minted:
    """A fresh random token."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return Minted(token_id, f"{PREFIX}{token_id}_{secret}", digest(secret))


def split(token: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed token, None for anything else (never raises)."""
    m = _TOKEN.match(token.strip())
    return (m["id"], m["secret"]) if m else None


def matches(secret: str, stored_digest: str) -> bool:
    """Whether ``secret`` hashes to ``stored_digest``, in constant time."""
    return hmac.compare_digest(digest(secret), stored_digest)
