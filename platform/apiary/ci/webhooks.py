"""GitHub webhook deliveries: the signature, the body, and what a delivery asks for. Pure (no I/O, no clock).

GitHub signs each delivery with the webhook's secret: ``X-Hub-Signature-256: sha256=<hex>``, the
HMAC-SHA256 of the raw request body (docs.github.com, "Validating webhook deliveries"). The
signature covers the body only, not ``X-GitHub-Event`` nor ``X-GitHub-Delivery``, so a signed body
is checked against the event it is delivered as:

* :func:`parse_payload`: the body as a JSON object, nested at most :data:`MAX_JSON_DEPTH` levels
  (counted by a scan without recursion before ``json.loads`` runs);
* :func:`shape_mismatch`: a ``push``, ``pull_request`` or ``ping`` body must have that event's
  top-level fields (:data:`EVENT_SHAPES`), so a signed pull-request body is never taken as a push;
* :func:`body_sha256`: the key a replayed body is recognised by, whatever its delivery id.

:func:`classify` turns an event name and its parsed payload into one of

* :class:`PipelineRequest` ``kind="pr"``: ``pull_request`` with action ``opened``, ``synchronize``,
  ``reopened`` or ``ready_for_review``;
* :class:`PipelineRequest` ``kind="deploy"``: ``push`` to the repository's default branch (not a
  branch deletion);
* :class:`Ping`: ``ping`` (GitHub sends it when the webhook is created);
* :class:`Ignored` with the reason: everything else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from apiary.spec import safeyaml

SIGNATURE_PREFIX = "sha256="
PR_ACTIONS = frozenset({"opened", "synchronize", "reopened", "ready_for_review"})
_ZERO_SHA = "0" * 40  # "after" of a push that deleted the ref

#: The deepest nesting of arrays and objects a delivery's body may have (the body itself is level 1).
#: GitHub's example payloads (``tests/data/github``, from ``@octokit/webhooks-examples``) nest at
#: most 5 levels (``pull_request.head.repo.owner``); 32 leaves six times that, and keeps
#: ``json.loads`` (recursive in CPython) far from the interpreter's recursion limit.
MAX_JSON_DEPTH = 32

#: The top-level fields (name -> JSON type) a body of each event Apiary acts on must have, from
#: GitHub's webhook payload schemas (docs.github.com "Webhook events and payloads"; the required
#: fields of ``@octokit/webhooks``' ``push``, ``pull_request`` and ``ping`` schemas). Every example
#: of these events in ``tests/data/github`` has them; no body of one of them has another's.
EVENT_SHAPES: Mapping[str, Mapping[str, str]] = {
    "push": {"ref": "string", "before": "string", "after": "string", "created": "boolean",
             "deleted": "boolean", "forced": "boolean", "commits": "array", "repository": "object",
             "pusher": "object"},
    "pull_request": {"action": "string", "number": "integer", "pull_request": "object", "repository": "object"},
    "ping": {"zen": "string", "hook_id": "integer", "hook": "object"},
}

class PayloadError(ValueError):
    """A signed body Apiary does not read as a payload; ``field`` names what is wrong (``body``),
    ``reason`` why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``body``'s arrays and objects nest: :func:`apiary.spec.safeyaml.json_depth` of its
    text (undecodable bytes replaced; :func:`parse_payload` refuses them after)."""
    return safeyaml.json_depth(body.decode("utf-8", "replace"), limit)


def parse_payload(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """``body`` (UTF-8 JSON, as GitHub sends with content type ``application/json``) as a dict.

    Raises :class:`PayloadError` (field ``body``) when it nests deeper than ``max_depth`` levels
    (checked before it is parsed), is not JSON, is not a JSON object, or holds a lone surrogate
    (``"\\ud800"``: valid JSON, but no UTF-8 text can store it)."""
    if json_depth(body, max_depth) > max_depth:
        raise PayloadError("body", f"JSON nested deeper than {max_depth} levels")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: not after the depth check, kept as a net
        raise PayloadError("body", f"not JSON (set the webhook's content type to application/json): {exc}") from exc
    if not isinstance(payload, dict):
        raise PayloadError("body", "not a JSON object")
    try:
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise PayloadError("body", "holds a lone surrogate escape (not UTF-8 text)") from None
    return payload


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def shape_mismatch(event: str, payload: Mapping[str, Any]) -> str | None:
    """None when ``payload`` has every top-level field :data:`EVENT_SHAPES` lists for ``event``
    with its type (and for an event not listed: Apiary acts on none, they are recorded as ignored);
    else which fields are missing or of another type, e.g. ``"ref (string), commits (array)"``."""
    shape = EVENT_SHAPES.get(event)
    if shape is None:
        return None
    wrong = [f"{name} ({kind})" for name, kind in shape.items() if _json_type(payload.get(name)) != kind]
    return ", ".join(wrong) or None


def body_sha256(body: bytes) -> str:
    """The SHA-256 (64 lowercase hex digits) of a delivery's raw body: what the signature covers,
    so the key a replay of the body under another delivery id is recognised by."""
    return hashlib.sha256(body).hexdigest()


def sign(secret: bytes, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value GitHub sends for ``body`` (``sha256=<hex>``)."""
    return SIGNATURE_PREFIX + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify_signature(secret: bytes, body: bytes, header: str | None) -> bool:
    """Whether ``header`` is GitHub's signature of ``body`` with ``secret``; constant-time compare.

    False for a missing header, one without the ``sha256=`` prefix, or an empty secret (an intake
    without a secret accepts nothing)."""
    if not secret or not header or not header.startswith(SIGNATURE_PREFIX):
        return False
    return hmac.compare_digest(sign(secret, body).encode("ascii"), header.encode("utf-8", "replace"))


