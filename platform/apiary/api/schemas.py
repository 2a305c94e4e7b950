"""The REST API's request and response bodies (pydantic), as ``/openapi.json`` and ``/docs`` show them.

Field names are the wire names, camelCase as OpenPAI's REST server spells them, except where the
node agent's own snake_case records travel (``RunStatus``, ``TaskLaunch``, fault kinds). Response
models mirror the dicts that :class:`~apiary.control.ControlPlane` and
:class:`~apiary.ops.alerts.AlertReceiver` return; the routes hand those dicts to FastAPI, which
validates and serializes them through these models. Times are ISO 8601 UTC strings
(``2023-11-14T22:13:20.000Z``) where the field ends in ``Time``, unix seconds (float) otherwise.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from apiary.errors import ValidationError
from apiary.spec import job as job_protocol  # the module: its models are not the API's own (no aliases)
from apiary.spec.job import MAX_GPU

# ============================================================================ errors


class ErrorBody(BaseModel):
    """Every error answer (4xx/5xx): the :mod:`apiary.errors` class's code and message."""

    code: str = Field(description="OpenPAI-style error code: InvalidParametersError, NoJobError, ConflictJobError, ...")
    message: str = Field(description="What went wrong; for a bad field it starts with the field's path.")
    field: str | None = Field(
        default=None,
        description="Only for InvalidParametersError from a ValidationError: the dotted path of the offending "
        "field ('' when none applies).",
    )


# ============================================================================ requests

#: Bounds of the agents' and admins' numbers that the store keeps as 64-bit integers (a larger
#: one was an OverflowError, a 500) or that become dates: a pid or exit code is a C ``int``, an
#: ECC count or XID code fits one as well, and unix seconds stay within datetime's year 9999.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_UNIX_S = 253_402_300_799.0
#: Runs in one node report. A node runs one run per task instance placed on it and every instance
#: holds at least one leaf cell, so a node of MAX_GPU (1,024) leaf cells has at most 1,024 running,
#: plus as many exited ones not yet acknowledged. (25,000 runs in one report, which fit in the body
#: cap, took the plane 8 s.)
MAX_REPORT_RUNS = 2 * MAX_GPU

#: Bounds of integer query parameters: the store's integers are 64-bit (a larger value would be
#: an OverflowError, a 500), log offsets are bytes (1 TiB), indexes count instances and attempts.
MAX_SEQ = 2**63 - 1
MAX_OFFSET = 2**40
MAX_INDEX = 1_000_000


def check_text(data: Any) -> None:
    """Raise ValidationError naming a string in ``data`` (a JSON value: object keys and values,
    nested lists and objects included) that the store cannot keep: one with a NUL character
    (PostgreSQL text cannot hold U+0000; the driver fails the whole statement) or with a lone UTF-16
    surrogate (``"\\ud800"`` in JSON: not encodable as UTF-8, neither SQLite nor PostgreSQL take it).
    The field is the string's path (``alerts[0].labels.alertname``; ``body`` for the body itself).
    Iterative: no depth limit applies.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                check_string(where, key, "a key here")
                stack.append((f"{where}.{key}" if where else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        else:
            check_string(where, value)


def check_string(where: str, value: Any, what: str = "the value") -> None:
    """:func:`check_text` for one value (anything but a string passes); ``where`` is its field."""
    if not isinstance(value, str) or value.isascii() and "\x00" not in value:
        return
    if "\x00" in value:
        raise ValidationError(where or "body", f"{what} contains a NUL character (\\u0000), which Apiary cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(where or "body", f"{what} is not valid Unicode text: a lone surrogate "
                                               f"{value[exc.start]!r} at character {exc.start}") from None


class RequestBody(BaseModel):
    """A JSON request body: every string in it must be storable text (:func:`check_text`).

    The check runs on the body as the client sent it, before the fields are validated, and raises
    Apiary's ValidationError, which pydantic does not wrap: the answer is a 400 whose ``field`` is
    the string's path. FastAPI solves the route's dependencies (the token) before it validates the
    body, so a caller without a valid token still gets 401 first.
    """

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        check_text(data)
        return data


class ExecutionType(RequestBody):
    value: str = Field(max_length=16,
                       description="STOP (OpenPAI's executionType); START is not supported for a submitted job.")


class CordonRequest(RequestBody):
    """Set or remove one source's cordon (a node is cordoned while it holds any)."""

    value: bool = Field(description="true: set the source's cordon (no new placements on the node); false: "
                                    "remove it (schedulable again once no cordon is left).")
    reason: str | None = Field(default=None, max_length=500, description="Why (kept with the cordon).")
    source: str = Field(default="admin", max_length=120,
                        description="Whose cordon: admin (default), alert:<alertname>, incident:<id>, "
                                    "drill:<drill> or chaos:<name>.")
    all: bool = Field(default=False, description="With value false: remove every cordon, whatever its source.")


