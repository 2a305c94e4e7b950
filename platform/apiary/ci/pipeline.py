"""The ``platform-ci`` pipeline: its stages, what each needs, how a failure stops what depends on it,
and the report (AI-System 7.6.4: push -> webhook -> tests -> image -> registry -> integration,
stress and chaos tests on a test cluster -> deployment; any failure sends the developer back).

No Prefect here: :func:`run_pipeline` runs the stages through a ``runner`` hook. The Prefect flow
(flows/ci.py) passes one that makes each stage a task run named after it, with its own logs and
a result artifact; the tests pass none and the stages run as plain calls.

=============  ==================  ==========================================================
stage          needs               what (implementation: :mod:`apiary.ci.stages`)
=============  ==================  ==========================================================
checkout       -                   the commit from the repository into a clean workspace
unit           checkout            ``make lint test-fast`` in the workspace, JUnit XML kept
image          unit                Apiary's images from the workspace, tagged with the sha, pushed
staging        image               a staging platform from those images (torn down at the end)
integration    staging             tests/staging (Lab 6 scenarios included) against staging
load           integration         the Locust smoke profile and its gates against staging
chaos          integration         the chaos experiments for CI, judged from their journals
regression     unit                the quick scheduler benchmark, paired with the base commit
report         (always)            the summary table and the commit status
=============  ==================  ==========================================================

A stage passes by returning, fails by raising :class:`StageFailed` (a verdict: tests failed, a
gate missed) and errors by raising anything else (the pipeline could not judge). Either way the
stages that need it, directly or not, are ``skipped`` and the report names the first stage that
did not pass and why. Clean-ups a stage registers (:meth:`CiContext.defer`, e.g. the staging
platform's teardown) run after the last stage before the report, whatever happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from apiary.timefmt import iso

logger = logging.getLogger(__name__)

StageState = Literal["passed", "failed", "skipped", "error"]


@dataclass(frozen=True)
class StageSpec:
    """One stage: its ``name`` (also the Prefect task run's), the stages it ``needs``, and whether it
    runs ``always`` (the report: even after failures)."""

    name: str
    needs: tuple[str, ...] = ()
    always: bool = False


#: The stages in order (the table in the module docstring).
STAGES: tuple[StageSpec, ...] = (
    StageSpec("checkout"),
    StageSpec("unit", ("checkout",)),
    StageSpec("image", ("unit",)),
    StageSpec("staging", ("image",)),
    StageSpec("integration", ("staging",)),
    StageSpec("load", ("integration",)),
    StageSpec("chaos", ("integration",)),
    StageSpec("regression", ("unit",)),
    StageSpec("report", always=True),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


class StageFailed(Exception):
    """A stage's verdict is "failed" (tests failed, a gate missed): ``summary`` says why, in one line."""

    def __init__(self, summary: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(summary)
        self.summary = summary
        self.details = details or {}


@dataclass
class StageOutcome:
    """How one stage went: ``state``, ``duration_s`` (wall seconds), one-line ``summary`` and
    ``details`` (JSON-ready, stage-specific)."""

    name: str
    state: StageState
    duration_s: float = 0.0
    summary: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The report table's row: ``stage``, ``state``, ``duration_s``, ``summary``."""
        return {"stage": self.name, "state": self.state, "duration_s": round(self.duration_s, 1),
                "summary": self.summary}


@dataclass(frozen=True)
class Commit:
    """What the pipeline tests: ``repo`` (owner/name), ``clone_url``, ``sha`` (40 hex), ``ref``
    (branch), ``pr_number`` (None for the default branch), ``kind`` (``pr`` or ``deploy``),
    ``base_ref``: the branch a pull request merges into ("": none known; the regression stage then
    compares with the commit's first parent)."""

    repo: str
    clone_url: str
    sha: str
    ref: str = ""
    pr_number: int | None = None
    kind: str = "pr"
    sender: str = ""
    base_ref: str = ""

    @property
    def short(self) -> str:
        return self.sha[:8]

    def run_name(self) -> str:
        """The flow run's name: repository, PR and short sha (``acme/apiary-pr7-1a2b3c4d``)."""
        where = f"pr{self.pr_number}" if self.pr_number is not None else (self.ref or "push")
        return f"{self.repo}-{where}-{self.short}"

    @classmethod
    def from_request(cls, request: dict[str, Any]) -> Commit:
        """From :meth:`apiary.ci.webhooks.PipelineRequest.parameters`; raises KeyError naming a missing field."""
        return cls(repo=str(request["repo"]), clone_url=str(request["clone_url"]), sha=str(request["sha"]),
                   ref=str(request.get("ref") or ""), pr_number=request.get("pr_number"),
                   kind=str(request.get("kind") or "pr"), sender=str(request.get("sender") or ""),
                   base_ref=str(request.get("base_ref") or "") if request.get("pr_number") is not None else "")


@dataclass
class CiContext:
    """What the stages share: the ``commit``, the ``config`` (:class:`apiary.ci.config.CiConfig`),
    the ``workspace`` (the checkout) and ``artifacts`` folders, ``data`` the stages hand on (the
    images, the staging platform), and the clean-ups to run at the end."""

    commit: Commit
    config: Any
    workspace: Path
    artifacts: Path
    data: dict[str, Any] = field(default_factory=dict)
    log: logging.Logger | logging.LoggerAdapter = field(default_factory=lambda: logger)
    cleanups: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    flow_run_id: str | None = None
    target_url: str | None = None

    def defer(self, what: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` after the last stage (before the report), whatever happened; ``what`` names it in logs."""
        self.cleanups.append((what, fn))


@dataclass
class PipelineReport:
    """The pipeline's result: ``outcomes`` in stage order (skipped ones included), ``passed``,
    ``failed_stage`` and ``reason`` (the first stage that did not pass and its summary), times."""

    commit: Commit
    outcomes: list[StageOutcome]
    started_at: float
    finished_at: float
    flow_run_id: str | None = None
    target_url: str | None = None

    @property
    def passed(self) -> bool:
        return all(o.state in ("passed", "skipped") for o in self.outcomes) and not self.first_failure

    @property
    def first_failure(self) -> StageOutcome | None:
        return next((o for o in self.outcomes if o.state in ("failed", "error")), None)

    @property
    def result(self) -> Literal["success", "failure", "error"]:
        """``success``; ``failure`` when a stage failed its verdict; ``error`` when one could not run."""
        bad = self.first_failure
        if bad is None:
            return "success"
        return "failure" if bad.state == "failed" else "error"

    def rows(self) -> list[dict[str, Any]]:
        return [o.row() for o in self.outcomes]

    def stage(self, name: str) -> StageOutcome:
        return next(o for o in self.outcomes if o.name == name)

    def description(self) -> str:
        """One line for the commit status (GitHub caps it at 140 characters)."""
        bad = self.first_failure
        took = self.finished_at - self.started_at
        if bad is None:
            ran = sum(o.state == "passed" for o in self.outcomes)
            return f"all {ran} stages passed in {took:.0f} s"[:140]
        return f"{bad.name} {bad.state}: {bad.summary}"[:140]

    def markdown(self) -> str:
        """The report as Markdown: a heading with the verdict and the stage table."""
        verdict = "passed" if self.passed else f"FAILED at {self.first_failure.name}"  # type: ignore[union-attr]
        lines = [f"# platform-ci {self.commit.run_name()}: {verdict}", "",
                 f"commit `{self.commit.sha}` ({self.commit.repo}, {self.commit.ref or '-'})", "",
                 "| stage | state | seconds | summary |", "|---|---|---|---|"]
        for o in self.outcomes:
            summary = o.summary.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {o.name} | {o.state} | {o.duration_s:.1f} | {summary} |")
        return "\n".join(lines) + "\n"

    def record(self) -> dict[str, Any]:
        """The ``POST /api/v2/ci/runs`` body (camelCase; times ISO-8601 UTC)."""
        bad = self.first_failure
        return {
            "flowRunId": self.flow_run_id or f"local-{self.commit.sha[:12]}-{int(self.started_at)}",
            "repo": self.commit.repo, "prNumber": self.commit.pr_number, "sha": self.commit.sha,
            "ref": self.commit.ref or "-", "kind": self.commit.kind, "result": self.result,
            "failedStage": bad.name if bad else None, "reason": bad.summary[:2000] if bad else None,
            "startedAt": iso(self.started_at), "finishedAt": iso(self.finished_at),
            "durationS": round(self.finished_at - self.started_at, 3),
            "stages": [{"name": o.name, "state": o.state, "durationS": round(o.duration_s, 3),
                        "summary": o.summary[:500]} for o in self.outcomes],
            "targetUrl": self.target_url,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"commit": asdict(self.commit), "passed": self.passed, "result": self.result,
                "failedStage": self.first_failure.name if self.first_failure else None,
                "reason": self.first_failure.summary if self.first_failure else None,
                "stages": [asdict(o) for o in self.outcomes], "startedAt": self.started_at,
                "finishedAt": self.finished_at, "flowRunId": self.flow_run_id, "targetUrl": self.target_url}


Stage = Callable[[CiContext], "str | StageOutcome | None"]
#: ``runner(name, call)`` runs one stage's ``call`` (which never raises: it returns the outcome).
Runner = Callable[[str, Callable[[], StageOutcome]], StageOutcome]


def direct_runner(name: str, call: Callable[[], StageOutcome]) -> StageOutcome:
    """Runs the stage as a plain call (no Prefect)."""
    return call()


def run_stage(name: str, fn: Stage, ctx: CiContext, clock: Callable[[], float] = time.monotonic) -> StageOutcome:
    """Call ``fn(ctx)`` and turn what happens into a :class:`StageOutcome`: a return is ``passed``
    (a string return is the summary), :class:`StageFailed` is ``failed``, anything else ``error``
    with the exception named. Never raises (except KeyboardInterrupt/SystemExit)."""
    t0 = clock()
    try:
        got = fn(ctx)
    except StageFailed as exc:
        ctx.log.error("stage %s failed: %s", name, exc.summary)
        return StageOutcome(name, "failed", clock() - t0, exc.summary, exc.details)
    except Exception as exc:  # the stage could not judge: an error, not a verdict
        ctx.log.exception("stage %s errored", name)
        return StageOutcome(name, "error", clock() - t0, f"{type(exc).__name__}: {exc}"[:2000])
    took = clock() - t0
    if isinstance(got, StageOutcome):
        got.duration_s = took
        return got
    return StageOutcome(name, "passed", took, got or "ok")


def blocked_by(spec: StageSpec, outcomes: dict[str, StageOutcome]) -> str | None:
    """The first stage ``spec`` needs that did not pass (None: it may run). Pure."""
    for need in spec.needs:
        got = outcomes.get(need)
        if got is None or got.state != "passed":
            return need
    return None


def run_pipeline(ctx: CiContext, stages: dict[str, Stage], *, runner: Runner = direct_runner,
                 specs: Iterable[StageSpec] = STAGES, clock: Callable[[], float] = time.time) -> PipelineReport:
    """Run ``specs`` in order with the implementations in ``stages`` (name -> callable; a name
    without one errors), each through ``runner``; skip a stage whose needs did not pass; run the
    context's clean-ups after the last non-``always`` stage; then the ``always`` stages (the report,
    which finds the report so far in ``ctx.data["report"]``). Returns the report; never raises for
    a failing stage."""
    started = clock()
    outcomes: dict[str, StageOutcome] = {}
    ordered: list[StageOutcome] = []
    specs = list(specs)

    def missing(c: CiContext) -> None:
        raise NotImplementedError("no implementation for this stage")

    def one(spec: StageSpec) -> None:
        fn = stages.get(spec.name, missing)
        outcome = runner(spec.name, lambda: run_stage(spec.name, fn, ctx))
        outcomes[spec.name] = outcome
        ordered.append(outcome)

    for spec in (s for s in specs if not s.always):
        need = blocked_by(spec, outcomes)
        if need is not None:
            why = outcomes[need].state if need in outcomes else "not run"
            skipped = StageOutcome(spec.name, "skipped", 0.0, f"needs {need}, which {why}")
            outcomes[spec.name] = skipped
            ordered.append(skipped)
            ctx.log.info("stage %s skipped: %s", spec.name, skipped.summary)
            continue
        one(spec)
    for what, fn in reversed(ctx.cleanups):
        try:
            fn()
            ctx.log.info("clean-up done: %s", what)
        except Exception:  # a failed clean-up must not hide the verdict; it is logged
            ctx.log.exception("clean-up failed: %s", what)
    ctx.cleanups.clear()
    report = PipelineReport(ctx.commit, ordered, started, clock(), ctx.flow_run_id, ctx.target_url)
    for spec in (s for s in specs if s.always):
        ctx.data["report"] = report
        one(spec)
        report.finished_at = clock()
    return report
