"""The record of CI pipeline runs and production deployments: what the CI/CD flows report, in the store.

The flows (``flows/ci.py``) post each pipeline run (``POST /api/v2/ci/runs``: ``running`` when it
starts, its result when it ends, upserted on the Prefect flow run id) and each deployment
(``POST /api/v2/deployments``). :class:`CiRecords` writes them to ``ci_runs`` and ``deployments``
(the truth: nothing is kept in memory) and reads them back, newest first, in the wire shape
(camelCase, times ISO 8601 UTC). :meth:`CiRecords.metrics_snapshot` is what ``/metrics`` renders
(:class:`apiary.monitoring.ci_metrics.CiCollector`), computed from the tables at scrape time with
bounded queries, so a restarted control plane exports the same values.

The API validates every field first (:mod:`apiary.api.routers.ci_records`); this module clips
every string again to its column (no NUL, no lone surrogate, at most the column's length), so a
caller that skips the API cannot bloat the store or break a PostgreSQL statement either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from apiary.ci.intake import _clip
from apiary.control.views import iso
from apiary.store.models import CiRun, Deployment

logger = logging.getLogger(__name__)

RUN_KINDS = ("pr", "deploy")
RUN_RESULTS = ("running", "success", "failure", "error")
FINISHED_RESULTS = ("success", "failure", "error")
STAGE_STATES = ("passed", "failed", "skipped", "error", "running")
DEPLOY_TRIGGERS = ("push", "rollback", "manual")
DEPLOY_RESULTS = ("succeeded", "rolled_back", "failed")

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


def _text(value: object, limit: int) -> str | None:
    """``value`` as storable text: :func:`apiary.ci.intake._clip` (no NUL, at most ``limit``
    characters), and a lone surrogate replaced (neither SQLite nor PostgreSQL take one)."""
    clipped = _clip(value, limit)
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
    """Pipeline runs and deployments in ``sessions``' store. Every method is one short transaction
    and blocks; nothing is cached."""

    def __init__(self, sessions: Callable[[], Session]) -> None:
        self.sessions = sessions

    # ------------------------------------------------------------------ pipeline runs
    def record_run(self, run: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Insert or update (on ``flowRunId``) one pipeline run, given in the wire shape with times
        as unix seconds; returns the stored record and whether it was new. Idempotent: the same run
        posted twice is one row. Two first posts of one run racing: the loser updates the winner's row."""
        started = float(run["startedAt"])
        finished = _seconds(run.get("finishedAt"))
        values = {
            "flow_run_id": _str(run["flowRunId"], 64), "repo": _str(run["repo"], 200),
            "pr_number": run.get("prNumber"), "sha": _str(run["sha"], 64).lower(), "ref": _str(run["ref"], 300),
            "kind": _str(run["kind"], 16), "result": _str(run["result"], 16),
            "failed_stage": _text(run.get("failedStage"), 100), "reason": _text(run.get("reason"), MAX_REASON),
            "started_at": started, "finished_at": finished,
            "duration_s": _duration(run.get("durationS"), started, finished),
            "stages": [_stage(s) for s in list(run.get("stages") or ())[:MAX_STAGES]],
            "target_url": _text(run.get("targetUrl"), MAX_URL),
        }
        try:
            return self._upsert(CiRun, values, _run_json, "ci run")
        except IntegrityError:
            # another request inserted this flow run between our read and our insert: update it
            return self._upsert(CiRun, values, _run_json, "ci run")

    def _upsert(self, model: Any, values: dict[str, Any], to_json: Callable[[Any], dict[str, Any]],
                what: str) -> tuple[dict[str, Any], bool]:
        """Insert ``values`` as a ``model`` row, or update the row with the same ``flow_run_id``
        (none: always insert); the stored record (``to_json``) and whether it was new."""
        with self.sessions() as session, session.begin():
            key = values["flow_run_id"]
            row = None if key is None else session.scalars(select(model).where(model.flow_run_id == key)).first()
            created = row is None
            if row is None:
                row = model(**values)
                session.add(row)
            else:
                for name, value in values.items():
                    setattr(row, name, value)
            session.flush()
            record = to_json(row)
        logger.info("%s recorded: id=%s flow_run=%s sha=%s result=%s created=%s", what, record["id"],
                    record["flowRunId"], record["sha"], record["result"], created)
        return record, created

    def runs(self, limit: int = 50, *, repo: str | None = None, result: str | None = None,
             kind: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` runs (by start, then id), newest first, filtered by whichever of
        ``repo``, ``result`` and ``kind`` are given."""
        query = select(CiRun)
        if repo:
            query = query.where(CiRun.repo == repo)
        if result:
            query = query.where(CiRun.result == result)
        if kind:
            query = query.where(CiRun.kind == kind)
        with self.sessions() as session:
            rows = session.scalars(query.order_by(CiRun.started_at.desc(), CiRun.id.desc()).limit(limit)).all()
            return [_run_json(r) for r in rows]

    # ------------------------------------------------------------------ deployments
    def record_deployment(self, deployment: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Record one deployment (wire shape, times as unix seconds); returns the stored record and
        whether it was new. With a ``flowRunId`` already recorded the report updates that row (a
        retried flow reports once), else each report is a new row."""
        started, finished = float(deployment["startedAt"]), float(deployment["finishedAt"])
        values = {
            "sha": _str(deployment["sha"], 64).lower(), "images": _images(deployment["images"]) or {},
            "previous_images": _images(deployment.get("previousImages")), "actor": _str(deployment["actor"], 200),
            "trigger": _str(deployment["trigger"], 16), "started_at": started, "finished_at": finished,
            "duration_s": _duration(deployment.get("durationS"), started, finished),
            "result": _str(deployment["result"], 16), "reason": _text(deployment.get("reason"), MAX_REASON),
            "steps": [_step(s) for s in list(deployment.get("steps") or ())[:MAX_STEPS]],
            "flow_run_id": _text(deployment.get("flowRunId"), 64),
        }
        try:
            return self._upsert(Deployment, values, _deployment_json, "deployment")
        except IntegrityError:
            if values["flow_run_id"] is None:
                raise  # no unique key to collide on: a real failure
            return self._upsert(Deployment, values, _deployment_json, "deployment")


    def deployments(self, limit: int = 50, *, sha: str | None = None,
                    result: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` deployments, newest first; ``sha``: those whose commit starts with
        it (a short sha; hex digits only, checked by the API)."""
        query = select(Deployment)
        if sha:
            query = query.where(Deployment.sha.startswith(sha.lower(), autoescape=True))
        if result:
            query = query.where(Deployment.result == result)
        with self.sessions() as session:
            rows = session.scalars(
                query.order_by(Deployment.started_at.desc(), Deployment.id.desc()).limit(limit)).all()
            return [_deployment_json(r) for r in rows]

    # ------------------------------------------------------------------ metrics
    def metrics_snapshot(self) -> dict[str, Any]:
        """What :class:`~apiary.monitoring.ci_metrics.CiCollector` renders, from the tables now:

        ``stage_durations``: ``[(stage, seconds)]`` of the stages (with a duration, not skipped or
        running) of the newest :data:`METRICS_WINDOW_RUNS` finished runs; ``runs``: ``{result: n}``
        finished runs; ``default_branch``: ``{repo: succeeded}`` of each repository's newest finished
        ``deploy`` run; ``deploys``: ``{result: n}``; ``rollbacks``: deployments that rolled
        production back (``result`` rolled_back, or ``trigger`` rollback); ``last_deploy_duration``:
        the newest deployment's seconds; ``last_deploy_success_at``: the end of the newest succeeded one."""
        finished = CiRun.result.in_(FINISHED_RESULTS)
        with self.sessions() as session:
            window = session.scalars(
                select(CiRun.stages).where(finished)
                .order_by(CiRun.started_at.desc(), CiRun.id.desc()).limit(METRICS_WINDOW_RUNS)).all()
            runs = dict(session.execute(select(CiRun.result, func.count()).where(finished).group_by(CiRun.result))
                        .tuples().all())
            ranked = (
                select(CiRun.repo, CiRun.result, func.row_number().over(
                    partition_by=CiRun.repo, order_by=(CiRun.started_at.desc(), CiRun.id.desc())).label("n"))
                .where(finished, CiRun.kind == "deploy").subquery())
            latest = session.execute(
                select(ranked.c.repo, ranked.c.result).where(ranked.c.n == 1)
                .order_by(ranked.c.repo).limit(METRICS_MAX_REPOS)).tuples().all()
            deploys = dict(session.execute(select(Deployment.result, func.count()).group_by(Deployment.result))
                           .tuples().all())
            rollbacks = session.scalar(select(func.count()).select_from(Deployment).where(
                or_(Deployment.result == "rolled_back", Deployment.trigger == "rollback"))) or 0
            last_duration = session.scalar(
                select(Deployment.duration_s).order_by(Deployment.started_at.desc(), Deployment.id.desc()).limit(1))
            last_success = session.scalar(
                select(func.max(Deployment.finished_at)).where(Deployment.result == "succeeded"))
        durations = [(str(s.get("name", "")), float(s["durationS"])) for stages in window for s in stages or ()
                     if isinstance(s, dict) and s.get("durationS") is not None
                     and s.get("state") not in ("skipped", "running")]
        return {
            "stage_durations": durations,
            "runs": {r: int(runs.get(r, 0)) for r in FINISHED_RESULTS},
            "default_branch": {repo: result == "success" for repo, result in latest},
            "deploys": {r: int(deploys.get(r, 0)) for r in DEPLOY_RESULTS},
            "rollbacks": int(rollbacks),
            "last_deploy_duration": last_duration,
            "last_deploy_success_at": last_success,
        }


def _run_json(r: CiRun) -> dict[str, Any]:
    return {"id": r.id, "flowRunId": r.flow_run_id, "repo": r.repo, "prNumber": r.pr_number, "sha": r.sha,
            "ref": r.ref, "kind": r.kind, "result": r.result, "failedStage": r.failed_stage, "reason": r.reason,
            "startedAt": iso(r.started_at), "finishedAt": iso(r.finished_at), "durationS": r.duration_s,
            "stages": list(r.stages or []), "targetUrl": r.target_url}


def _deployment_json(d: Deployment) -> dict[str, Any]:
    return {"id": d.id, "sha": d.sha, "images": dict(d.images or {}),
            "previousImages": None if d.previous_images is None else dict(d.previous_images), "actor": d.actor,
            "trigger": d.trigger, "startedAt": iso(d.started_at), "finishedAt": iso(d.finished_at),
            "durationS": d.duration_s, "result": d.result, "reason": d.reason, "steps": list(d.steps or []),
            "flowRunId": d.flow_run_id}
