"""Jenkins' entry points into the CI/CD Prefect flows: ``ci/run-pipeline`` and ``ci/deploy``.

Both scripts are thin wrappers over :func:`main`. One call:

1. builds the :class:`~apiary.ci.webhooks.PipelineRequest` a GitHub delivery would have made
   (kind ``pr`` for ``platform-ci/pr``, ``deploy`` for ``platform-deploy/main``) from the flags;
2. creates a flow run of the deployment (``PREFECT_API_URL``; delivery ``jenkins-<BUILD_TAG>``)
   and prints its id and UI URL;
3. streams the run's flow and task logs as they arrive (:class:`LogTail`) until the run is final
   or ``--timeout`` passes;
4. prints the stage table (:func:`stage_table`: every stage, ``skipped`` for one without a task
   run), writes it as JSON with ``--stages-file``, and copies the run's files
   (``$APIARY_CI_ARTIFACTS/<flow_run_id>/``) into ``--artifacts/<flow_run_id>/`` for Jenkins.

Exit codes (:data:`EXIT_PASSED`, :data:`EXIT_FAILED`, :data:`EXIT_UNUSABLE`): 0 the flow run
ended Completed; 1 it ended otherwise (Failed, Crashed, Cancelled) or did not end within
``--timeout``; 2 nothing could be run or followed: a usage error, no ``PREFECT_API_URL``, Prefect
unreachable or refusing, the deployment missing (the message says which).

The pieces (:func:`stage_table`, :func:`exit_code`, :func:`copy_artifacts`, :class:`LogTail`,
:func:`run`) take their client, clock and output as arguments so tests drive them with fakes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, TextIO

from apiary.ci.starter import DEFAULT_DEPLOY_DEPLOYMENT, DEFAULT_PR_DEPLOYMENT
from apiary.ci.webhooks import PipelineRequest

logger = logging.getLogger(__name__)

#: platform-ci's stages, in order: each is a task run named exactly so (flows/ci.py).
CI_STAGES = ("checkout", "unit", "image", "staging", "integration", "load", "chaos", "regression", "report")
#: platform-deploy's steps, in order (``ci`` is absent when the deploy did not run CI; the
#: ``rollback-*`` steps run only after a failed gate, in reverse order).
DEPLOY_STEPS = ("ci", "control-plane", "agent", "bridge", "canary", "rollback-bridge", "rollback-agent",
                "rollback-control-plane")
#: The table artifact platform-ci creates: rows ``{"stage", "state", "duration_s", "summary"}``.
REPORT_ARTIFACT_KEY = "ci-report"

EXIT_PASSED = 0
EXIT_FAILED = 1  # the flow run ended other than Completed, or did not end within --timeout
EXIT_UNUSABLE = 2  # usage error, Prefect unreachable or refusing, deployment missing

DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_POLL_S = 2.0
#: Prefect ships logs in batches (every 2 s by default, PREFECT_LOGGING_TO_API_BATCH_INTERVAL), so
#: a log can arrive after one with a later timestamp, and after the run's final state: each poll
#: looks back this far behind the newest log seen. After the final state the tail keeps polling
#: until no log has come for LOG_QUIET_S (two batch intervals: a batch in flight when the state
#: turned final lands within one), at most LOG_DRAIN_S.
LOG_LOOKBACK_S = 15.0
LOG_QUIET_S = 4.0
LOG_DRAIN_S = 15.0
#: Prefect unreachable for this long while following a run is exit 2 (a blip is retried).
UNREACHABLE_GRACE_S = 120.0
_SHA = re.compile(r"^[0-9a-fA-F]{40}$")
_REPO_IN_URL = re.compile(r"[:/]([^/:]+/[^/]+?)(?:\.git)?/*$")


class CannotRun(Exception):
    """Nothing could be run or followed (exit 2); the message says why and what to do."""


@dataclass(frozen=True)
class EntryPoint:
    """What one script runs: the default deployment, the request ``kind`` and the stage names."""

    prog: str
    kind: Literal["pr", "deploy"]
    deployment: str
    stages: tuple[str, ...]
    noun: str  # "stage" or "step", in messages
    #: other task run names a stage goes by: platform-deploy runs CI as a platform-ci subflow, whose
    #: tracking task run in the parent is named after the flow (Prefect's ``platform-ci-<n>``)
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


RUN_PIPELINE = EntryPoint("run-pipeline", "pr", DEFAULT_PR_DEPLOYMENT, CI_STAGES, "stage")
DEPLOY = EntryPoint("deploy", "deploy", DEFAULT_DEPLOY_DEPLOYMENT, DEPLOY_STEPS, "step",
                    aliases={"ci": ("platform-ci",)})


# --- the stage table -------------------------------------------------------------------------------------

#: A task run's state type -> the stage's result. A stage with no task run is "skipped".
_RESULTS = {
    "COMPLETED": "passed",
    "FAILED": "failed",
    "CRASHED": "failed",
    "CANCELLED": "cancelled",
    "CANCELLING": "cancelled",
    "RUNNING": "running",
    "PENDING": "pending",
    "SCHEDULED": "pending",
    "PAUSED": "pending",
}


@dataclass(frozen=True)
class StageRow:
    """One stage of the run. ``result``: passed, failed, skipped (no task run), cancelled, running
    or pending; ``state``: its task run's Prefect state name (None when skipped); ``duration_s``:
    its run time in seconds (None when it has none); ``summary``: the ``ci-report`` artifact's."""

    stage: str
    result: str
    state: str | None
    duration_s: float | None
    task_run_id: str | None = None
    summary: str = ""


