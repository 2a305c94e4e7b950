"""What a node's agent should run: its task runs with everything needed to launch them.

Read-only, one transaction per answer: one query for the node's live runs with their jobs and
placements, one for the nodes they name, the attempt's other runs only for a job of more than one
instance (their hosts), and one for the node's queued faults.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from apiary.control.cache import PlaneCache
from apiary.control.jobssh import JobSsh
from apiary.control.node_service import ACTIVE_TASK_STATES, read_node_faults
from apiary.control.proxy import SECRET_ENV as PROXY_SECRET_ENV
from apiary.control.views import latest_tasks
from apiary.errors import ApiaryError
from apiary.runtime.env import build_task_env
from apiary.runtime.probes import parse_probes, probes_to_wire
from apiary.spec.job import JobSpec
from apiary.spec.ports import task_ports
from apiary.spec.storage import StorageRequest
from apiary.spec.templating import render
from apiary.store.models import Job, Node, Placement, Task
from apiary.store.unit import reading


class Assignments:
    """The agents' view of the plane's ``cache``: :meth:`assignments` of a node."""

    def __init__(self, cache: PlaneCache) -> None:
        self.cache = cache
        #: ``plan_mounts(user, requests) -> [mount]``: what a task mounts
        #: (:meth:`apiary.storage.service.MountPlanner.plan`); None: no storage is wired, and a job
        #: that names a config gets a launch that fails with the reason.
        self.plan_mounts: Callable[[str, tuple[StorageRequest, ...] | None], list[dict]] | None = None
        #: ``instance_secrets(run_id) -> secret``: each launch's ``APIARY_PROXY_TOKEN``, which the API's
        #: proxy presents to the task (:class:`apiary.control.proxy.InstanceSecrets`); None: no secret.
        self.instance_secrets: Callable[[str], str] | None = None
        #: ``task_env(user, run_id) -> {name: value}``: more variables for every launch (the MLflow
        #: tracking server and the run's own secret, :class:`apiary.marketplace.identity.MlflowTaskEnv`);
        #: None: none.
        self.task_env: Callable[[str, str], dict[str, str]] | None = None
        #: The ssh runtime plugin's keys and each launch's ``ssh`` (:mod:`apiary.control.jobssh`).
        self.ssh = JobSsh(cache.sessions)

    def answer(self, node: str) -> dict:
        """The long poll's answer for ``node``: ``{"generation", "assignments", "faults"}``.

        An answer without runs is kept in memory for its generation (``cache.answers``), so an
        idle node's poll that ran out its wait reads nothing from the store. That is safe because
        a run reaches a node only by a placement, and that commit, like queueing a fault, bumps
        the node's generation (:meth:`PlaneCache.flush_notifications`, after the commit); the
        generation is read before the store, so a kept answer is never older than its generation.
        An answer with runs is read afresh every time: a run that ends (its task final) leaves it
        without a bump. Faults the agent applied leave the store without a bump too; a kept
        answer may still list them, and the agent skips ids at or below its high-water mark."""
        kept = self.kept_answer(node)
        if kept is not None:
            return kept
        gen = self.cache.generation.get(node, 0)
        faulted = self.cache.faulted
        with reading(self.cache.sessions, "assignments") as s:  # runs and faults in one transaction
            faults = read_node_faults(s, node) if faulted is None or node in faulted else []
            answer = {"generation": gen, "assignments": self.assignments(node, s), "faults": faults}
        if answer["assignments"]:
            self.cache.answers.pop(node, None)
        else:
            self.cache.answers[node] = (gen, answer)
        return answer

    def kept_answer(self, node: str) -> dict | None:
        """The answer :meth:`answer` kept for ``node``'s current generation, or None (then call
        :meth:`answer`). Plain dict reads, no store and no lock: an idle node's poll is answered in
        the event loop, without a worker thread."""
        kept = self.cache.answers.get(node)
        return kept[1] if kept is not None and kept[0] == self.cache.generation.get(node, 0) else None

    def assignments(self, node: str, s: Session | None = None) -> list[dict]:
        """The task runs ``node`` should be running now, with everything needed to launch them,
        read in ``s`` (a session of its own when None).

        Each item: ``{"runId", "desired": "RUN"|"STOP", "launch": TaskLaunch fields, "probes", "labels"}``.
        A run absent from the list must not run on the node.
        """
        # An agent reads this after every change to its node (a run placed or told to stop): one
        # query for the node's runs with their jobs and placements, one for the nodes they name,
        # and the attempt's other runs only for a job of more than one instance (their hosts).
        if s is None:
            with reading(self.cache.sessions, "assignments") as own:
                return self.assignments(node, own)
        rows = list(s.execute(
            select(Task, Job, Placement.leaf_cells)
            .join(Job, Job.id == Task.job_id)
            .outerjoin(Placement, and_(Placement.job_id == Task.job_id, Placement.attempt == Task.attempt,
                                       Placement.task_role == Task.task_role, Placement.index == Task.index))
            .where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))
            .order_by(Task.id)
        ).tuples())
        peers: dict[tuple[str, int], list[Task]] = {}
        for t, job, _ in rows:
            if (job.id, t.attempt) not in peers:
                single = sum(r.instances for r in self.cache.spec_of(job).task_roles.values()) == 1
                peers[(job.id, t.attempt)] = [t] if single else latest_tasks(s, job, t.attempt)
        # Addresses as the nodes' rows hold them: from the plane's cache of those rows
        # (PlaneCache.reported, filled from the store at recovery and after each report's commit),
        # the store read only for a node the cache does not hold.
        names = {p.node for ps in peers.values() for p in ps if p.node} | {node}
        nodes: dict[str, tuple[str | None, bool | None]] = {}
        for name in names:
            seen = self.cache.reported.get(name)
            if seen is not None:
                nodes[name] = (seen.info[2], seen.info[1])
        unread = names - nodes.keys()
        if unread:
            nodes.update((name, (address, simulated)) for name, address, simulated in s.execute(
                select(Node.name, Node.address, Node.simulated_gpus).where(Node.name.in_(unread))))
        out = []
        for t, job, leaf_cells in rows:
            spec = self.cache.spec_of(job)
            out.append({
                "runId": t.run_id, "desired": t.desired,
                "launch": self._launch(job, t, peers[(job.id, t.attempt)], nodes, leaf_cells),
                "probes": probes_to_wire(*parse_probes(spec.extras, t.task_role)),
                # For the node's task metrics (apiary_task_*{job,user,virtual_cluster,task_role,index}).
                "labels": {"job": job.id, "user": job.user, "virtual_cluster": job.virtual_cluster,
                           "task_role": t.task_role, "index": str(t.index)},
            })
        return out

    def _launch(self, job: Job, task: Task, peers: list[Task], nodes: dict[str, tuple[str | None, bool | None]],
                leaf_cells: list | None) -> dict:
        """``task``'s launch fields: ``peers`` are its attempt's latest runs (itself included),
        ``nodes`` maps node name -> (address, simulated GPUs) for them, ``leaf_cells`` its placement's."""
        spec = self.cache.spec_of(job)
        tr = spec.task_roles[task.task_role]
        # A node that never told its address (no row, or none in it) is taken to be this host.
        host_ips = {(t.task_role, t.index): (nodes[t.node][0] if t.node in nodes else None) or "127.0.0.1"
                    for t in peers if t.node}
        # Each instance's named ports (resourcePerInstance.ports), chosen from its run id
        # (apiary.spec.ports): every peer's are in the environment, as OpenPAI gives them.
        names = {role: spec.port_names(role) for role in spec.task_roles}
        ports = {(t.task_role, t.index): task_ports(t.run_id, names[t.task_role])
                 for t in peers if t.node and t.run_id and names[t.task_role]}
        env = build_task_env(
            job_id=job.id,
            user=job.user,
            job_name=job.name,
            task_roles={r: x.instances for r, x in spec.task_roles.items()},
            host_ips=host_ips,
            ports=ports or None,
            task_role=task.task_role,
            index=task.index,
            gpus=list(task.gpus or []),
            attempt=task.attempt,
            simulated_gpus=bool(task.node in nodes and nodes[task.node][1]),
            extra=self._extra_env(job, task),
        )
        prereq = next(
            (p for p in (spec.prerequisites or []) if p.type == "dockerimage" and p.name == tr.docker_image), None
        )
        image = prereq.uri if prereq is not None else None
        auth = getattr(prereq, "auth", None)
        image_auth = None
        if prereq is not None and auth is not None:
            # The schema asks for the password as a <% $secrets.x %> reference: resolved here, for
            # the one agent that runs the task (the assignments route serves a node its own runs only).
            context = spec.template_context(task.task_role)
            image_auth = {k: render(v, context, f"prerequisites.{prereq.name}.auth.{k}")
                          for k, v in auth.model_dump(exclude_none=True).items()}
        return {
            "run_id": task.run_id,
            "job_id": job.id,
            "user": job.user,
            "job_name": job.name,
            "task_role": task.task_role,
            "index": task.index,
            "commands": [*self._plugin_commands(spec, task), *spec.render_commands(task.task_role)],
            "env": env,
            "gpus": list(task.gpus or []),
            "image": image,
            "cpu": tr.resource_per_instance.cpu,
            "memory_mb": tr.resource_per_instance.memory_mb,
            "virtual_cluster": job.virtual_cluster,
            "leaf_cells": list(leaf_cells) if leaf_cells is not None else [],
            "image_auth": image_auth,
            "ports": dict(tr.resource_per_instance.ports or {}),
            "probes": probes_to_wire(*parse_probes(spec.extras, task.task_role)),
            **self._mounts(job, spec),
            **self.ssh.launch(job, spec, task, host_ips, ports),
        }

    def _extra_env(self, job: Job, task: Task) -> dict[str, str] | None:
        """The launch's secrets: the proxy's (``APIARY_PROXY_TOKEN``) and :attr:`task_env`'s."""
        if not task.run_id:
            return None
        extra = {PROXY_SECRET_ENV: self.instance_secrets(task.run_id)} if self.instance_secrets else {}
        if self.task_env is not None:
            extra.update(self.task_env(job.user, task.run_id))
        return extra or None

    @staticmethod
    def _plugin_commands(spec: JobSpec, task: Task) -> list[str]:
        """What runtime plugins run before the task's commands: TensorBoard (:mod:`apiary.spec.tensorboard`)."""
        tensorboard = spec.tensorboard_plugin()
        return tensorboard.commands(task.task_role, task.index) if tensorboard is not None else []

    def _mounts(self, job: Job, spec: JobSpec) -> dict:
        """``{"mounts": [...]}`` for the launch (none: ``{}``), or ``{"mountError": why}`` when the
        job's storage cannot be planned now (a config deleted or a grant revoked since submission):
        the node fails the run with that message (:data:`apiary.lifecycle.exitspec.EXIT_MOUNT_FAILED`)."""
        requests = spec.storage_requests()
        try:
            if self.plan_mounts is None:
                if requests:
                    return {"mountError": "this control plane has no storage service wired"}
                return {}
            mounts = self.plan_mounts(job.user, requests)
        except ApiaryError as exc:
            return {"mountError": f"storage of job {job.id} cannot be mounted: {exc.message}"}
        return {"mounts": mounts} if mounts else {}