class FlowRunRef(RequestBody):
    id: str = Field(max_length=64, description="The Prefect flow run id the job's task runs and logs are attached to.")


#: Most links one ``PUT /api/v2/flowRuns`` takes (the bridge sends one batch's new flow runs).
MAX_FLOW_RUN_LINKS = 1000


class FlowRunLink(RequestBody):
    jobId: str = Field(max_length=400, description="An Apiary job id (user~name).")
    flowRunId: str = Field(max_length=64, description="The Prefect flow run the job is mirrored into.")


class FlowRunLinks(RequestBody):
    links: list[FlowRunLink] = Field(max_length=MAX_FLOW_RUN_LINKS,
                                     description="Jobs and their flow runs; a job named twice keeps the last.")


#: Most reads one ``POST /api/v2/logs/query`` takes (the bridge reads a batch's finished output).
MAX_LOG_READS = 200


class LogRead(RequestBody):
    jobId: str = Field(max_length=400, description="An Apiary job id (user~name).")
    taskRole: str = Field(max_length=100, description="The task role.")
    index: int = Field(ge=0, le=1_000_000, description="The instance's index in its task role.")
    attempt: int = Field(ge=0, le=1_000_000, description="The job attempt (0 for the first).")
    stream: Literal["stdout", "stderr", "all"] = Field(description="Which output.")
    offset: int = Field(default=0, ge=0, le=2**40, description="Bytes to skip.")


class LogReads(RequestBody):
    reads: list[LogRead] = Field(max_length=MAX_LOG_READS, description="Instance streams to read.")


class LogTexts(BaseModel):
    texts: list[str | None] = Field(
        description="Per read, in order: the text from ``offset``, or null for a job, task role or "
                    "instance that does not exist.")


class FlowRunsRecorded(BaseModel):
    recorded: int = Field(description="Links stored (jobs that exist).")
    unknown: list[str] = Field(description="Job ids with no such job: left out.")


class RunStatus(BaseModel):
    """One task run as the node's runtime backend sees it (``apiary.runtime.TaskStatus``)."""

    run_id: str = Field(max_length=400)
    state: str = Field(max_length=16, description="running | exited")
    exit_code: int | None = Field(default=None, ge=INT32_MIN, le=INT32_MAX)
    pid: int | None = Field(default=None, ge=0, le=INT32_MAX)
    started_at: float | None = Field(default=None, ge=0, le=MAX_UNIX_S, allow_inf_nan=False,
                                     description="Unix seconds.")
    finished_at: float | None = Field(default=None, ge=0, le=MAX_UNIX_S, allow_inf_nan=False,
                                      description="Unix seconds.")
    lost: bool = Field(default=False, description="Exited without a recorded exit code (a platform failure).")
    stopped: bool = Field(default=False, description="Ended because the control plane asked it to stop.")


