"""The CI record: a GitHub delivery, the pipeline run it started and the deployment that followed, one row.

A record (``ci_records``, :class:`apiary.store.models.CiRecord`) is written first by the webhook
intake (:mod:`apiary.ci.intake`: ``received``, then ``pending``, ``not_started`` or ``started``),
then by the flows (``flows/ci.py``) through the API: the pipeline run (``POST /api/v2/ci/runs``:
``running`` while stage results come in, then ``passed`` or ``failed``) and the deployment
(``POST /api/v2/deployments``: ``deployed``, ``rolled_back`` or ``deploy_failed``). A report
naming its ``delivery`` updates that delivery's record; one without (``ci/run-pipeline``, a
forced deploy, an older flow) is matched on its flow run id, else it is a record of its own.
:class:`CiRecords` writes through the store's unit of work (nothing is kept in memory) and reads
back, newest first, in the wire shape (camelCase, times ISO 8601 UTC): the runs, the deployments
(each filtered in the store, by commit among others: the deploy gate asks for its sha) and
:meth:`CiRecords.metrics_snapshot`, what ``/metrics`` renders
(:class:`apiary.monitoring.ci_metrics.CiCollector`), computed from the table at scrape time with
bounded queries, so a restarted control plane exports the same values.

The API validates every field first (:mod:`apiary.api.routers.ci_records`); this module clips
every string again to its column (no NUL, no lone surrogate, at most the column's length), so a
caller that skips the API cannot bloat the store or break a PostgreSQL statement either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from apiary.errors import ConflictError
from apiary.store.models import CiRecord
from apiary.store.unit import Sessions, UnitOfWork, reading
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

RUN_KINDS = ("pr", "deploy")
RUN_RESULTS = ("running", "success", "failure", "error")
FINISHED_RESULTS = ("success", "failure", "error")
STAGE_STATES = ("passed", "failed", "skipped", "error", "running")
DEPLOY_TRIGGERS = ("push", "rollback", "manual")
DEPLOY_RESULTS = ("succeeded", "rolled_back", "failed")
#: A record's states, in the order they advance (see :class:`apiary.store.models.CiRecord`).
STATES = ("received", "pending", "not_started", "started", "running", "passed", "failed", "deployed",
          "rolled_back", "deploy_failed")
#: The state a pipeline result, and a deployment result, moves a record to.
RUN_STATE = {"running": "running", "success": "passed", "failure": "failed", "error": "failed"}
DEPLOY_STATE = {"succeeded": "deployed", "rolled_back": "rolled_back", "failed": "deploy_failed"}

#: Bounds of what one record may hold (the API refuses more; the store clips to them).
MAX_STAGES = 100
MAX_STEPS = 100
MAX_IMAGES = 16
MAX_REASON = 4000
MAX_SUMMARY = 2000
MAX_IMAGE = 500
MAX_URL = 2048
#: The newest finished runs ``apiary_ci_stage_duration_seconds`` is computed over, and the most
#: distinct stage names (label values) and repositories it exports.
METRICS_WINDOW_RUNS = 500
METRICS_MAX_STAGES = 100
METRICS_MAX_REPOS = 1000


def clip(value: object, limit: int) -> str | None:
    """``value`` as storable text (no NUL: PostgreSQL text cannot hold one), at most ``limit`` characters."""
    if value is None:
        return None
    return str(value).replace("\x00", "")[:limit]


def _text(value: object, limit: int) -> str | None:
    """``value`` as storable text: :func:`clip` (no NUL, at most ``limit``
    characters), and a lone surrogate replaced (neither SQLite nor PostgreSQL take one)."""
    clipped = clip(value, limit)
    if clipped is None or clipped.isascii():
        return clipped
    return clipped.encode("utf-8", "replace").decode("utf-8")


def _str(value: object, limit: int) -> str:
    return _text(value, limit) or ""


def _seconds(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _stage(stage: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": _str(stage.get("name"), 100), "state": _str(stage.get("state"), 16),
            "durationS": _seconds(stage.get("durationS")), "summary": _str(stage.get("summary"), MAX_SUMMARY)}


def _step(step: Mapping[str, Any]) -> dict[str, Any]:
    return {"component": _str(step.get("component"), 64), "image": _str(step.get("image"), MAX_IMAGE),
            "gate": _str(step.get("gate"), 200), "ok": bool(step.get("ok")),
            "detail": _str(step.get("detail"), MAX_SUMMARY), "durationS": _seconds(step.get("durationS"))}


def _images(images: Mapping[str, Any] | None) -> dict[str, str] | None:
    if images is None:
        return None
    return {_str(k, 64): _str(v, MAX_IMAGE) for k, v in list(images.items())[:MAX_IMAGES]}


def _duration(given: object, started: float, finished: float | None) -> float | None:
    if given is not None:
        return float(given)  # type: ignore[arg-type]
    return None if finished is None else max(0.0, finished - started)


class CiRecords:
    """CI records in ``sessions``' store. Every method is one short transaction (writes through
    :class:`~apiary.store.unit.UnitOfWork`: a store failure is a ConflictError 409 or an
    UnavailableError 503) and blocks; nothing is cached."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    # ------------------------------------------------------------------ pipeline runs
    def record_run(self, run: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Record one pipeline run, given in the wire shape with times as unix seconds, on its
        ``delivery``'s record (when given and known) or the record with its ``flowRunId``, else on
        a new record; returns the run as stored and whether the record is new. Idempotent: the same
        run posted twice is one record. Two first posts of one run racing: the loser updates the
        winner's record. The record's state becomes the result's (``running``, ``passed``,
        ``failed``) unless it holds a deployment already."""
        started = float(run["startedAt"])
        finished = _seconds(run.get("finishedAt"))
        flow_run, result = _str(run["flowRunId"], 64), _str(run["result"], 16)
        values: dict[str, Any] = {
            "flow_run_id": flow_run, "repo": _str(run["repo"], 200),
            "pr_number": run.get("prNumber"), "sha": _str(run["sha"], 64).lower(), "ref": _str(run["ref"], 300),
            "kind": _str(run["kind"], 16), "result": result,
            "failed_stage": _text(run.get("failedStage"), 100), "reason": _text(run.get("reason"), MAX_REASON),
            "started_at": started, "finished_at": finished,
            "duration_s": _duration(run.get("durationS"), started, finished),
            "stages": [_stage(s) for s in list(run.get("stages") or ())[:MAX_STAGES]],
            "target_url": _text(run.get("targetUrl"), MAX_URL),
        }
        delivery = _text(run.get("delivery"), 64)

        def find(s: Session) -> CiRecord | None:
            return _by(s, CiRecord.delivery, delivery) or _by(s, CiRecord.flow_run_id, flow_run)

        def apply(row: CiRecord) -> None:
            for name, value in values.items():
                setattr(row, name, value)
            if row.delivery is None and row.id is None:
                row.delivery = delivery  # a delivery this store never received: its reports still join
            if row.deploy_result is None:
                row.state = RUN_STATE.get(result, "running")

        return self._upsert(find, apply, "ci run", _run_json)

    def _upsert(self, find: Callable[[Session], CiRecord | None], apply: Callable[[CiRecord], None],
                what: str, to_json: Callable[[CiRecord], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        """Apply a report to the record ``find`` returns, or to a new one (``apply`` sees it before
        its first flush: ``id`` None), in one unit of work; retried once when a concurrent first
        report won the insert."""
        for attempt in (1, 2):
            try:
                with UnitOfWork(self.sessions, f"record the {what}") as uow:
                    row = find(uow.s)
                    created = row is None
                    if row is None:
                        row = CiRecord(kind="deploy", state="received", delivery_reason="", stages=[])
                        uow.s.add(row)
                    apply(row)
                    uow.flush()
                    record = to_json(row)
            except ConflictError:
                if attempt == 2:
                    raise
                continue
            logger.info("%s recorded: id=%s flow_run=%s sha=%s result=%s created=%s", what, record["id"],
                        record["flowRunId"], record["sha"], record["result"], created)
            return record, created
        raise AssertionError("unreachable")

    def runs(self, limit: int = 50, *, repo: str | None = None, result: str | None = None,
             kind: str | None = None, sha: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` pipeline runs (by start, then id), newest first, filtered by
        whichever of ``repo``, ``result``, ``kind`` and ``sha`` (a prefix: a short sha; hex digits
        only, checked by the API) are given."""
        query = select(CiRecord).where(CiRecord.result.is_not(None))
        if repo:
            query = query.where(CiRecord.repo == repo)
        if result:
            query = query.where(CiRecord.result == result)
        if kind:
            query = query.where(CiRecord.kind == kind)
        if sha:
            query = query.where(_sha_prefix(sha))
        with reading(self.sessions, "read the ci runs") as s:
            rows = s.scalars(query.order_by(CiRecord.started_at.desc(), CiRecord.id.desc()).limit(limit)).all()
            return [_run_json(r) for r in rows]

    # ------------------------------------------------------------------ whole records
    def records(self, limit: int = 50, *, sha: str | None = None, state: str | None = None,
                delivery: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` CI records (by id: the order they began in), newest first, whole:
        ``{"id", "state", "kind", "repo", "prNumber", "sha", "ref", "delivery": {...} | None,
        "run": <a run> | None, "deployment": <a deployment> | None}``; filtered by ``sha`` (a
        prefix), ``state`` and ``delivery`` when given."""
        query = select(CiRecord)
        if sha:
            query = query.where(_sha_prefix(sha))
        if state:
            query = query.where(CiRecord.state == state)
        if delivery:
            query = query.where(CiRecord.delivery == delivery)
        with reading(self.sessions, "read the ci records") as s:
            rows = s.scalars(query.order_by(CiRecord.id.desc()).limit(limit)).all()
            return [_record_json(r) for r in rows]

    # ------------------------------------------------------------------ deployments
    def record_deployment(self, deployment: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Record one deployment (wire shape, times as unix seconds) on its ``delivery``'s record,
        or the record whose deployment, delivery or pipeline has its ``flowRunId`` (a retried flow
        reports once), else on a new record; returns the deployment as stored and whether the
        record is new. A record holds one deployment: a second one of another flow run is a record
        of its own. The record's state becomes ``deployed``, ``rolled_back`` or ``deploy_failed``."""
        started, finished = float(deployment["startedAt"]), float(deployment["finishedAt"])
        flow_run, result = _text(deployment.get("flowRunId"), 64), _str(deployment["result"], 16)
        values: dict[str, Any] = {
            "sha": _str(deployment["sha"], 64).lower(), "images": _images(deployment["images"]) or {},
            "previous_images": _images(deployment.get("previousImages")), "actor": _str(deployment["actor"], 200),
            "trigger": _str(deployment["trigger"], 16), "deploy_started_at": started, "deploy_finished_at": finished,
            "deploy_duration_s": _duration(deployment.get("durationS"), started, finished),
            "deploy_result": result,
            "deploy_reason": _text(deployment.get("reason"), MAX_REASON),
            "steps": [_step(s) for s in list(deployment.get("steps") or ())[:MAX_STEPS]],
            "deploy_flow_run_id": flow_run,
        }
        delivery = _text(deployment.get("delivery"), 64)

        taken = False  # the delivery's record holds another flow run's deployment

        def find(s: Session) -> CiRecord | None:
            nonlocal taken
            row = _by(s, CiRecord.deploy_flow_run_id, flow_run)
            if row is None:
                row = (_by(s, CiRecord.delivery, delivery) or _by(s, CiRecord.started_flow_run_id, flow_run)
                       or _by(s, CiRecord.flow_run_id, flow_run))
                if row is not None and row.deploy_result is not None:
                    taken = row.delivery is not None and row.delivery == delivery
                    return None  # it holds another flow run's deployment: a record of its own
            return row

        def apply(row: CiRecord) -> None:
            for name, value in values.items():
                setattr(row, name, value)
            if row.id is None and not taken:
                row.delivery = delivery
            row.state = DEPLOY_STATE.get(result, "deploy_failed")

        return self._upsert(find, apply, "deployment", _deployment_json)

    def deployments(self, limit: int = 50, *, sha: str | None = None,
                    result: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` deployments, newest first; ``sha``: those whose commit starts with
        it (a short sha; hex digits only, checked by the API)."""
        query = select(CiRecord).where(CiRecord.deploy_result.is_not(None))
        if sha:
            query = query.where(_sha_prefix(sha))
        if result:
            query = query.where(CiRecord.deploy_result == result)
        with reading(self.sessions, "read the deployments") as s:
            rows = s.scalars(
                query.order_by(CiRecord.deploy_started_at.desc(), CiRecord.id.desc()).limit(limit)).all()
            return [_deployment_json(r) for r in rows]

    # ------------------------------------------------------------------ metrics
    def metrics_snapshot(self) -> dict[str, Any]:
        """What :class:`~apiary.monitoring.ci_metrics.CiCollector` renders, from the table now:

        ``stage_durations``: ``[(stage, seconds)]`` of the stages (with a duration, not skipped or
        running) of the newest :data:`METRICS_WINDOW_RUNS` finished runs; ``runs``: ``{result: n}``
        finished runs; ``default_branch``: ``{repo: succeeded}`` of each repository's newest finished
        ``deploy`` run; ``deploys``: ``{result: n}``; ``rollbacks``: deployments that rolled
        production back (``result`` rolled_back, or ``trigger`` rollback); ``last_deploy_duration``:
        the newest deployment's seconds; ``last_deploy_success_at``: the end of the newest succeeded one."""
        finished = CiRecord.result.in_(FINISHED_RESULTS)
        deployed = CiRecord.deploy_result.is_not(None)
        with reading(self.sessions, "read the ci metrics") as s:
            window = s.scalars(
                select(CiRecord.stages).where(finished)
                .order_by(CiRecord.started_at.desc(), CiRecord.id.desc()).limit(METRICS_WINDOW_RUNS)).all()
            runs = dict(s.execute(select(CiRecord.result, func.count()).where(finished).group_by(CiRecord.result))
                        .tuples().all())
            ranked = (
                select(CiRecord.repo, CiRecord.result, func.row_number().over(
                    partition_by=CiRecord.repo, order_by=(CiRecord.started_at.desc(), CiRecord.id.desc())).label("n"))
                .where(finished, CiRecord.kind == "deploy").subquery())
            latest = s.execute(
                select(ranked.c.repo, ranked.c.result).where(ranked.c.n == 1)
                .order_by(ranked.c.repo).limit(METRICS_MAX_REPOS)).tuples().all()
            deploys = dict(s.execute(select(CiRecord.deploy_result, func.count()).where(deployed)
                                     .group_by(CiRecord.deploy_result)).tuples().all())
            rollbacks = s.scalar(select(func.count()).select_from(CiRecord).where(deployed, or_(
                CiRecord.deploy_result == "rolled_back", CiRecord.trigger == "rollback"))) or 0
            last_duration = s.scalar(
                select(CiRecord.deploy_duration_s).where(deployed)
                .order_by(CiRecord.deploy_started_at.desc(), CiRecord.id.desc()).limit(1))
            last_success = s.scalar(
                select(func.max(CiRecord.deploy_finished_at)).where(CiRecord.deploy_result == "succeeded"))
        durations = [(str(st.get("name", "")), float(st["durationS"])) for stages in window for st in stages or ()
                     if isinstance(st, dict) and st.get("durationS") is not None
                     and st.get("state") not in ("skipped", "running")]
        return {
            "stage_durations": durations,
            "runs": {r: int(runs.get(r, 0)) for r in FINISHED_RESULTS},
            "default_branch": {repo: result == "success" for repo, result in latest},
            "deploys": {r: int(deploys.get(r, 0)) for r in DEPLOY_RESULTS},
            "rollbacks": int(rollbacks),
            "last_deploy_duration": last_duration,
            "last_deploy_success_at": last_success,
        }


def _by(s: Session, column: Any, value: str | None) -> CiRecord | None:
    """The record whose ``column`` is ``value`` (None: none)."""
    if value is None:
        return None
    return s.scalars(select(CiRecord).where(column == value).limit(1)).first()


def _sha_prefix(sha: str) -> ColumnElement[bool]:
    return CiRecord.sha.startswith(sha.lower(), autoescape=True)


def _run_json(r: CiRecord) -> dict[str, Any]:
    return {"id": r.id, "flowRunId": r.flow_run_id, "repo": r.repo, "prNumber": r.pr_number, "sha": r.sha,
            "ref": r.ref, "kind": r.kind, "result": r.result, "failedStage": r.failed_stage, "reason": r.reason,
            "startedAt": iso(r.started_at), "finishedAt": iso(r.finished_at), "durationS": r.duration_s,
            "stages": list(r.stages or []), "targetUrl": r.target_url}


def _deployment_json(d: CiRecord) -> dict[str, Any]:
    return {"id": d.id, "sha": d.sha, "images": dict(d.images or {}),
            "previousImages": None if d.previous_images is None else dict(d.previous_images), "actor": d.actor,
            "trigger": d.trigger, "startedAt": iso(d.deploy_started_at), "finishedAt": iso(d.deploy_finished_at),
            "durationS": d.deploy_duration_s, "result": d.deploy_result, "reason": d.deploy_reason,
            "steps": list(d.steps or []), "flowRunId": d.deploy_flow_run_id}


def _record_json(r: CiRecord) -> dict[str, Any]:
    delivery = None if r.delivery is None else {
        "delivery": r.delivery, "event": r.event, "action": r.action, "receivedAt": iso(r.received_at),
        "flowRunId": r.started_flow_run_id, "reason": r.delivery_reason or ""}
    return {"id": r.id, "state": r.state, "kind": r.kind, "repo": r.repo, "prNumber": r.pr_number, "sha": r.sha,
            "ref": r.ref, "delivery": delivery, "run": None if r.result is None else _run_json(r),
            "deployment": None if r.deploy_result is None else _deployment_json(r)}