def _state_type(state: Any) -> str | None:
    """``"COMPLETED"``... of a Prefect state (or of a fake with ``.type``), None without one."""
    if state is None:
        return None
    t = getattr(state, "type", None)
    return str(getattr(t, "value", t)).upper() if t is not None else None


def _matches(names: Sequence[str], task_run_name: str) -> bool:
    """A stage's task run is named exactly so (or an alias); Prefect's default name ``<task>-<n>`` counts too."""
    if task_run_name in names:
        return True
    prefix, _, suffix = task_run_name.rpartition("-")
    return prefix in names and suffix.isdigit()


def _duration_s(task_run: Any) -> float | None:
    total = getattr(task_run, "total_run_time", None)
    if isinstance(total, timedelta) and total.total_seconds() > 0:
        return round(total.total_seconds(), 1)
    start, end = getattr(task_run, "start_time", None), getattr(task_run, "end_time", None)
    if start is not None and end is not None:
        return round(max(0.0, (end - start).total_seconds()), 1)
    return None


def _started(task_run: Any) -> datetime | None:
    return getattr(task_run, "start_time", None) or getattr(task_run, "expected_start_time", None)


def stage_table(stages: Sequence[str], task_runs: Iterable[Any], report: Mapping[str, str] | None = None,
                aliases: Mapping[str, Sequence[str]] | None = None) -> list[StageRow]:
    """Every stage in order, from the flow run's task runs (objects with ``id``, ``name``, ``state``,
    ``start_time``, ``end_time``, ``total_run_time``). A stage with several task runs (a re-run)
    shows the one that started last; task runs that are no stage are left out. ``report`` maps a
    stage to its summary (the ``ci-report`` artifact); ``aliases`` a stage to other task run names."""
    runs = list(task_runs)
    rows = []
    for stage in stages:
        names = (stage, *(aliases or {}).get(stage, ()))
        mine = [tr for tr in runs if _matches(names, str(getattr(tr, "name", "")))]
        if not mine:
            rows.append(StageRow(stage, "skipped", None, None, summary=(report or {}).get(stage, "")))
            continue
        # the latest start; one never started (None) sorts first
        tr = max(mine, key=lambda r: (_started(r) is not None, _started(r) or datetime.min))
        state_type = _state_type(getattr(tr, "state", None))
        state = getattr(tr, "state", None)
        rows.append(StageRow(
            stage=stage,
            result=_RESULTS.get(state_type or "", "pending"),
            state=getattr(state, "name", None) or (state_type.title() if state_type else None),
            duration_s=_duration_s(tr),
            task_run_id=str(tr.id) if getattr(tr, "id", None) is not None else None,
            summary=(report or {}).get(stage, ""),
        ))
    return rows


