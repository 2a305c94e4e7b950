"""GitHub webhook deliveries: the signature and what a delivery asks for. Pure (no I/O, no clock).

GitHub signs each delivery with the webhook's secret: ``X-Hub-Signature-256: sha256=<hex>``, the
HMAC-SHA256 of the raw request body (docs.github.com, "Validating webhook deliveries").
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
from dataclasses import asdict, dataclass
from typing import Any, Literal

SIGNATURE_PREFIX = "sha256="
PR_ACTIONS = frozenset({"opened", "synchronize", "reopened", "ready_for_review"})
_ZERO_SHA = "0" * 40  # "after" of a push that deleted the ref


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
