"""MLflow's ``authorization_function`` for an Apiary platform: Apiary's tokens, not MLflow's passwords.

This module runs inside the MLflow server's own virtualenv (``.venv-mlflow``), imported by
``mlflow server --app-name basic-auth`` through the ini's ``authorization_function =
apiary_mlflow_auth:authenticate``; :mod:`apiary.marketplace.mlflow_server` puts its directory on
the server's ``PYTHONPATH``. It imports only the standard library at import time, and flask,
werkzeug and mlflow inside the functions (never ``apiary``).

A request must carry ``Authorization: Bearer <token>`` (or ``Basic`` with the token as the
password, which a browser asks for the UI): an Apiary user's token, or a task's MLflow secret
(``MLFLOW_TRACKING_TOKEN``, :mod:`apiary.marketplace.identity`). The plugin asks the Apiary
control plane who that is (``GET $APIARY_API_URL/api/v2/mlflow/identity`` with the same header),
which answers ``{"user", "admin", "groups"}`` or 401/403. Answers are cached for
``APIARY_MLFLOW_AUTH_CACHE_S`` seconds (default 30), keyed by the token's SHA-256: a revoked token,
or the secret of a run that ended, keeps working for up to that long. Then the MLflow user of that
name is made to exist in MLflow's auth store (with a random password nobody knows, so basic auth
never logs in as it) and its admin flag follows Apiary's; the answer is werkzeug's
``Authorization`` naming that user, so MLflow's permission checks (``default_permission =
NO_PERMISSIONS``: a user reads what they created or were granted) apply to that user.

Refused: creating another user's experiment ``users/<name>`` (403: it is where that user's jobs log);
no token (401 with a ``Basic`` challenge, so a browser asks), a token Apiary does not know
(401), a user named like the MLflow admin of the ini (403), and a request while Apiary does not
answer (503, not cached).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import secrets
import threading
import time
import urllib.error
import urllib.request
from typing import Any

#: The route of the Apiary API that says who a bearer token is.
IDENTITY_PATH = "/api/v2/mlflow/identity"

_lock = threading.Lock()
#: sha256(token) -> (expires at, monotonic seconds; identity dict, or None for a refused token)
_cache: dict[str, tuple[float, dict | None]] = {}
#: MLflow users known to exist with that admin flag (a process-local memo of the auth store).
_users: dict[str, bool] = {}


class Unavailable(Exception):
    """Apiary's identity route did not answer (network, 5xx): the request gets a 503."""


def _cache_s() -> float:
    try:
        return max(0.0, float(os.environ.get("APIARY_MLFLOW_AUTH_CACHE_S", "30")))
    except ValueError:
        return 30.0