def report_summaries(data: Any) -> dict[str, str]:
    """Stage -> summary from the ``ci-report`` table artifact's data: a list of row dicts (or its
    JSON text, as Prefect stores it); anything else gives {}."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError:
            return {}
    if not isinstance(data, list):
        return {}
    return {str(row["stage"]): str(row.get("summary") or "") for row in data
            if isinstance(row, dict) and "stage" in row}


def format_table(rows: Sequence[StageRow], noun: str = "stage") -> str:
    """The table printed at the end of a run: one line per stage."""
    header = (noun.upper(), "RESULT", "STATE", "DURATION", "SUMMARY")
    body = [(r.stage, r.result, r.state or "-", "-" if r.duration_s is None else f"{r.duration_s:.1f}s",
             r.summary.replace("\n", " ")) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(4)]
    return "".join(
        ("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line[:4])) + "  " + line[4]).rstrip() + "\n"
        for line in [header, *body]
    )


# --- the outcome -----------------------------------------------------------------------------------------


def exit_code(state_type: str | None, timed_out: bool = False) -> int:
    """0 for a flow run that ended Completed; 1 for any other end (Failed, Crashed, Cancelled) and
    for one that had not ended when the wait timed out."""
    if timed_out or (state_type or "").upper() != "COMPLETED":
        return EXIT_FAILED
    return EXIT_PASSED


def failed_stages(rows: Iterable[StageRow]) -> list[str]:
    return [r.stage for r in rows if r.result == "failed"]


# --- the run's files -------------------------------------------------------------------------------------


def artifacts_root(env: Mapping[str, str] | None = None) -> Path:
    """Where the flows write each run's files: ``$APIARY_CI_ARTIFACTS`` (default ``~/.apiary/ci-artifacts``)."""
    env = os.environ if env is None else env
    return Path(env.get("APIARY_CI_ARTIFACTS") or "~/.apiary/ci-artifacts").expanduser()


def copy_artifacts(root: Path, flow_run_id: str, dest: Path) -> Path | None:
    """Copy ``root/<flow_run_id>/`` to ``dest/<flow_run_id>/`` (merged into what is there); the copy's
    path, or None when the run wrote no files there (a flow that failed before writing any, or a
    Prefect worker on another machine than this Jenkins agent)."""
    src = Path(root) / flow_run_id
    if not src.is_dir():
        return None
    target = Path(dest) / flow_run_id
    shutil.copytree(src, target, dirs_exist_ok=True)
    return target


# --- the logs --------------------------------------------------------------------------------------------


class LogTail:
    """The flow run's logs (its own and its task runs'), each once, oldest first.

    Each :meth:`poll` reads ``POST /logs/filter`` for the flow run, sorted by timestamp, paging
    by timestamp (the next page starts at the last page's newest one), from ``lookback_s`` before
    the newest log seen so far: Prefect ships logs in batches, so one may arrive after a later one.
    Logs already returned are recognized by id (ids older than the look-back are forgotten).
    """

    def __init__(self, flow_run_id: str, page: int = 200, lookback_s: float = LOG_LOOKBACK_S) -> None:
        self.flow_run_id = flow_run_id
        self.page = page
        self.lookback = timedelta(seconds=lookback_s)
        self._seen: dict[Any, datetime] = {}
        self._newest: datetime | None = None

    def poll(self, client: Any) -> list[Any]:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
        from prefect.client.schemas.sorting import LogSort

        after = self._newest - self.lookback if self._newest else None
        offset = 0
        new: list[Any] = []
        while True:
            log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(self.flow_run_id)]),
                                   timestamp=LogFilterTimestamp(after_=after) if after else None)
            page = client.read_logs(log_filter=log_filter, limit=self.page, offset=offset,
                                    sort=LogSort.TIMESTAMP_ASC)
            fresh = [log for log in page if log.id not in self._seen]
            for log in fresh:
                self._seen[log.id] = log.timestamp
            new.extend(fresh)
            if len(page) < self.page:  # the last page
                break
            last = max(log.timestamp for log in page)
            if last == after:  # a whole page of one instant: step past it by offset
                offset += len(page)
            else:  # the next page starts at this one's newest (inclusive: seen ids are skipped)
                after, offset = last, 0
        if new:
            newest = max(log.timestamp for log in new)
            self._newest = max(self._newest, newest) if self._newest else newest
        if self._newest:
            horizon = self._newest - 2 * self.lookback
            self._seen = {k: ts for k, ts in self._seen.items() if ts >= horizon}
        return sorted(new, key=lambda log: log.timestamp)