@dataclass(frozen=True)
class PipelineRequest:
    """A delivery that asks for a pipeline: ``kind`` ``pr`` (test a pull request) or ``deploy``
    (a push to the default branch). ``pr_number`` is None for a deploy; ``sha`` is the commit to
    build (the PR's head, the push's ``after``); ``ref`` the branch (PR head ref, or the pushed
    branch without ``refs/heads/``); ``base_ref`` the PR's base branch (the default branch for a deploy)."""

    kind: Literal["pr", "deploy"]
    repo: str
    clone_url: str
    sha: str
    ref: str
    base_ref: str
    default_branch: str
    action: str | None
    sender: str
    pr_number: int | None = None

    def parameters(self) -> dict[str, Any]:
        """The flow run's parameters (JSON-ready)."""
        return asdict(self)


@dataclass(frozen=True)
class Ping:
    """GitHub's ``ping``: the webhook exists. ``repo`` is None for an organization's hook."""

    repo: str | None
    hook_id: int | None
    kind: Literal["ping"] = "ping"


@dataclass(frozen=True)
class Ignored:
    """A delivery that starts nothing, and why."""

    reason: str
    repo: str | None = None
    action: str | None = None
    kind: Literal["ignored"] = "ignored"


Classified = PipelineRequest | Ping | Ignored


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _repo(payload: dict[str, Any]) -> dict[str, Any]:
    return _dict(payload.get("repository"))


def classify(event: str, payload: dict[str, Any]) -> Classified:
    """What the ``event`` delivery (``X-GitHub-Event``) with ``payload`` asks for; never raises on
    a payload of an unexpected shape (it is :class:`Ignored`, naming what was missing)."""
    repo = _repo(payload)
    repo_name = _str(repo.get("full_name")) or None
    sender = _str(_dict(payload.get("sender")).get("login"))
    action = _str(payload.get("action")) or None
    default_branch = _str(repo.get("default_branch"))
    if event == "ping":
        hook_id = payload.get("hook_id")
        return Ping(repo=repo_name, hook_id=hook_id if isinstance(hook_id, int) else None)
    if event == "pull_request":
        if action not in PR_ACTIONS:
            return Ignored(f"pull_request action {action!r} starts nothing", repo_name, action)
        pr = _dict(payload.get("pull_request"))
        head, base = _dict(pr.get("head")), _dict(pr.get("base"))
        number = payload.get("number", pr.get("number"))
        sha = _str(head.get("sha"))
        if not (repo_name and isinstance(number, int) and sha):
            return Ignored("pull_request without repository.full_name, number or pull_request.head.sha",
                           repo_name, action)
        return PipelineRequest(
            kind="pr", repo=repo_name, clone_url=_str(repo.get("clone_url")), sha=sha, ref=_str(head.get("ref")),
            base_ref=_str(base.get("ref")), default_branch=default_branch, action=action, sender=sender,
            pr_number=number,
        )
    if event == "push":
        ref = _str(payload.get("ref"))
        after = _str(payload.get("after"))
        if not (repo_name and default_branch):
            return Ignored("push without repository.full_name or repository.default_branch", repo_name)
        if ref != f"refs/heads/{default_branch}":
            return Ignored(f"push to {ref or 'no ref'}, not the default branch {default_branch}", repo_name)
        if payload.get("deleted") is True or not after or after == _ZERO_SHA:
            return Ignored(f"push deleting {ref}", repo_name)
        return PipelineRequest(
            kind="deploy", repo=repo_name, clone_url=_str(repo.get("clone_url")), sha=after, ref=default_branch,
            base_ref=default_branch, default_branch=default_branch, action=None, sender=sender,
        )
    return Ignored(f"event {event!r} starts nothing", repo_name, action)