def fetch_identity(token: str, api_url: str | None = None, timeout_s: float = 10.0) -> dict | None:
    """Who ``token`` is, as Apiary's identity route answers: ``{"user": str, "admin": bool,
    "groups": [str]}``, or None when Apiary refuses it (401, 403). Raises :class:`Unavailable` when
    Apiary does not answer or answers another status. ``api_url``: default ``$APIARY_API_URL``."""
    base = (api_url or os.environ.get("APIARY_API_URL") or "").rstrip("/")
    if not base:
        raise Unavailable("APIARY_API_URL is not set")
    req = urllib.request.Request(base + IDENTITY_PATH, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            return None
        raise Unavailable(f"Apiary answered {e.code}") from e
    except (OSError, ValueError) as e:
        raise Unavailable(f"Apiary does not answer: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("user"), str) or not doc["user"]:
        raise Unavailable("Apiary's identity answer has no user")
    return {"user": doc["user"], "admin": bool(doc.get("admin")), "groups": list(doc.get("groups") or [])}


def identity_of(token: str, now: float | None = None, fetch: Any = fetch_identity) -> dict | None:
    """:func:`fetch_identity` behind the cache (answers and refusals both, for ``_cache_s()``
    seconds; :class:`Unavailable` is not cached). ``now``: monotonic seconds (tests)."""
    key = hashlib.sha256(token.encode()).hexdigest()
    t = time.monotonic() if now is None else now
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] > t:
            return hit[1]
    who = fetch(token)
    with _lock:
        if len(_cache) > 10_000:
            _cache.clear()
        _cache[key] = (t + _cache_s(), who)
    return who


def ensure_user(name: str, admin: bool, store: Any = None) -> None:
    """Make MLflow user ``name`` exist in the auth store (random unusable password) with admin
    flag ``admin``. ``store``: MLflow's auth store (default ``mlflow.server.auth.store``).
    Safe against a concurrent creator."""
    if _users.get(name) == admin:
        return
    if store is None:  # MLflow's venv only
        store = importlib.import_module("mlflow.server.auth").store
    if not store.has_user(name):
        try:
            store.create_user(name, secrets.token_urlsafe(48), is_admin=admin)
        except Exception:  # another request created it first
            if not store.has_user(name):
                raise
    if bool(store.get_user(name).is_admin) != admin:
        store.update_user(name, is_admin=admin)
    _users[name] = admin


def token_of(header: str) -> str | None:
    """The token of an ``Authorization`` header: ``Bearer <token>``, or ``Basic`` whose password is
    the token (what a browser sends for the UI), else None."""
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic" and value:
        try:
            _, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return password or None
    return None


def _respond(status: int, message: str) -> Any:
    from flask import make_response  # noqa: PLC0415

    resp = make_response(message + "\n", status)
    if status == 401:  # Basic: a browser then asks (any user name, an Apiary token as the password)
        resp.headers["WWW-Authenticate"] = 'Basic realm="Apiary MLflow: any name, an Apiary token as the password"'
    return resp


def authenticate() -> Any:
    """MLflow's custom authorization function: werkzeug's ``Authorization`` naming the caller's
    MLflow user, or a flask ``Response`` (401, 403, 503) refusing the request."""
    from flask import g, request  # noqa: PLC0415
    from werkzeug.datastructures import Authorization  # noqa: PLC0415

    # MLflow calls this several times per request (the gate, admin checks, after-request grants).
    done = getattr(g, "apiary_authorization", None)
    if done is not None:
        return done
    token = token_of(request.headers.get("Authorization", ""))
    if not token:
        return _respond(401, "Apiary's MLflow needs Authorization: Bearer <an Apiary token or "
                             "MLFLOW_TRACKING_TOKEN> (or Basic with an Apiary token as the password)")
    try:
        who = identity_of(token)
    except Unavailable as e:
        return _respond(503, f"Apiary's identity service is unavailable: {e}")
    if who is None:
        return _respond(401, "Apiary does not know this token (expired, revoked, or a run that ended)")
    admin_name = os.environ.get("APIARY_MLFLOW_ADMIN_USER", "")
    if admin_name and who["user"] == admin_name:
        return _respond(403, "this user name is reserved for MLflow's own admin")
    squatted = squatting(request.method, request.path, request.get_json(silent=True), who)
    if squatted:
        return _respond(403, squatted)
    ensure_user(who["user"], who["admin"])
    g.apiary_authorization = Authorization("bearer", {"username": who["user"]})
    return g.apiary_authorization


def squatting(method: str, path: str, body: Any, who: dict) -> str | None:
    """Why creating this experiment is refused: ``users/<name>`` is the experiment of user
    ``<name>``'s jobs (``MLFLOW_EXPERIMENT_NAME``), so only that user (or an admin) may create it;
    None for any other request."""
    if method != "POST" or not path.endswith("/experiments/create") or not isinstance(body, dict):
        return None
    name = body.get("name")
    if isinstance(name, str) and name.startswith("users/") and name != f"users/{who['user']}" and not who["admin"]:
        return f"experiment {name} is reserved for user {name[len('users/'):]}'s jobs"
    return None