def format_log(log: Any, task_names: Mapping[Any, str]) -> str:
    """``HH:MM:SS LEVEL   source | message``; the source is the task run's name or ``flow``."""
    source = task_names.get(log.task_run_id, "task") if log.task_run_id else "flow"
    ts = log.timestamp.strftime("%H:%M:%S") if log.timestamp else "--:--:--"
    return f"{ts} {logging.getLevelName(log.level):<7} {source} | {log.message}"


# --- the request -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The flags (see :func:`parser`)."""

    sha: str
    repo_url: str
    repo: str | None = None
    pr: int | None = None
    ref: str | None = None
    base_ref: str = "main"
    default_branch: str = "main"
    sender: str | None = None
    deployment: str | None = None
    artifacts: Path = Path("ci-artifacts")
    stages_file: Path | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    poll_s: float = DEFAULT_POLL_S


def repo_name(url: str) -> str | None:
    """``owner/name`` of a clone URL (``https://github.com/owner/name.git``, ``git@github.com:owner/name``)."""
    m = _REPO_IN_URL.search(url.strip())
    return m.group(1) if m else None


def build_request(entry: EntryPoint, opts: Options, env: Mapping[str, str]) -> PipelineRequest:
    """The flow run's ``request`` parameter, as the webhook intake would build it. Raises
    :class:`CannotRun` for a bad flag."""
    if not _SHA.fullmatch(opts.sha):
        raise CannotRun(f"--sha must be a full 40-hex commit id, not {opts.sha!r}")
    if not opts.repo_url.strip():
        raise CannotRun("--repo-url is empty")
    repo = opts.repo or repo_name(opts.repo_url)
    if not repo:
        raise CannotRun(f"cannot tell owner/name from --repo-url {opts.repo_url!r}: give --repo OWNER/NAME")
    if opts.pr is not None and opts.pr <= 0:
        raise CannotRun(f"--pr must be a positive pull request number, not {opts.pr}")
    if entry.kind == "deploy":
        ref = opts.ref or opts.default_branch
    else:  # GitHub's ref of a PR's head; a commit id is fetchable too
        ref = opts.ref or (f"refs/pull/{opts.pr}/head" if opts.pr else opts.sha.lower())
    sender = opts.sender or env.get("CHANGE_AUTHOR") or env.get("BUILD_USER_ID") or "jenkins"
    return PipelineRequest(
        kind=entry.kind, repo=repo, clone_url=opts.repo_url.strip(), sha=opts.sha.lower(), ref=ref,
        base_ref=opts.base_ref, default_branch=opts.default_branch, action=None, sender=sender,
        pr_number=opts.pr if entry.kind == "pr" else None,
    )


def delivery_id(env: Mapping[str, str]) -> str:
    """``jenkins-<BUILD_TAG>`` (Jenkins' ``jenkins-<job>-<build number>``), or ``jenkins-<uuid>`` outside Jenkins."""
    tag = env.get("BUILD_TAG") or uuid.uuid4().hex
    return f"jenkins-{tag}"


# --- following one run -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How a run ended: its exit code, final state (type and name), the stage rows."""

    code: int
    flow_run_id: str
    state_type: str | None
    state_name: str | None
    timed_out: bool
    rows: list[StageRow]
    url: str | None = None


def api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def flow_run_url(flow_run_id: str, api: str | None) -> str | None:
    from prefect.utilities.urls import url_for

    try:
        url = url_for("flow-run", obj_id=flow_run_id)
    except Exception:  # no UI URL configured: derived from the API's below
        url = None
    if not url and api:
        url = f"{api.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"
    return url


def _prefect_client() -> Any:
    from prefect import get_client

    return get_client(sync_client=True)


