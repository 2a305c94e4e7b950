"""SQLAlchemy models: the durable state of the control plane.

An accepted job is a committed ``jobs`` row; a placement is a committed ``placements`` row
written before any node is told to start the task (so a crash after the commit loses nothing
and a crash before it never started anything). Times are unix seconds (float, UTC).
"""

from __future__ import annotations

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    pass


class Job(Base):
    """One OpenPAI job, id ``user~name`` (names are unique per user, as in OpenPAI)."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(300), primary_key=True)
    user: Mapped[str] = mapped_column(String(100), index=True)
    name: Mapped[str] = mapped_column(String(200))
    virtual_cluster: Mapped[str] = mapped_column(String(100), index=True)
    priority_class: Mapped[str] = mapped_column(String(10))
    priority: Mapped[int] = mapped_column(Integer)
    gang: Mapped[bool] = mapped_column(Boolean)
    spec_yaml: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), index=True)
    # START or STOP, OpenPAI's executionType: STOP asks every task to end.
    execution_type: Mapped[str] = mapped_column(String(8), default="START")
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # current attempt index, 0-based
    retries_user: Mapped[int] = mapped_column(Integer, default=0)
    retries_platform: Mapped[int] = mapped_column(Integer, default=0)
    submission_time: Mapped[float] = mapped_column(Float)
    launch_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    completion_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_phrase: Mapped[str | None] = mapped_column(String(100), nullable=True)
    waiting_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Indexed: a submission or link that names a flow run looks up the jobs attached to it.
    flow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    # Free-form tags set by alert actions (OpenPAI's alert handler "tag-jobs"), e.g. "low-gpu-util".
    tags: Mapped[list | None] = mapped_column(JSON, nullable=True)
    # Arrival order (1, 2, ...): FIFO's tie-break between jobs submitted at the same time, the same
    # rule the simulator follows.
    submit_seq: Mapped[int] = mapped_column(Integer, index=True)


class Attempt(Base):
    """One attempt of a job: all its task roles, placed and run once.

    ``outcome`` is decided first (completion policy, stop, preemption, node loss); the attempt is
    ``finished`` only when every task of it has ended, and only then does the job move on.
    """

    __tablename__ = "attempts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    created: Mapped[float] = mapped_column(Float)
    launched: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished: Mapped[float | None] = mapped_column(Float, nullable=True)
    # None while undecided; SUCCEEDED, FAILED, STOPPED, PREEMPTED or NODE_LOST once decided.
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    preempted_by: Mapped[str | None] = mapped_column(String(300), nullable=True)


class Placement(Base):
    """Cells given to one task instance of one attempt (HiveD's allocated pod)."""

    __tablename__ = "placements"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "task_role", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    task_role: Mapped[str] = mapped_column(String(100))
    index: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(200), index=True)
    leaf_cells: Mapped[list] = mapped_column(JSON)
    gpus: Mapped[list] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)
    released: Mapped[bool] = mapped_column(Boolean, default=False, index=True)


