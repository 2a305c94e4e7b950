"""The control plane's side of OpenPAI's ssh runtime plugin: the job's keys, each launch's ``ssh``
and the SSH info a job's owner reads.

* :meth:`JobSsh.keys` makes a job's key pairs (Ed25519, OpenSSH formats) the first time one of its
  tasks is assigned, and keeps them in the store (``job_ssh_keys``, one row per job, written through
  the unit of work; two planes racing both read back the one that committed). The client pair is
  what ``jobssh`` shares between the instances (OpenPAI's ``jobSSH`` user extension, one per job
  here); the host pair is what every instance's sshd presents, so the instances and the job's owner
  check it strictly instead of trusting the first key they see.
* :meth:`JobSsh.launch` is the ``ssh`` field of a launch (:attr:`apiary.runtime.base.TaskLaunch.ssh`)::

      {"port": 20345, "login": "alice", "authorizedKeys": [...], "hostKey": "<private>",
       "hostPublicKey": "ssh-ed25519 ...", "hostKeyAlias": "apiary-alice-mnist",
       "jobKey": "<private>" | None, "jobPublicKey": "ssh-ed25519 ..." | None,
       "peers": [{"name": "worker-1", "host": "10.0.0.2", "port": 20871}],
       "jobssh": true, "sshbarrier": true, "barrierTimeoutS": 1800.0, "failurePolicy": "fail"}

  ``authorizedKeys``: the user's account keys (:mod:`apiary.auth.sshkeys`), the job's ``userssh``
  keys and, with ``jobssh``, the job's public key. ``peers`` (``jobssh`` only): every other instance
  of the attempt with its node's address and its ``ssh`` port (:func:`apiary.spec.ports.task_ports`).
  The private keys reach only the node that runs the task (the assignments route answers a node its
  own runs), are never logged (the agent blanks the launch's strings in its errors), and the API never
  answers them.
* :meth:`JobSsh.info` is OpenPAI's "SSH info": per instance of the current attempt its host, port,
  login name and whether it runs, with the job's host public key.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from apiary.auth.sshkeys import user_keys
from apiary.control.views import latest_tasks
from apiary.errors import ConflictError, NotFoundError
from apiary.lifecycle import TaskState
from apiary.spec.job import JobSpec
from apiary.spec.ports import task_ports
from apiary.spec.ssh import SSH_PORT_NAME
from apiary.store.models import Job, JobSshKey, Node, Task
from apiary.store.unit import Sessions, UnitOfWork, reading

logger = logging.getLogger(__name__)


def key_pair(comment: str) -> tuple[str, str]:
    """A new Ed25519 key pair: ``(private key in OpenSSH's PEM format, public key line)``."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return private, f"{public} {comment}"


def host_key_alias(job_id: str) -> str:
    """The name the job's host key is known under (ssh's ``HostKeyAlias``): ``apiary-<user>-<name>``
    with every character outside ``[A-Za-z0-9_.-]`` as ``-``."""
    return "apiary-" + re.sub(r"[^A-Za-z0-9_.-]", "-", job_id)


def login_name(user: str) -> str:
    """The name a task's sshd accepts: the job's user (the task's private /etc/passwd names its uid so)."""
    return user


@dataclass(frozen=True)
class JobKeys:
    private_key: str
    public_key: str
    host_private_key: str
    host_public_key: str


class JobSsh:
    """A job's SSH keys, launches and SSH info over ``sessions``. Thread-safe (no state but the
    session factory)."""

    def __init__(self, sessions: Sessions, clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.clock = clock

    def keys(self, job_id: str) -> JobKeys:
        """The job's key pairs, made and stored the first time. Raises UnavailableError (503) when
        the store cannot commit them."""
        found = self._read(job_id)
        if found is not None:
            return found
        private, public = key_pair(f"apiary-job:{job_id}")
        host_private, host_public = key_pair(f"apiary-host:{job_id}")
        try:
            with UnitOfWork(self.sessions, "job ssh keys") as uow:
                uow.s.add(JobSshKey(job_id=job_id, private_key=private, public_key=public,
                                    host_private_key=host_private, host_public_key=host_public, created=self.clock()))
            logger.info("ssh keys made job=%s", job_id)
        except ConflictError:
            pass  # another thread or replica made them first: theirs are the job's
        found = self._read(job_id)
        if found is None:
            raise NotFoundError(f"Job {job_id} has no SSH keys.")
        return found

    def _read(self, job_id: str) -> JobKeys | None:
        with reading(self.sessions, "read job ssh keys") as s:
            row = s.get(JobSshKey, job_id)
            if row is None:
                return None
            return JobKeys(row.private_key, row.public_key, row.host_private_key, row.host_public_key)

    def launch(self, job: Job, spec: JobSpec, task: Task, host_ips: dict[tuple[str, int], str],
               ports: dict[tuple[str, int], dict[str, int]]) -> dict:
        """``{"ssh": {...}}`` for ``task``'s launch (module doc), ``{}`` when its role has no ssh plugin.
        ``host_ips`` and ``ports``: every placed instance's node address and named ports, as the
        assignments computed them."""
        plugin = spec.ssh_plugin(task.task_role)
        if plugin is None:
            return {}
        keys = self.keys(job.id)
        with reading(self.sessions, "read ssh keys") as s:
            authorized = user_keys(s, job.user)
        authorized += list(plugin.user_keys)
        if plugin.jobssh:
            authorized.append(keys.public_key)
        peers = []
        if plugin.jobssh:
            for (role, index), named in sorted(ports.items()):
                if (role, index) != (task.task_role, task.index) and SSH_PORT_NAME in named \
                        and (role, index) in host_ips:
                    peers.append({"name": f"{role}-{index}", "host": host_ips[(role, index)],
                                  "port": named[SSH_PORT_NAME]})
        return {"ssh": {
            "port": ports.get((task.task_role, task.index), {}).get(SSH_PORT_NAME),
            "login": login_name(job.user),
            "authorizedKeys": list(dict.fromkeys(authorized)),
            "hostKey": keys.host_private_key, "hostPublicKey": keys.host_public_key,
            "hostKeyAlias": host_key_alias(job.id),
            "jobKey": keys.private_key if plugin.jobssh else None,
            "jobPublicKey": keys.public_key if plugin.jobssh else None,
            "peers": peers,
            **plugin.to_wire(),
        }}

    def info(self, job_id: str, spec_of: Callable[[Job], JobSpec]) -> dict:
        """OpenPAI's SSH info of the job's current attempt::

            {"jobId", "login", "hostKeyAlias", "hostPublicKey" (None before any task was assigned),
             "tasks": [{"taskRole", "index", "node", "host", "port", "running", "state"}]}

        ``host``: the node's reported address (None when unplaced); ``port``: the instance's ``ssh``
        port (None when its role has no ssh plugin or it has no run yet). Raises NotFoundError."""
        with reading(self.sessions, "read ssh info") as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFoundError(f"Job {job_id} not found.")
            spec = spec_of(job)
            tasks = latest_tasks(s, job)
            names = {t.node for t in tasks if t.node}
            addresses = dict(s.execute(select(Node.name, Node.address).where(Node.name.in_(names))).tuples().all())
            out = []
            for t in tasks:
                port = None
                if t.run_id and spec.ssh_plugin(t.task_role) is not None:
                    port = task_ports(t.run_id, spec.port_names(t.task_role))[SSH_PORT_NAME]
                out.append({"taskRole": t.task_role, "index": t.index, "node": t.node,
                            "host": (addresses.get(t.node) or "127.0.0.1") if t.node else None,
                            "port": port, "running": t.state == TaskState.RUNNING.value, "state": t.state})
            user = job.user
        keys = self._read(job_id)
        return {"jobId": job_id, "login": login_name(user), "hostKeyAlias": host_key_alias(job_id),
                "hostPublicKey": keys.host_public_key if keys else None, "tasks": out}