def _transient(exc: BaseException) -> bool:
    """Prefect unreachable or failing (5xx): worth another try while following a run."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    if isinstance(exc, PrefectHTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, (httpx.HTTPError, OSError))


def start_run(client: Any, deployment: str, request: PipelineRequest, delivery: str, url: str) -> Any:
    """Create the flow run; :class:`CannotRun` when Prefect is not there, refuses, or has no such deployment."""
    import httpx
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    unhealthy = client.api_healthcheck()
    if unhealthy is not None:
        raise CannotRun(f"Prefect is not reachable at PREFECT_API_URL={url}: {type(unhealthy).__name__}: {unhealthy}")
    try:
        try:
            dep = client.read_deployment_by_name(deployment)
        except ObjectNotFound as exc:
            raise CannotRun(f"Prefect deployment {deployment} does not exist at {url}: are the CI/CD flows served "
                            f"(flows/ci.py)?") from exc
        return client.create_flow_run_from_deployment(
            dep.id, parameters={"request": request.parameters(), "delivery": delivery},
            tags=["ci", "jenkins", request.kind],
        )
    except PrefectHTTPStatusError as exc:
        hint = " (PREFECT_API_AUTH_STRING or PREFECT_API_KEY?)" if exc.response.status_code in (401, 403) else ""
        raise CannotRun(f"Prefect at {url} refused to start {deployment}: HTTP {exc.response.status_code}{hint}: "
                        f"{exc.response.text[:300]}") from exc
    except (httpx.HTTPError, OSError) as exc:
        raise CannotRun(f"Prefect is not reachable at {url}: {type(exc).__name__}: {exc}") from exc


def _task_runs(client: Any, flow_run_id: str) -> list[Any]:
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    flt = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[uuid.UUID(flow_run_id)]))
    return list(client.read_task_runs(task_run_filter=flt, limit=200))


def _report(client: Any, flow_run_id: str) -> dict[str, str]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    flt = ArtifactFilter(key=ArtifactFilterKey(any_=[REPORT_ARTIFACT_KEY]),
                         flow_run_id=ArtifactFilterFlowRunId(any_=[uuid.UUID(flow_run_id)]))
    for artifact in client.read_artifacts(artifact_filter=flt, limit=5):
        summaries = report_summaries(artifact.data)
        if summaries:
            return summaries
    return {}


def follow(client: Any, entry: EntryPoint, flow_run_id: str, out: TextIO, *, timeout_s: float, poll_s: float,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Outcome:
    """Stream the run's logs to ``out`` until its state is final or ``timeout_s`` passes, then read
    its stage table. Raises :class:`CannotRun` when Prefect stays unreachable for
    :data:`UNREACHABLE_GRACE_S`."""
    tail = LogTail(flow_run_id)
    names: dict[Any, str] = {}
    deadline = clock() + timeout_s
    failing_since: float | None = None
    state: Any = None
    timed_out = False
    drain_until: float | None = None
    last_log = clock()

    def show(logs: list[Any]) -> None:
        if any(log.task_run_id and log.task_run_id not in names for log in logs):
            names.update({tr.id: tr.name for tr in _task_runs(client, flow_run_id)})
        for log in logs:
            out.write(format_log(log, names) + "\n")
        out.flush()

    while True:
        try:
            logs = tail.poll(client)
            show(logs)
            if drain_until is None:
                state = client.read_flow_run(uuid.UUID(flow_run_id)).state
            failing_since = None
        except Exception as exc:
            if not _transient(exc):
                raise
            now = clock()
            failing_since = failing_since if failing_since is not None else now
            out.write(f"{entry.prog}: Prefect did not answer ({type(exc).__name__}: {exc}); trying again\n")
            if now - failing_since > UNREACHABLE_GRACE_S:
                raise CannotRun(f"lost Prefect for more than {UNREACHABLE_GRACE_S:.0f}s while following flow run "
                                f"{flow_run_id}: {type(exc).__name__}: {exc}") from exc
            logs = []
        if logs:
            last_log = clock()
        if drain_until is not None:  # the run is over: wait for the last batch of its logs
            if clock() - last_log >= LOG_QUIET_S or clock() >= drain_until:
                break
        elif state is not None and _state_type(state) in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            drain_until = clock() + LOG_DRAIN_S
            last_log = clock()
        elif clock() >= deadline:
            timed_out = True
            break
        sleep(poll_s)

    task_runs = _task_runs(client, flow_run_id)
    try:
        report = _report(client, flow_run_id)
    except Exception as exc:  # the summaries are a nicety: the table stands without them
        logger.warning("no %s artifact for flow_run=%s: %r", REPORT_ARTIFACT_KEY, flow_run_id, exc)
        report = {}
    state_type = _state_type(state)
    return Outcome(code=exit_code(state_type, timed_out), flow_run_id=flow_run_id, state_type=state_type,
                   state_name=getattr(state, "name", None), timed_out=timed_out,
                   rows=stage_table(entry.stages, task_runs, report, entry.aliases))


def stages_json(entry: EntryPoint, deployment: str, outcome: Outcome) -> dict[str, Any]:
    """What ``--stages-file`` holds, for a Jenkins pipeline to map stages (``readJSON``)."""
    return {
        "deployment": deployment,
        "flow_run_id": outcome.flow_run_id,
        "flow_run_url": outcome.url,
        "state": outcome.state_name,
        "state_type": outcome.state_type,
        "timed_out": outcome.timed_out,
        "exit_code": outcome.code,
        "failed": failed_stages(outcome.rows),
        "noun": entry.noun,
        "stages": [asdict(r) for r in outcome.rows],
    }


def run(entry: EntryPoint, opts: Options, out: TextIO, *, env: Mapping[str, str] | None = None,
        client_factory: Callable[[], Any] = _prefect_client, api: Callable[[], str | None] = api_url,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """One entry point's whole job (module docstring); returns the exit code. Raises :class:`CannotRun`."""
    env = os.environ if env is None else env
    deployment = opts.deployment or entry.deployment
    if deployment.count("/") != 1 or deployment.startswith("/") or deployment.endswith("/"):
        raise CannotRun(f"--deployment must be FLOW/DEPLOYMENT, not {deployment!r}")
    request = build_request(entry, opts, env)
    url = api()
    if not url:
        raise CannotRun("PREFECT_API_URL is not set: point it at the Prefect server's API (http://HOST:4200/api)")
    delivery = delivery_id(env)
    with client_factory() as client:
        flow_run = start_run(client, deployment, request, delivery, url)
        flow_run_id = str(flow_run.id)
        link = flow_run_url(flow_run_id, url)
        out.write(f"{entry.prog}: {deployment}: flow run {flow_run_id} ({getattr(flow_run, 'name', '')}) for "
                  f"{request.repo}@{request.sha[:12]}" + (f" PR #{request.pr_number}" if request.pr_number else "")
                  + f", delivery {delivery}\n{entry.prog}: {link}\n")
        out.flush()
        outcome = follow(client, entry, flow_run_id, out, timeout_s=opts.timeout_s, poll_s=opts.poll_s,
                         clock=clock, sleep=sleep)
    outcome.url = link
    out.write("\n" + format_table(outcome.rows, entry.noun))
    if opts.stages_file:
        opts.stages_file.parent.mkdir(parents=True, exist_ok=True)
        opts.stages_file.write_text(json.dumps(stages_json(entry, deployment, outcome), indent=2) + "\n")
    copied = copy_artifacts(artifacts_root(env), flow_run_id, opts.artifacts)
    if copied:
        out.write(f"{entry.prog}: the run's files are in {copied}\n")
    else:
        out.write(f"{entry.prog}: no files in {artifacts_root(env) / flow_run_id} to copy (APIARY_CI_ARTIFACTS: "
                  f"is the flow's worker on this machine?)\n")
    out.write(_verdict(entry, deployment, outcome, opts.timeout_s) + "\n")
    out.flush()
    return outcome.code


