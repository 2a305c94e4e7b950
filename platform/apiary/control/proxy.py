"""Where the API's reverse proxy sends a request for a task instance's port, and the instance's secret.

The proxy (``/api/v2/jobs/{job_id}/proxy/{role}/{index}/{port}/...``, :mod:`apiary.api.routers.proxy`)
reaches a web server a task runs (JupyterLab, TensorBoard) on one of its **named ports**
(``resourcePerInstance.ports``, chosen from its run id by :func:`apiary.spec.ports.task_ports`).
:meth:`ProxyTargets.resolve` names the upstream: the node's address (the ``nodes`` row, as the
assignments give it to the task's peers: a node that never told one is this host, 127.0.0.1) and
the port, which must be one of the instance's named ports, given by number or by name. Nothing
else on the node is reachable through it.

**The instance secret.** With the process runtime a task's port is open on the node's own network,
so another user's task on that node could talk to it without the proxy. Each instance therefore
gets a secret in its environment, :data:`SECRET_ENV` (``APIARY_PROXY_TOKEN``): HMAC-SHA256 of its
run id under the control plane's proxy key (``home/credentials/task-proxy.key``, 32 random bytes
made once; :func:`apiary.wiring.wire`), so nothing is stored per run and a retry (a new run id)
gets a new one. The proxy adds ``Authorization: token <secret>`` to what it forwards (Jupyter
Server's own token scheme); a server that checks it (the JupyterLab example, the TensorBoard
plugin's gate) answers the proxy only. Only the instance itself and the node agent that launches
it see the value (the environment of a task is private to its uid; it is not in the job's JSON,
its logs or its peers' environment).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from apiary.control.cache import PlaneCache
from apiary.control.views import latest_tasks
from apiary.errors import ConflictError, ForbiddenError, NotFoundError
from apiary.lifecycle import TaskState
from apiary.spec.ports import task_ports
from apiary.store.models import Job, Node
from apiary.store.unit import reading

#: The environment variable that holds an instance's proxy secret.
SECRET_ENV = "APIARY_PROXY_TOKEN"
#: The key file under the home, beside the incident link key.
KEY_FILE = Path("credentials") / "task-proxy.key"


def load_key(path: Path) -> bytes:
    """The proxy key kept in ``path``: 32 random bytes as hex, created (mode 0600) if missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return bytes.fromhex(path.read_text().strip())


class InstanceSecrets:
    """``secrets(run_id) -> str``: an instance's proxy secret, HMAC-SHA256 of the run id under ``key``,
    as 64 hex digits (safe in an environment variable, a header and a shell word)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the proxy key must hold at least 16 bytes")
        self._key = key

    def __call__(self, run_id: str) -> str:
        digest = hmac.new(self._key, f"apiary-proxy/{run_id}".encode(), hashlib.sha256).digest()
        return digest.hex()


@dataclass(frozen=True)
class Upstream:
    """Where one proxied request goes: ``host:port`` of a running instance, its run id, and the
    secret to present (None when the control plane gives its instances none)."""

    host: str
    port: int
    run_id: str
    secret: str | None

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class ProxyTargets:
    """Resolves a proxy path to its :class:`Upstream` (read-only: one store read per request)."""

    def __init__(self, cache: PlaneCache, secrets_of: Callable[[], Callable[[str], str] | None]) -> None:
        self.cache = cache
        #: The instance secrets in use now (the assignments' :attr:`~Assignments.instance_secrets`).
        self.secrets_of = secrets_of

    def resolve(self, job_id: str, role: str, index: int, port: str) -> Upstream:
        """The upstream of ``port`` (a number or a port name) of instance ``role``/``index`` of the
        job's current attempt. The caller has been checked already (the job's owner).

        Raises NotFoundError (404) for a job, role or index the job lacks; ConflictError (409) when
        the instance is not RUNNING; ForbiddenError (403) for a port that is not one of its named
        ports, naming those it has."""
        with reading(self.cache.sessions, "proxy target") as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFoundError(f"Job {job_id} not found.")
            task = next((t for t in latest_tasks(s, job) if t.task_role == role and t.index == index), None)
            if task is None:
                raise NotFoundError(f"Job {job_id} has no task instance {role}/{index}.")
            if task.state != TaskState.RUNNING or not task.run_id or not task.node:
                raise ConflictError(f"Task instance {role}/{index} of job {job_id} is {task.state}, not RUNNING: "
                                    f"its ports answer only while it runs.")
            address = s.execute(select(Node.address).where(Node.name == task.node)).scalar_one_or_none()
            spec = self.cache.spec_of(job)
            run_id = task.run_id
        ports = task_ports(run_id, spec.port_names(role))
        number = ports.get(port) if not port.isdigit() else (int(port) if int(port) in ports.values() else None)
        if number is None:
            have = ", ".join(f"{n}={p}" for n, p in sorted(ports.items())) or "none"
            raise ForbiddenError(f"Port {port} is not a named port of task instance {role}/{index} of job {job_id} "
                                 f"(its named ports: {have}); the proxy reaches those only.")
        secrets_of = self.secrets_of()
        return Upstream(address or "127.0.0.1", number, run_id, secrets_of(run_id) if secrets_of else None)