class Task(Base):
    """One run of one task instance (OpenPAI's task attempt); ``run_id`` is the node's idempotency key."""

    __tablename__ = "tasks"
    # (node, state): an agent's assignment poll reads its node's live tasks (STARTING, RUNNING) after
    # every change there; by node alone it would read every task the node ever ran.
    __table_args__ = (Index("ix_tasks_job_attempt", "job_id", "attempt"), Index("ix_tasks_node_state", "node", "state"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    task_role: Mapped[str] = mapped_column(String(100))
    index: Mapped[int] = mapped_column(Integer)
    task_attempt: Mapped[int] = mapped_column(Integer, default=0)  # taskRetryCount retries in place
    run_id: Mapped[str | None] = mapped_column(String(400), unique=True, nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    node: Mapped[str | None] = mapped_column(String(200), nullable=True)
    gpus: Mapped[list | None] = mapped_column(JSON, nullable=True)
    desired: Mapped[str] = mapped_column(String(8), default="RUN")  # RUN or STOP
    stop_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_phrase: Mapped[str | None] = mapped_column(String(100), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    placed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    started: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished: Mapped[float | None] = mapped_column(Float, nullable=True)
    latest: Mapped[bool] = mapped_column(Boolean, default=True)  # the newest run of its instance


class Event(Base):
    """Append-only job history; ``seq`` orders it (the Prefect bridge's cursor)."""

    __tablename__ = "events"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Float)
    job_id: Mapped[str] = mapped_column(String(300), index=True)
    type: Mapped[str] = mapped_column(String(40))
    data: Mapped[dict] = mapped_column(JSON)


class Node(Base):
    """A node: what its agent last reported, and the cordons set on it.

    ``healthy``: its agent reports (False once it missed heartbeats for ``APIARY_NODE_LOST_AFTER_S``;
    kept across control-plane restarts, like a Kubernetes node's Ready condition). ``cordons``: its
    :class:`NodeCordon` rows, one per source (loaded with the node); :attr:`cordoned` is derived from
    them. Whether the scheduler may place on it is derived from both by
    :func:`apiary.control.nodes.schedulable`. ``last_heartbeat``: unix seconds, written at most every
    few seconds (the control plane keeps the exact value in memory). ``metrics_url``: the agent's
    ``/metrics``.
    """

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    address: Mapped[str] = mapped_column(String(200), default="127.0.0.1")
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    simulated_gpus: Mapped[bool] = mapped_column(Boolean, default=False)
    healthy: Mapped[bool] = mapped_column(Boolean, default=True)
    agent_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    last_heartbeat: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics_url: Mapped[str | None] = mapped_column(String(400), nullable=True)
    cordons: Mapped[list[NodeCordon]] = relationship(
        lazy="selectin", cascade="all, delete-orphan", passive_deletes=True,
        order_by="(NodeCordon.at, NodeCordon.source)")

    @property
    def cordoned(self) -> bool:
        """No new placements (``kubectl cordon``): True while the node holds any cordon."""
        return bool(self.cordons)


class NodeCordon(Base):
    """One cordon on a node, keyed by who set it, like a Kubernetes taint's key: the node takes no
    new placements while it holds any. ``source``: ``admin``, ``alert:<alertname>``,
    ``incident:<id>``, ``drill:<drill>`` or ``chaos:<experiment or action>``
    (:data:`apiary.control.nodes.CORDON_SOURCE`); an uncordon removes its own source's row only.
    ``at``: unix seconds when it was first set; ``by``: the principal or actor that set it (the
    latest, when set again); ``reason``: why, as given (the latest)."""

    __tablename__ = "node_cordons"

    node: Mapped[str] = mapped_column(ForeignKey("nodes.name", ondelete="CASCADE"), primary_key=True)
    source: Mapped[str] = mapped_column(String(120), primary_key=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    by: Mapped[str] = mapped_column(String(200), default="")
    at: Mapped[float] = mapped_column(Float)


class NodeFault(Base):
    """A simulated-GPU fault queued for a node's agent (DCGM-style error injection).

    ``id`` never repeats, not even after rows are deleted or the control plane restarts (SQLite
    AUTOINCREMENT, a PostgreSQL sequence): the agent applies each fault once, those above its
    high-water mark. A row is deleted once the agent reports it applied (``faultsApplied``).
    ``fault``: ``{"ecc_dbe": n}``, ``{"xid": code}``, ``{"temp": c}``, ``{"clear": true}``, ...
    """

    __tablename__ = "node_faults"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(200), index=True)
    gpu: Mapped[int] = mapped_column(Integer)
    fault: Mapped[dict] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)


class Alert(Base):
    """One alert notification from Alertmanager (webhook payload version 4), as received."""

    __tablename__ = "alerts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    alertname: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))  # firing or resolved
    severity: Mapped[str | None] = mapped_column(String(16), nullable=True)
    labels: Mapped[dict] = mapped_column(JSON)
    annotations: Mapped[dict] = mapped_column(JSON)
    starts_at: Mapped[str] = mapped_column(String(40))
    ends_at: Mapped[str | None] = mapped_column(String(40), nullable=True)
    received: Mapped[float] = mapped_column(Float)


class AlertAction(Base):
    """One run of one automatic action for one firing alert; unique, so a resent alert never
    runs an action twice (actions are idempotent on top of that)."""

    __tablename__ = "alert_actions"
    __table_args__ = (UniqueConstraint("fingerprint", "starts_at", "action", "target"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    starts_at: Mapped[str] = mapped_column(String(40))
    alertname: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(40))
    target: Mapped[str] = mapped_column(String(300))
    status: Mapped[str] = mapped_column(String(16))  # ok or failed
    detail: Mapped[str] = mapped_column(Text)
    time: Mapped[float] = mapped_column(Float)


class User(Base):
    """A person who submits jobs (OpenPAI's user). ``name`` is the ``user`` of their job ids."""

    __tablename__ = "users"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    email: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created: Mapped[float] = mapped_column(Float)


class Group(Base):
    """A group of users (OpenPAI's group): its members may use its virtual clusters; an ``admin``
    group's members may do everything (OpenPAI's admin group)."""

    __tablename__ = "groups"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    description: Mapped[str] = mapped_column(Text, default="")
    created: Mapped[float] = mapped_column(Float)


class GroupMember(Base):
    __tablename__ = "group_members"

    group: Mapped[str] = mapped_column(ForeignKey("groups.name", ondelete="CASCADE"), primary_key=True)
    user: Mapped[str] = mapped_column(ForeignKey("users.name", ondelete="CASCADE"), primary_key=True, index=True)


class GroupGrant(Base):
    """Group -> virtual cluster: the group's members may submit to and see the jobs of ``vc``
    (OpenPAI's group ``extension.acls.virtualClusters``)."""

    __tablename__ = "group_grants"

    group: Mapped[str] = mapped_column(ForeignKey("groups.name", ondelete="CASCADE"), primary_key=True)
    virtual_cluster: Mapped[str] = mapped_column(String(100), primary_key=True)


class GroupStorageGrant(Base):
    """Group -> storage config: the group's members may mount ``config`` into their jobs and read
    and write its files (OpenPAI's group ``extension.acls.storageConfigs``). The config's row is
    :class:`StorageConfig`; a config that a group holds cannot be deleted (409)."""

    __tablename__ = "group_storage_grants"

    group: Mapped[str] = mapped_column(ForeignKey("groups.name", ondelete="CASCADE"), primary_key=True)
    config: Mapped[str] = mapped_column(String(100), primary_key=True)


class StorageServer(Base):
    """A storage server (OpenPAI's storage server): ``type`` ``local`` / ``nfs`` / ``glusterfs`` /
    ``sshfs`` and its connection ``data`` (camelCase keys as OpenPAI's; an ``sshfs`` server's
    ``identity`` is a secret, never answered by the API). Times are unix seconds."""

    __tablename__ = "storage_servers"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    type: Mapped[str] = mapped_column(String(20))
    data: Mapped[dict] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)


class StorageConfig(Base):
    """A storage config (OpenPAI's): ``mount_infos`` is a list of ``{mountPoint, server, path,
    permission}`` (``permission`` ``rw`` or ``ro``); ``default`` configs are mounted into every job
    of a user granted them that names none."""

    __tablename__ = "storage_configs"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    default: Mapped[bool] = mapped_column(Boolean, default=False)
    mount_infos: Mapped[list] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)


class Token(Base):
    """A bearer credential. Only a SHA-256 digest of its secret is stored (the token is shown
    once, when created). ``kind``: ``user`` (``subject`` is a user name), ``agent`` (a node name)
    or ``service`` (``bridge`` or ``alertmanager``). Times are unix seconds; ``expires`` None
    never expires; a revoked token stays, with ``revoked`` set, for the audit trail."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    subject: Mapped[str] = mapped_column(String(200), index=True)
    description: Mapped[str] = mapped_column(Text, default="")
    created: Mapped[float] = mapped_column(Float)
    expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked: Mapped[float | None] = mapped_column(Float, nullable=True)


class CiRecord(Base):
    """One CI record (:mod:`apiary.ci.records`): a GitHub delivery, the pipeline run it started and
    the deployment that followed, in one row whose ``state`` advances.

    ``state``: ``received`` (the delivery is recorded; pings and ignored deliveries stay so),
    ``pending`` (not started yet: ``delivery_reason`` says why), ``not_started`` (the start
    failed), ``started`` (a flow run is started: ``started_flow_run_id``), ``running`` (the
    pipeline reports stage results), ``passed`` / ``failed`` (the pipeline's verdict), then
    ``deployed``, ``rolled_back`` or ``deploy_failed`` (the deployment's result).

    The delivery: ``delivery`` (GitHub's ``X-GitHub-Delivery``, unique: a redelivery is recognised
    across restarts), ``event``, ``action``, ``received_at``, ``body_sha256`` (the SHA-256 hex of
    the raw body, unique per ``event``: the signature covers only the body, so the same body under
    a new delivery id is a replay; None on rows from before it was kept) and ``delivery_reason``.
    A run reported without a delivery (``ci/run-pipeline``, a forced deploy) has none of these.
    ``kind``: ``pr``, ``deploy``, ``ping`` or ``ignored``.

    The pipeline run (``result`` None until the flow reports one): ``flow_run_id`` (its Prefect
    flow run, unique: the upsert key without a delivery), ``result`` (``running``, ``success``,
    ``failure``: ``failed_stage``, or ``error``), ``reason``, ``stages`` (``[{"name", "state",
    "durationS", "summary"}]`` in order), ``target_url``.

    The deployment (``deploy_result`` None until one is reported): ``deploy_flow_run_id`` (unique),
    ``images`` / ``previous_images`` (``{component: image}``), ``actor``, ``trigger`` (``push``,
    ``rollback``, ``manual``), ``deploy_result`` (``succeeded``, ``rolled_back``, ``failed``),
    ``deploy_reason``, ``steps`` (``[{"component", "image", "gate", "ok", "detail", "durationS"}]``).

    Times are unix seconds; text is clipped to the column's length and has no NUL."""

    __tablename__ = "ci_records"
    __table_args__ = (Index("ux_ci_records_event_body", "event", "body_sha256", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    state: Mapped[str] = mapped_column(String(16), default="received", index=True)
    kind: Mapped[str] = mapped_column(String(16))
    repo: Mapped[str | None] = mapped_column(String(200), nullable=True)
    pr_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    sha: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    ref: Mapped[str | None] = mapped_column(String(300), nullable=True)
    # the delivery
    delivery: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)
    event: Mapped[str | None] = mapped_column(String(64), nullable=True)
    action: Mapped[str | None] = mapped_column(String(64), nullable=True)
    received_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    body_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    started_flow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    delivery_reason: Mapped[str] = mapped_column(Text, default="")
    # the pipeline run
    flow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)
    result: Mapped[str | None] = mapped_column(String(16), nullable=True)
    failed_stage: Mapped[str | None] = mapped_column(String(100), nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    stages: Mapped[list] = mapped_column(JSON, default=list)
    target_url: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    # the deployment
    deploy_flow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)
    images: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    previous_images: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    actor: Mapped[str | None] = mapped_column(String(200), nullable=True)
    trigger: Mapped[str | None] = mapped_column(String(16), nullable=True)
    deploy_started_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    deploy_finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    deploy_duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    deploy_result: Mapped[str | None] = mapped_column(String(16), nullable=True)
    deploy_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    steps: Mapped[list | None] = mapped_column(JSON, nullable=True)



class IncidentRow(Base):
    """One incident (the pure model is :class:`apiary.incidents.Incident`). Its state is
    the last entry of ``incident_entries``; ``links`` (``{"nodes", "jobs", "users",
    "virtualClusters", "gpuHoursLost"}``) and ``fingerprints`` are the merged values. ``verdict``:
    the responder's ``actionable`` / ``noise`` at resolve (alert quality). ``postmortem``: the
    Markdown draft (Sev1/Sev2 at resolve), edited by people. ``policy``: the escalation policy."""

    __tablename__ = "incidents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    title: Mapped[str] = mapped_column(String(500))
    severity: Mapped[str] = mapped_column(String(8))
    dedup_key: Mapped[str] = mapped_column(String(255), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    opened_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)
    policy: Mapped[str | None] = mapped_column(String(100), nullable=True)
    links: Mapped[dict] = mapped_column(JSON)
    fingerprints: Mapped[list] = mapped_column(JSON)
    verdict: Mapped[str | None] = mapped_column(String(16), nullable=True)
    postmortem: Mapped[str | None] = mapped_column(Text, nullable=True)


class IncidentEntry(Base):
    """One entry of an incident's append-only timeline, ``seq`` 0, 1, ... (never updated or deleted)."""

    __tablename__ = "incident_entries"
    __table_args__ = (UniqueConstraint("incident_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    actor: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    event: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    detail: Mapped[dict] = mapped_column(JSON)


class Escalation(Base):
    """The durable escalation of one incident: the facts :func:`apiary.oncall.next_page` needs
    (``policy``, ``started_at`` the episode's trigger, ``acknowledged_at``) and the next page's
    deadline ``next_at`` (unix seconds; None: nothing more to page). The escalation worker pages
    every row whose ``next_at`` has passed, so a restarted control plane pages late, never never."""

    __tablename__ = "escalations"

    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id"), primary_key=True)
    policy: Mapped[str] = mapped_column(String(100))
    started_at: Mapped[float] = mapped_column(Float)
    acknowledged_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    next_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    pages_sent: Mapped[int] = mapped_column(Integer, default=0)


class Notification(Base):
    """One delivery attempt of an incident notification (``ok`` or not, with the provider's answer)."""

    __tablename__ = "incident_notifications"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    channel: Mapped[str] = mapped_column(String(32))
    recipient: Mapped[str] = mapped_column(String(200))
    attempt: Mapped[int] = mapped_column(Integer)
    ok: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(Text)


class ActionItem(Base):
    """A postmortem action item, tracked until ``done`` (parsed from the postmortem's table)."""

    __tablename__ = "incident_action_items"
    __table_args__ = (UniqueConstraint("incident_id", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id"), index=True)
    key: Mapped[str] = mapped_column(String(32))
    text: Mapped[str] = mapped_column(Text)
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    status: Mapped[str] = mapped_column(String(16))


class BootstrapToken(Base):
    """A short-lived token a node joins with (Kubernetes' bootstrap token, ``kubeadm join``):
    ``<id>.<secret>``, only a SHA-256 digest of the secret stored. ``node``: the one node it may
    join as (None: any node of the cluster config not yet joined). Times are unix seconds;
    ``used`` is set by the join that spent it (a token joins once), ``revoked`` by an admin; the
    row stays for the audit trail. ``used_by``: the node that joined with it."""

    __tablename__ = "bootstrap_tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    node: Mapped[str | None] = mapped_column(String(200), nullable=True)
    description: Mapped[str] = mapped_column(Text, default="")
    created_by: Mapped[str] = mapped_column(String(200), default="")
    created: Mapped[float] = mapped_column(Float)
    expires: Mapped[float] = mapped_column(Float)
    used: Mapped[float | None] = mapped_column(Float, nullable=True)
    used_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    revoked: Mapped[float | None] = mapped_column(Float, nullable=True)


class Lease(Base):
    """A leader-election lease (Kubernetes' ``coordination.k8s.io/v1`` Lease): ``name`` (the
    control plane's is ``control-plane``), its ``holder`` (a replica's identity), the holder's
    advertised API URL, ``epoch`` (raised by one at every change of holder: the fencing token every
    leader's write checks in its transaction), ``renewed`` (the store's own clock at the last renew,
    unix seconds, so replicas on hosts with different clocks agree) and ``duration_s``."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200), default="")
    holder_url: Mapped[str] = mapped_column(String(500), default="")
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    acquired: Mapped[float] = mapped_column(Float, default=0.0)
    renewed: Mapped[float] = mapped_column(Float, default=0.0)
    duration_s: Mapped[float] = mapped_column(Float, default=15.0)


class UserSshKey(Base):
    """An SSH public key on a user's account (OpenPAI's user extension ``sshKeys``: title, value,
    time): every task of the user's jobs with the ssh runtime plugin lets it in. ``value`` is one
    checked authorized_keys line (:func:`apiary.spec.ssh.check_public_key`); the row goes with the
    user."""

    __tablename__ = "user_ssh_keys"

    user: Mapped[str] = mapped_column(ForeignKey("users.name", ondelete="CASCADE"), primary_key=True)
    title: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    created: Mapped[float] = mapped_column(Float)


class JobSshKey(Base):
    """The key pairs of a job with the ssh runtime plugin, made by the control plane the first time
    one of its tasks is assigned to a node (OpenPAI's user extension ``jobSSH``, but one per job):
    ``private_key``/``public_key`` the instances' shared client key (``jobssh``), ``host_private_key``/
    ``host_public_key`` the host key every instance's sshd presents, so peers and the user check it
    strictly. OpenSSH formats, Ed25519. The private keys are secrets: sent only to the nodes that run
    the job's tasks, never answered by the API, never logged."""

    __tablename__ = "job_ssh_keys"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    private_key: Mapped[str] = mapped_column(Text)
    public_key: Mapped[str] = mapped_column(Text)
    host_private_key: Mapped[str] = mapped_column(Text)
    host_public_key: Mapped[str] = mapped_column(Text)
    created: Mapped[float] = mapped_column(Float)


class JobTemplate(Base):
    """A job template of the marketplace (:mod:`apiary.marketplace.templates`): an OpenPAI job YAML
    (``job_yaml``, whose top-level ``parameters`` are the defaults) with its description.
    ``owner`` is the user who published it; ``official`` is set by admins only. ``tags`` a list of
    strings; ``visibility`` ``{virtualClusters: [...], groups: [...]}`` (both empty: everyone);
    ``parameter_schema`` the refinements of its parameters (:mod:`apiary.spec.template`)."""

    __tablename__ = "job_templates"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    owner: Mapped[str] = mapped_column(String(100), index=True)
    summary: Mapped[str] = mapped_column(Text, default="")
    description: Mapped[str] = mapped_column(Text, default="")
    author: Mapped[str] = mapped_column(String(200), default="")
    tags: Mapped[list] = mapped_column(JSON)
    visibility: Mapped[dict] = mapped_column(JSON)
    parameter_schema: Mapped[dict] = mapped_column(JSON)
    job_yaml: Mapped[str] = mapped_column(Text)
    official: Mapped[bool] = mapped_column(Boolean, default=False)
    created: Mapped[float] = mapped_column(Float)
    updated: Mapped[float] = mapped_column(Float)
