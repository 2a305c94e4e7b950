"""Who an MLflow request is: the tasks' MLflow secrets and the identity the MLflow plugin asks for.

**A task's MLflow secret** (``MLFLOW_TRACKING_TOKEN`` in its environment, :class:`MlflowTaskEnv`)
is ``mlflow-task.<run id>.<HMAC-SHA256 of the run id under the MLflow key, 64 hex>``, the key kept
in ``home/credentials/mlflow-task.key`` (32 random bytes, 0600; its own key, not the proxy's): the
same pattern as the proxy secret (:mod:`apiary.control.proxy`), so nothing is stored per run, a
retry (a new run id) gets a new one, and the secret names its run. :meth:`MlflowIdentity.of_token`
accepts it only while that run is STARTING or RUNNING, as the run's job's user: a secret of a run
that ended stops working (after the MLflow plugin's cache, 30 s). It is never the admin's token or
the platform's: a job reaches MLflow as its own user only.

**The identity** the MLflow server's plugin (``mlflow_plugin/apiary_mlflow_auth.py``) asks for
at ``GET /api/v2/mlflow/identity``: ``{"user", "admin", "groups"}`` for a user's token or a task's
live secret.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from apiary.auth import Directory, Principal
from apiary.control.node_service import ACTIVE_TASK_STATES
from apiary.errors import ForbiddenError, NotFoundError, UnauthorizedError
from apiary.store.models import Job, Task
from apiary.store.unit import reading

#: The key file under the home (``apiary.control.proxy.load_key`` makes it).
KEY_FILE = Path("credentials") / "mlflow-task.key"
PREFIX = "mlflow-task."
USER_PREFIX = "mlflow-user."
#: Seconds a platform-minted user credential (:meth:`TaskTokens.issue_user`) is valid.
USER_TOKEN_TTL_S = 60


class TaskTokens:
    """``issue(run_id)`` and ``verify(token)`` of the tasks' MLflow secrets under ``key`` (>= 16 bytes)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the MLflow task key must hold at least 16 bytes")
        self._key = key

    def _mac(self, run_id: str) -> str:
        return hmac.new(self._key, f"apiary-mlflow/{run_id}".encode(), hashlib.sha256).hexdigest()

    def issue(self, run_id: str) -> str:
        """The secret of run ``run_id`` (safe in an environment variable and a header)."""
        return f"{PREFIX}{run_id}.{self._mac(run_id)}"

    def issue_user(self, user: str, now: float, ttl_s: float = USER_TOKEN_TTL_S) -> str:
        """A credential of ``user`` valid until ``now + ttl_s`` (unix seconds), which the control
        plane mints to ask MLflow something *as that user* when it has no token of theirs (a
        template run resolving a model for its submitter). Never handed out."""
        body = f"{user}.{int(now + ttl_s)}"
        return f"{USER_PREFIX}{body}.{self._mac('user/' + body)}"

    def verify_user(self, token: str, now: float) -> str | None:
        """The user of an unexpired :meth:`issue_user` credential, or None."""
        if not token.startswith(USER_PREFIX):
            return None
        body, dot, mac = token[len(USER_PREFIX):].rpartition(".")
        user, dot2, expires = body.rpartition(".")
        if not (dot and dot2 and user and expires.isdigit()):
            return None
        if not hmac.compare_digest(mac.encode(), self._mac("user/" + body).encode()) or int(expires) < now:
            return None
        return user

    def verify(self, token: str) -> str | None:
        """The run id ``token`` was issued for, or None for anything else (compared in constant time)."""
        if not token.startswith(PREFIX):
            return None
        run_id, dot, mac = token[len(PREFIX):].rpartition(".")
        if not dot or not run_id or not hmac.compare_digest(mac.encode(), self._mac(run_id).encode()):
            return None
        return run_id


class MlflowTaskEnv:
    """``task_env(user, run_id) -> {MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, MLFLOW_EXPERIMENT_NAME}``:
    what every task gets when the platform runs MLflow. ``url``: the tracking server as the tasks'
    nodes reach it. The experiment is the user's own, ``users/<user>``."""

    def __init__(self, url: str, tokens: TaskTokens) -> None:
        self.url = url.rstrip("/")
        self.tokens = tokens

    def __call__(self, user: str, run_id: str) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.url, "MLFLOW_TRACKING_TOKEN": self.tokens.issue(run_id),
                "MLFLOW_EXPERIMENT_NAME": experiment_of(user)}


def experiment_of(user: str) -> str:
    """The MLflow experiment of ``user``'s jobs: ``users/<user>``."""
    return f"users/{user}"


class MlflowIdentity:
    """Answers the MLflow plugin's question: who is this bearer token."""

    def __init__(self, sessions: sessionmaker[Session], directory: Directory, tokens: TaskTokens,
                 clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.directory = directory
        self.tokens = tokens
        self.clock = clock

    def of_token(self, token: str | None) -> dict:
        """``{"user", "admin", "groups"}`` of ``token``: a user's (or admin's) personal token, a
        task's MLflow secret of a STARTING or RUNNING run (its job's user, never admin), or an
        unexpired :meth:`TaskTokens.issue_user` credential. Raises
        UnauthorizedError (401) for no token, an unknown or expired one, or the secret of a run that
        ended or does not exist; ForbiddenError (403) for an agent's or a service's token (no
        MLflow user)."""
        if not token:
            raise UnauthorizedError("Authorization: Bearer <a user's token or a task's MLflow secret> is required.")
        run_id = self.tokens.verify(token)
        if run_id is not None:
            return self._of_run(run_id)
        if token.startswith(USER_PREFIX):
            user = self.tokens.verify_user(token, self.clock())
            if user is None:
                raise UnauthorizedError("This platform credential is forged or has expired.")
            try:
                doc = self.directory.get_user(user)
            except NotFoundError as e:
                raise UnauthorizedError(f"User {user} no longer exists.") from e
            return {"user": user, "admin": bool(doc["admin"]), "groups": doc["groups"]}
        principal = self.directory.authenticate(token)
        return self.of_principal(principal)

    @staticmethod
    def of_principal(principal: Principal) -> dict:
        """The identity of a verified caller; ForbiddenError for anything but a user."""
        if principal.kind != "user":
            raise ForbiddenError(f"{principal.describe().capitalize()} has no MLflow identity; only users do.")
        return {"user": principal.name, "admin": principal.admin, "groups": sorted(principal.groups)}

    def _of_run(self, run_id: str) -> dict:
        with reading(self.sessions, "mlflow identity") as s:
            row = s.execute(select(Task.state, Job.user).join(Job, Job.id == Task.job_id)
                            .where(Task.run_id == run_id)).first()
        if row is None or row[0] not in ACTIVE_TASK_STATES:
            raise UnauthorizedError("This MLflow secret belongs to a task run that has ended.")
        user = row[1]
        try:
            groups = self.directory.get_user(user)["groups"]
        except NotFoundError:  # the job's user was deleted since: no groups
            groups = []
        return {"user": user, "admin": False, "groups": groups}