class FaultRequest(RequestBody):
    """A simulated-GPU fault, like DCGM's error injection (dcgmi test --inject)."""

    gpu: int = Field(ge=0, le=MAX_GPU)
    eccDbe: int | None = Field(default=None, ge=0, le=INT32_MAX, description="Add N double-bit ECC errors.")
    eccSbe: int | None = Field(default=None, ge=0, le=INT32_MAX, description="Add N single-bit ECC errors.")
    xid: int | None = Field(default=None, ge=0, le=INT32_MAX, description="Raise XID error CODE.")
    temp: float | None = Field(default=None, ge=-273.15, le=1000, allow_inf_nan=False,
                               description="Force the temperature, Celsius.")
    degraded: float | None = Field(
        default=None, ge=1, le=1000, allow_inf_nan=False,
        description="Simulated slowdown FACTOR (>= 1; 1 = healthy): the GPU's SM clock drops by it and the "
                    "node's agent gives tasks on it APIARY_SIMULATED_SLOWDOWN=FACTOR, which the stress drill's "
                    "benchmark honours (examples/stress/bench.py). A simulation, for drills.",
    )
    # Health beyond ECC/XID (apiary.monitoring.gpu_health; tests/api check these literals match it).
    rowRemapFailure: bool | None = Field(
        default=None, description="Set (true) or unset the row-remapping failure flag (no spare row left: RMA).")
    rowRemapPending: bool | None = Field(
        default=None, description="Set (true) or unset a row remap pending until the GPU is reset.")
    retiredPages: int | None = Field(
        default=None, ge=0, le=INT32_MAX,
        description="Retire N more pages for double-bit errors (GPU models that retire pages; the agent "
                    "rejects it on one that remaps rows instead).")
    throttle: Literal["thermal", "power", "hw_slowdown"] | None = Field(
        default=None, description="Hold the clocks throttled for this reason until cleared.")
    pcieGen: int | None = Field(
        default=None, ge=1, le=6,
        description="Train the PCIe link at generation N (the agent rejects N above the GPU's maximum).")
    pcieWidth: Literal[1, 2, 4, 8, 16, 32] | None = Field(
        default=None, description="Train the PCIe link at N lanes (the agent rejects N above the GPU's maximum).")
    clear: bool = Field(default=False, description="Reset the GPU's faults.")

    # A misspelt fault kind is a 400 naming it, not a fault silently reduced to the others.
    model_config = ConfigDict(extra="forbid")