def _verdict(entry: EntryPoint, deployment: str, o: Outcome, timeout_s: float) -> str:
    failed = failed_stages(o.rows)
    if o.timed_out:
        return (f"{entry.prog}: TIMEOUT: flow run {o.flow_run_id} of {deployment} had not ended after "
                f"{timeout_s:g}s (state {o.state_name or 'unknown'}); it goes on in Prefect: {o.url}")
    what = f"{entry.prog}: {deployment} flow run {o.flow_run_id} ended {o.state_name or o.state_type}"
    if o.code == EXIT_PASSED:
        return f"{what}: PASSED"
    return what + (f": FAILED {entry.noun}s: {', '.join(failed)}" if failed else ": FAILED")


# --- the command line ------------------------------------------------------------------------------------


def parser(entry: EntryPoint) -> argparse.ArgumentParser:
    what = "platform-ci (test a pull request)" if entry.kind == "pr" else "platform-deploy (deploy main)"
    p = argparse.ArgumentParser(
        prog=f"ci/{entry.prog}",
        description=f"Run Apiary's {what} Prefect flow for Jenkins: create a flow run of {entry.deployment}, stream "
                    f"its logs, wait for it, print its {entry.noun}s and copy its files. Exit 0: Completed; 1: "
                    f"Failed, Crashed, Cancelled or --timeout; 2: usage error, Prefect unreachable, deployment "
                    f"missing. Reads PREFECT_API_URL (and PREFECT_API_AUTH_STRING), APIARY_CI_ARTIFACTS, BUILD_TAG.",
    )
    p.add_argument("--sha", required=True, help="the commit to build (40 hex)")
    p.add_argument("--repo-url", required=True, help="the repository's clone URL")
    p.add_argument("--repo", help="owner/name (default: from --repo-url)")
    if entry.kind == "pr":
        p.add_argument("--pr", type=int, help="the pull request's number")
        p.add_argument("--ref", help="the head's ref (default refs/pull/N/head with --pr, else the sha)")
        p.add_argument("--base-ref", default="main", help="the PR's base branch (default main)")
    else:
        p.add_argument("--ref", help="the branch deployed (default: --default-branch)")
    p.add_argument("--default-branch", default="main", help="the repository's default branch (default main)")
    p.add_argument("--sender", help="who asked (default CHANGE_AUTHOR, BUILD_USER_ID or jenkins)")
    p.add_argument("--deployment", default=entry.deployment, help=f"FLOW/DEPLOYMENT (default {entry.deployment})")
    p.add_argument("--artifacts", type=Path, default=Path("ci-artifacts"),
                   help="copy the run's files into DIR/<flow_run_id>/ (default ci-artifacts)")
    p.add_argument("--stages-file", type=Path, help=f"write the {entry.noun} table as JSON to PATH")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for the run to end (default {DEFAULT_TIMEOUT_S:g}; then exit 1)")
    p.add_argument("--poll", type=float, default=DEFAULT_POLL_S,
                   help=f"seconds between polls of Prefect (default {DEFAULT_POLL_S:g})")
    return p