#: At most this many bytes of output ride in one node report (:class:`LogChunk`); an agent sends
#: more with ``POST /api/v2/nodes/{node}/logs``.
MAX_INLINE_LOG_BYTES = 64 * 1024
_MAX_INLINE_LOG_CHARS = 4 * ((MAX_INLINE_LOG_BYTES + 2) // 3)  # its base64


class LogChunk(RequestBody):
    """Bytes of one run's stream sent with a node report, stored before the report's statuses, so a
    run's output is complete when its exit is recorded. Idempotent like ``POST .../logs``."""

    runId: str = Field(max_length=400)
    stream: Literal["stdout", "stderr"]
    offset: int = Field(ge=0, le=MAX_OFFSET, description="Byte offset of the first byte in the stream.")
    data: str = Field(max_length=_MAX_INLINE_LOG_CHARS, description="The bytes, base64 (RFC 4648).")

    def raw(self) -> bytes:
        """The bytes. Raises ValidationError (400, field ``logs.data``) for data that is not base64."""
        try:
            return base64.b64decode(self.data, validate=True)
        except ValueError as e:  # binascii.Error, or a character outside ASCII
            raise ValidationError("logs.data", f"not base64: {e}") from None


class NodeReport(RequestBody):
    """A node agent's heartbeat with the statuses of its runs (``POST /api/v2/nodes/{node}/status``)
    and, in ``logs``, up to :data:`MAX_INLINE_LOG_BYTES` of their new output (one request where a
    short task's output and exit took two)."""

    metricsUrl: str | None = Field(default=None, max_length=2048, description="The agent's /metrics URL for this node.")
    agentId: str = Field(max_length=200)
    gpus: int = Field(default=0, ge=0, le=MAX_GPU)
    simulatedGpus: bool = False
    address: str = Field(default="127.0.0.1", max_length=255)
    runs: list[RunStatus] = Field(default=[], max_length=MAX_REPORT_RUNS)
    faultsApplied: int | None = Field(
        default=None, ge=0, le=2**63 - 1,
        description="The agent's high-water mark: the highest fault id it has applied (None: not reported).",
    )
    logs: list[LogChunk] = Field(default=[], max_length=2 * MAX_REPORT_RUNS)
    cannotRecord: str | None = Field(
        default=None, max_length=2000,
        description="Why the agent cannot record its runs (state dir not writable, disk full); it launches "
                    "nothing new meanwhile and the control plane's /healthz says so. Null: it can.",
    )

    @model_validator(mode="after")
    def _inline_logs_fit(self) -> NodeReport:
        # The bytes the base64 stands for (the padding tells the last group's size).
        if sum(len(c.data) * 3 // 4 - c.data[-2:].count("=") for c in self.logs) > MAX_INLINE_LOG_BYTES:
            raise ValidationError("logs", f"more than {MAX_INLINE_LOG_BYTES} bytes of output in one report; "
                                          "send the rest with POST /api/v2/nodes/{node}/logs")
        return self


# ============================================================================ jobs


class RetryDetails(BaseModel):
    user: int = Field(description="Retries that count against jobRetryCount (the job's own failures).")
    platform: int = Field(description="Retries for platform causes (preemption, lost node); not counted.")


class TaskJson(BaseModel):
    """One task instance of the job's current attempt."""

    taskRole: str
    index: int
    attempt: int = Field(description="The job attempt this task belongs to.")
    taskAttempt: int = Field(description="Retries of this instance within the attempt (task_retry).")
    state: str = Field(description="WAITING | STARTING | RUNNING | SUCCEEDED | FAILED | STOPPED")
    node: str | None
    gpus: list[int] = Field(description="GPU indices on the node.")
    simulatedGpus: bool | None = Field(description="The node advertises the config's GPUs without having them.")
    exitCode: int | None
    exitPhrase: str | None
    startTime: str | None
    completionTime: str | None


class MlflowRunJson(BaseModel):
    """One MLflow run of a job (the model registry, :mod:`apiary.marketplace.models`)."""

    runId: str
    experimentId: str | None = None
    status: str | None = None
    url: str | None = Field(default=None, description="The run in MLflow's UI.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Each metric's last value.")
    tags: dict[str, str] = Field(default_factory=dict, description="Its apiary.* tags and mlflow.user.")
    startedAt: str | None = None
    endedAt: str | None = None


class JobStorageJson(BaseModel):
    """One mount of a job's tasks: config ``config``'s ``path`` on ``server`` at ``mountPoint``."""

    config: str
    mountPoint: str
    server: str
    path: str
    permission: Literal["rw", "ro"]


class JobJson(BaseModel):
    """A job as OpenPAI's REST server shows it, with Apiary's additions (retryDetails, tasks, ...)."""

    id: str = Field(description="user~name")
    name: str
    user: str
    virtualCluster: str
    priorityClass: str
    priority: int
    gang: bool
    state: str = Field(description="WAITING | RUNNING | SUCCEEDED | FAILED | STOPPED")
    executionType: str = Field(description="START | STOP")
    attempt: int = Field(description="The current attempt, 0-based.")
    retries: int = Field(description="user + platform retries")
    retryDetails: RetryDetails
    submissionTime: str
    launchTime: str | None
    completionTime: str | None
    exitCode: int | None
    exitPhrase: str | None
    waitingReason: str | None = Field(description="Why the job is not (fully) placed; None once placed.")
    flowRunId: str | None = Field(description="The Prefect flow run the job is mirrored into.")
    tags: list[str]
    tasks: list[TaskJson]


class JobDetailJson(JobJson):
    """One job (``GET /jobs/{id}``): :class:`JobJson` and, when its tasks mount storage, what they
    mount (the configs' files are where its outputs go: ``apiary storage ls CONFIG:PATH``), or why
    they cannot now."""

    storage: list[JobStorageJson] | None = Field(default=None, description="What its tasks mount (absent: none).")
    storageError: str | None = Field(default=None, description="Why its storage cannot be mounted now.")
    mlflowRuns: list[MlflowRunJson] | None = Field(
        default=None, description="Its MLflow runs (tag apiary.job) the caller may read, newest first (absent: none).")


class EventJson(BaseModel):
    seq: int = Field(description="Position in the event log (the bridge's cursor).")
    time: float = Field(description="Unix seconds.")
    jobId: str
    type: str = Field(description="job.submitted | job.waiting | job.placed | task.started | task.exited | ...")
    data: dict[str, Any] = Field(description="Free-form: what the event type records.")


class EventsPage(BaseModel):
    events: list[EventJson] = Field(description="Events with seq > after, ordered by seq.")


# ============================================================================ scheduler and cluster


class CycleResultJson(BaseModel):
    """What one scheduling cycle decided."""

    placed: list[str] = Field(description="Jobs placed in this cycle.")
    preempted: list[str] = Field(description="Jobs preempted (their attempts stopped) in this cycle.")
    waiting: dict[str, str] = Field(description="job -> why it waits.")
    durationMs: float


class VcCells(BaseModel):
    total: int
    bound: int = Field(description="Virtual cells bound to physical cells.")
    free: int


class VcStatus(BaseModel):
    """One virtual cluster; counts are leaf cells unless said otherwise."""

    quota: int
    used: int = Field(description="By its guaranteed groups.")
    free: int
    reserved: int = Field(description="Held for preemptors.")
    opportunisticUsed: int = Field(description="By its opportunistic groups, anywhere.")
    badCells: int = Field(description="Its bound leaves on unhealthy nodes.")
    doomedBadCells: int = Field(description="Virtual cells only bad hardware can satisfy.")
    cells: dict[str, VcCells] = Field(description='"<chain>/<level>" -> virtual cells at that level.')


class NodeCells(BaseModel):
    leafCells: int
    healthy: bool
    used: dict[str, int] = Field(description="group -> leaf cells it uses on the node.")


class GroupPlacement(BaseModel):
    task: str = Field(description="taskRole[index]")
    node: str
    leafCells: list[int]


class GroupStatus(BaseModel):
    vc: str
    priority: int = Field(description="Negative: opportunistic.")
    downgraded: bool = Field(description="Lazily preempted: a guaranteed group running as opportunistic.")
    placements: list[GroupPlacement]


class ReservationStatus(BaseModel):
    priority: int
    victims: list[str] = Field(description="Groups whose cells are reserved.")
    cells: list[str] = Field(description='"<node>/<leaf index>"')


class ClusterStatus(BaseModel):
    """The scheduler's view (``HivedScheduler.status``); ``?vc=`` narrows VCs, groups, nodes and reservations."""

    virtualClusters: dict[str, VcStatus]
    physical: dict[str, dict[str, int]] = Field(description='chain -> {"<level>": free physical cells}.')
    nodes: dict[str, NodeCells]
    groups: dict[str, GroupStatus]
    reservations: dict[str, ReservationStatus]


class ReconfigureResult(BaseModel):
    kept: list[str] = Field(description="Jobs that keep running untouched.")
    stopped: dict[str, str] = Field(description="job -> why its attempt was stopped (retried as a platform retry).")


class ConsistencyJson(BaseModel):
    """What ``ControlPlane.check_consistency`` found: the store against the scheduler's memory."""

    consistent: bool = Field(description="True when the store and the scheduler agree.")
    problems: list[str] = Field(description="One sentence per difference, naming the job or node.")


# ============================================================================ nodes


class CordonJson(BaseModel):
    source: str = Field(description="Who set it: admin, alert:<alertname>, incident:<id>, drill:<drill>, chaos:<name>.")
    reason: str = Field(description="Why, as given (may be empty).")
    by: str = Field(description="The principal or actor that set it.")
    at: str | None = Field(description="When it was set (ISO 8601, UTC).")


class NodeJson(BaseModel):
    name: str
    gpus: int
    simulatedGpus: bool | None = Field(description="None until the node's agent reported.")
    healthy: bool
    ready: bool = Field(description="Its agent reports (healthy).")
    cordoned: bool = Field(description="It holds a cordon (any source).")
    cordons: list[CordonJson] = Field(description="Its cordons, oldest first: who set each, when and why.")
    schedulable: bool = Field(description="New work may be placed on it: ready and not cordoned.")
    address: str | None
    skuType: str
    gpusUsed: int
    lastHeartbeat: str | None
    metricsUrl: str | None


class NodeReportAck(BaseModel):
    ack: list[str] = Field(description="Runs whose final status is recorded: the agent may forget them.")
    logs: list[int | None] | None = Field(
        default=None,
        description="For a report with `logs`: each chunk's stream size once stored, in order (null: left "
                    "out, the run is not on this node). Absent from an older control plane, which ignores "
                    "`logs`: the agent then sends its output with POST /api/v2/nodes/{node}/logs.",
    )


class Fault(BaseModel):
    """A queued simulated-GPU fault. Only the kinds that were given are present."""

    id: int = Field(description="Increasing, never repeated: the agent applies ids above its high-water mark.")
    gpu: int
    ecc_dbe: int | None = None
    ecc_sbe: int | None = None
    xid: int | None = None
    temp: float | None = None
    degraded: float | None = None
    row_remap_failure: bool | None = None
    row_remap_pending: bool | None = None
    retired_pages: int | None = None
    throttle: str | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    clear: bool | None = None


class PlannedServer(BaseModel):
    name: str
    type: str
    data: dict[str, Any]


class PlannedMount(BaseModel):
    """One storage mount of a task (:meth:`apiary.storage.service.StorageService.plan`)."""

    config: str
    server: PlannedServer
    path: str = Field(description="Relative to the server's root; '' the root itself.")
    mountPoint: str
    readOnly: bool
    optional: bool | None = Field(default=None, description="true: the task runs without it when it fails "
                                                              "(the plugin's failurePolicy: ignore).")


class TaskLaunch(BaseModel):
    """Everything the agent needs to start the run (``apiary.runtime.TaskLaunch``'s fields)."""

    run_id: str
    job_id: str
    user: str
    job_name: str
    task_role: str
    index: int
    commands: list[str]
    env: dict[str, str] = Field(description="OpenPAI's PAI_* environment.")
    gpus: list[int]
    image: str | None
    cpu: int
    memory_mb: int
    virtual_cluster: str = ""
    leaf_cells: list[int] = Field(default=[], description="HiveD leaf cell indices of the placement within the node.")
    image_auth: dict[str, str] | None = Field(
        default=None, description="Registry credentials of the dockerImage prerequisite (secrets resolved).")
    ports: dict[str, int] = Field(default={}, description="resourcePerInstance.ports: label -> count.")
    probes: dict = Field(default={}, description="The role's probes (as in the assignment's probes).")
    mounts: list[PlannedMount] | None = Field(
        default=None, description="The task's storage (absent: none): each server's connection data with its "
                                  "secrets, for the node that runs the task only.")
    mountError: str | None = Field(default=None, description="Why the task's storage cannot be mounted now (a "
                                                             "config deleted or a grant revoked since submission): "
                                                             "the node fails the run with it.")
    ssh: dict[str, Any] | None = Field(
        default=None, description="OpenPAI's ssh runtime plugin (absent: none): the task's sshd port, login, "
                                  "authorized keys, the job's host key and key pair (secrets, for the node that "
                                  "runs the task only), its peers and barrier (apiary.control.jobssh).")


class TaskLabels(BaseModel):
    """The labels of the node's task metrics (``apiary_task_*``)."""

    job: str
    user: str
    virtual_cluster: str
    task_role: str
    index: str


class Assignment(BaseModel):
    runId: str
    desired: Literal["RUN", "STOP"]
    launch: TaskLaunch
    probes: dict[str, dict[str, Any]] = Field(
        description="Free-form: livenessProbe / readinessProbe (Kubernetes shapes), each present only if set."
    )
    labels: TaskLabels


class Assignments(BaseModel):
    generation: int = Field(description="Pass it back as ?generation= to long-poll for the next change.")
    assignments: list[Assignment] = Field(description="Runs the node must run or stop now; others must not run.")
    faults: list[Fault] = Field(description="Queued simulated-GPU faults, oldest first.")


class LogAppended(BaseModel):
    size: int = Field(description="Bytes of the run's stream now stored.")


# ============================================================================ alerts


class AlertActionResult(BaseModel):
    alertname: str
    action: str
    target: str
    status: str = Field(description="ok | failed | skipped (running while the action runs)")
    detail: str


class WebhookResult(BaseModel):
    actions: list[AlertActionResult] = Field(description="The actions run for this delivery.")


class AlertJson(BaseModel):
    alertname: str
    status: str = Field(description="firing | resolved")
    severity: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    startsAt: str
    fingerprint: str


class AlertActionRecord(AlertActionResult):
    time: float = Field(description="Unix seconds of the last try.")


class AlertsPage(BaseModel):
    alerts: list[AlertJson] = Field(description="Newest first.")
    actions: list[AlertActionRecord] = Field(description="Newest first.")


# ============================================================================ drills


_Seconds = Annotated[float, Field(ge=0, le=MAX_UNIX_S, allow_inf_nan=False)]


class ProbeResult(RequestBody):
    """One inspection probe of a VC (apiary.drills.inspection): a tiny opportunistic job's
    submit -> running -> succeeded against the SLO."""

    virtualCluster: str = Field(min_length=1, max_length=100)
    success: bool = Field(description="The job succeeded within the SLO.")
    phases: dict[Literal["schedule", "run", "total"], _Seconds] = Field(
        default={}, description="Seconds: schedule (submit to running), run (running to succeeded), total "
                                "(submit to its end); the phases reached.")
    jobId: str | None = Field(default=None, max_length=300)
    reason: str = Field(default="", max_length=2000, description="Why it failed; empty on success.")


class NodeFailure(RequestBody):
    """A node the stress drill's diagnosis failed, and the rule (apiary/drills/rules.yaml)."""

    node: str = Field(min_length=1, max_length=200)
    rule: str = Field(min_length=1, max_length=100)
    detail: str = Field(default="", max_length=2000)


class DrillReport(RequestBody):
    """One drill run's result, as a drill reports it (``POST /api/v2/drills/results``)."""

    drill: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$",
                       description="inspection, stress-drill, chaos-drill, load-drill, or another drill's name.")
    result: Literal["passed", "failed", "aborted"] = Field(
        description="aborted: the drill's guard stopped it because the steady state broke its error budget.")
    startedAt: _Seconds = Field(description="Unix seconds.")
    finishedAt: _Seconds = Field(description="Unix seconds.")
    summary: str = Field(default="", max_length=4000)
    probes: list[ProbeResult] = Field(default=[], max_length=1000)
    nodeFailures: list[NodeFailure] | None = Field(
        default=None, max_length=10000,
        description="The stress drill's failed (node, rule) pairs; replaces the last list ([] clears it). "
                    "None (other drills): left as it is.")


class DrillRecord(BaseModel):
    drill: str
    result: Literal["passed", "failed", "aborted"]
    startedAt: float
    finishedAt: float
    durationS: float
    summary: str
    lastSuccessAt: float | None = Field(description="Unix seconds of the last passed run; None before one.")


class ProbeRecord(BaseModel):
    virtualCluster: str
    success: bool
    phases: dict[str, float]
    at: float = Field(description="Unix seconds the probe's drill run ended.")
    jobId: str | None
    reason: str


class NodeFailureRecord(BaseModel):
    node: str
    rule: str
    detail: str
    drill: str
    at: float


class DrillsPage(BaseModel):
    drills: list[DrillRecord] = Field(description="The last run of each drill, by name.")
    probes: list[ProbeRecord] = Field(description="The last inspection probe of each VC.")
    nodeFailures: list[NodeFailureRecord] = Field(description="The last stress drill's failed nodes.")


# ============================================================================ process


class Health(BaseModel):
    status: Literal["ok"]
    pid: int
    startedAt: float = Field(description="Unix seconds.")
    clusterId: str | None = Field(
        None, description="The platform's identity (home/cluster-id, written by the first apiary up); the CLI "
        "refuses a platform whose id is not the one recorded in its APIARY_HOME.",
    )
    role: Literal["leader", "follower"] | None = Field(
        None, description="With leader election (replicas on PostgreSQL): this replica's role.")
    leader: str | None = Field(None, description="The leading replica's advertised URL (the lease's holder).")
    epoch: int | None = Field(None, description="The lease's fencing epoch this replica knows.")
    replica: str | None = Field(None, description="This replica's identity in the lease.")
    fencedWrites: int | None = Field(
        None, description="Commits of this replica refused because its lease epoch was no longer current.")


# ============================================================================ the job protocol

_PROTOCOL_PREFIX = "OpenPai"
#: ``POST /api/v2/jobs``'s body (YAML or JSON): OpenPAI job protocol v2 as :mod:`apiary.spec.job`
#: validates it. The cross-field rules (a task role's ``dockerImage`` names a prerequisite, ...)
#: and the per-job instance limit are not expressible here; a body breaking them is a 400.
JOB_PROTOCOL_REF = {"$ref": f"#/components/schemas/{_PROTOCOL_PREFIX}JobSpec"}


def job_protocol_components() -> dict[str, Any]:
    """The OpenAPI component schemas :data:`JOB_PROTOCOL_REF` refers to (``OpenPaiJobSpec``, ``OpenPaiTaskRole``,
    ...): the wire names (camelCase), prefixed so that they cannot clash with the API's own models."""
    ref_template = f"#/components/schemas/{_PROTOCOL_PREFIX}{{model}}"
    schema = job_protocol.JobSpec.model_json_schema(by_alias=True, ref_template=ref_template)
    defs = schema.pop("$defs", {})
    return {f"{_PROTOCOL_PREFIX}{name}": body for name, body in {**defs, "JobSpec": schema}.items()}


_ERRORS = {
    400: "The request is wrong; `field` names what (a bad body, parameter or job field).",
    401: "No credential, or one Apiary does not accept: send `Authorization: Bearer <token>`.",
    403: "The caller may not do this (another user's job, a virtual cluster no group grants, admins only).",
    404: "No such job, node, user, group or token (or one the caller may not see).",
    409: "It exists already, or conflicts with the current state.",
    413: "The request body is larger than the limit (APIARY_MAX_BODY_BYTES).",
    429: "Too many requests or a full queue; retry after `Retry-After` seconds.",
    500: "Apiary failed; the request may succeed later.",
    503: "A backend (the store, the disk) cannot serve right now; retry later.",
}
#: Documented on every route: errors answer ErrorBody (FastAPI's own 422 shape is never sent; a
#: malformed request is a 400 naming the field).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **{code: {"model": ErrorBody, "description": text} for code, text in _ERRORS.items()},
    # The ranges too: any other 4xx/5xx is an ErrorBody as well (and FastAPI then adds no 422).
    "4XX": {"model": ErrorBody, "description": "Any other client error."},
    "5XX": {"model": ErrorBody, "description": "Any other server error."},
}


class CiWebhookAccepted(BaseModel):
    """The CI intake's answer to a GitHub delivery (HTTP 202): ``kind`` ``pr``, ``deploy``, ``ping``
    or ``ignored``; ``duplicate`` when the delivery id, or the same body for the same event, was
    already received (nothing new started; ``reason`` names the earlier delivery of a replayed body);
    ``reason`` why it starts nothing (ignored), ``pong`` for a ping, else empty."""

    delivery: str
    event: str
    kind: str
    accepted: bool
    duplicate: bool
    reason: str


class CiDeliveryJson(BaseModel):
    """One recorded GitHub delivery (its CI record, ``ci_records``; ``record`` that record's own state);
    ``receivedAt`` unix seconds; ``state`` ``accepted``, ``started``, ``pending`` or ``failed``."""

    delivery: str
    record: str
    event: str
    action: str | None
    repo: str | None
    prNumber: int | None
    sha: str | None
    ref: str | None
    kind: str
    state: str
    flowRunId: str | None
    reason: str
    receivedAt: float


class CiDeliveriesPage(BaseModel):
    deliveries: list[CiDeliveryJson]