def parse(entry: EntryPoint, argv: Sequence[str]) -> Options:
    """The options of ``argv``; argparse exits 2 on a usage error."""
    p = parser(entry)
    a = p.parse_args(list(argv))
    if a.timeout <= 0 or a.poll <= 0:
        p.error("--timeout and --poll must be positive")
    return Options(
        sha=a.sha, repo_url=a.repo_url, repo=a.repo, pr=getattr(a, "pr", None), ref=a.ref,
        base_ref=getattr(a, "base_ref", a.default_branch), default_branch=a.default_branch, sender=a.sender,
        deployment=a.deployment, artifacts=a.artifacts, stages_file=a.stages_file, timeout_s=a.timeout,
        poll_s=a.poll,
    )


def main(entry: EntryPoint, argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """``ci/run-pipeline`` / ``ci/deploy``: the exit code (module docstring)."""
    out = out or sys.stdout
    opts = parse(entry, sys.argv[1:] if argv is None else argv)
    try:
        return run(entry, opts, out)
    except CannotRun as exc:
        out.flush()
        print(f"ci/{entry.prog}: error: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except Exception:  # not the pipeline's verdict (1): the entry point could not do its job
        out.flush()
        logger.exception("ci/%s failed", entry.prog)
        print(f"ci/{entry.prog}: error: unexpected failure (above); the pipeline's outcome is unknown", file=sys.stderr)
        return EXIT_UNUSABLE
