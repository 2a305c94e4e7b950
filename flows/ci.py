"""Apiary's own CI/CD as Prefect flows (served by flows/serve.py as ``platform-ci/pr`` and
``platform-deploy/main``; the webhook intake and Jenkins' ci/run-pipeline start them).

Thin: the logic is :mod:`apiary.ci.run` and :mod:`apiary.ci.stages`. Here each stage becomes a task
run named after it (its logs are the stage's), with a markdown artifact of its outcome; the flow
run is named ``<repo>-pr<N>-<short sha>``, publishes the ``ci-report`` table artifact and ends
Completed when the pipeline passed, Failed (naming the stage) when not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from apiary.ci.config import CiConfig
from apiary.ci.pipeline import CiContext, Commit, PipelineReport, StageOutcome
from apiary.ci.rollout import Step
from apiary.ci.run import ci_gate, ci_pipeline, deploy_commit


class StageDidNotPass(Exception):
    """Raised in a stage's task so that its task run ends Failed; carries the outcome."""

    def __init__(self, outcome: StageOutcome) -> None:
        super().__init__(f"{outcome.name} {outcome.state}: {outcome.summary}"[:2000])
        self.outcome = outcome


@task(cache_policy=NO_CACHE, persist_result=False)
def _stage(name: str, call: Callable[[], StageOutcome]) -> StageOutcome:
    outcome = call()
    create_markdown_artifact(key=f"ci-stage-{name}", description=f"{name}: {outcome.state}",
                             markdown=f"**{name}**: {outcome.state} in {outcome.duration_s:.1f} s\n\n{outcome.summary}")
    if outcome.state != "passed":
        raise StageDidNotPass(outcome)
    return outcome


def prefect_runner(holder: dict[str, Any]) -> Callable[[str, Callable[[], StageOutcome]], StageOutcome]:
    """A runner for :func:`apiary.ci.pipeline.run_pipeline`: each stage a task run named after it,
    whose logs are the stage's (``holder["ctx"]``, the pipeline's context, logs to the task run's
    logger while the stage runs). The context reaches the task only through a closure: as a task
    parameter Prefect would walk (and could copy) it."""

    def run(name: str, call: Callable[[], StageOutcome]) -> StageOutcome:
        ctx: CiContext | None = holder.get("ctx")

        def logged() -> StageOutcome:
            if ctx is None:
                return call()
            outer, ctx.log = ctx.log, get_run_logger()  # type: ignore[assignment]
            try:
                return call()
            finally:
                ctx.log = outer

        state = _stage.with_options(name=name, task_run_name=name)(name, logged, return_state=True)
        if state.is_completed():
            return state.result()
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, StageDidNotPass):
            return exc.outcome
        return StageOutcome(name, "error", 0.0, f"the task run ended {state.type.value}: {exc!r}"[:2000])

    return run


def _run_name() -> str:
    try:
        return Commit.from_request(flow_run.parameters["request"]).run_name()
    except Exception:  # a malformed request still gets a run, which fails and says why
        return "platform-ci"


def _finish(report: PipelineReport) -> State:
    create_table_artifact(key="ci-report", table=report.rows(),
                          description=f"platform-ci {report.commit.run_name()}: {report.result}")
    create_markdown_artifact(key="ci-report-md", markdown=report.markdown(), description="platform-ci report")
    data = report.to_dict()
    if report.passed:
        return Completed(message=report.description(), data=data)
    return Failed(message=report.description(), data=data)


@flow(name="platform-ci", flow_run_name=_run_name, persist_result=False, log_prints=True)
def platform_ci(request: dict[str, Any], delivery: str | None = None) -> State:
    """Test one commit: checkout, unit, image, staging, integration, load, chaos, regression, report
    (:mod:`apiary.ci.pipeline`). ``request``: the webhook's pipeline request
    (:meth:`apiary.ci.webhooks.PipelineRequest.parameters`); ``delivery``: GitHub's delivery id."""
    log = get_run_logger()
    commit = Commit.from_request(request)
    log.info("platform-ci for %s (delivery %s)", commit.run_name(), delivery)
    holder: dict[str, Any] = {}
    report = ci_pipeline(commit, CiConfig.from_env(), runner=prefect_runner(holder), flow_run_id=str(flow_run.id),
                         log=log, on_context=lambda ctx: holder.__setitem__("ctx", ctx), delivery=delivery)
    return _finish(report)


class StepFailed(Exception):
    """Raised in a rollout step's task so that its task run ends Failed; carries the step."""

    def __init__(self, step: Step) -> None:
        super().__init__(f"{step.component} {step.gate} gate failed: {step.detail}"[:2000])
        self.step = step


@task(cache_policy=NO_CACHE, persist_result=False)
def _step(name: str, call: Callable[[], Step]) -> Step:
    step = call()
    get_run_logger().info("%s: gate %s ok=%s in %.1f s: %s", name, step.gate, step.ok, step.duration_s,
                          step.detail[:2000])
    if not step.ok:
        raise StepFailed(step)
    return step


def _step_runner(name: str, call: Callable[[], Step]) -> Step:
    """Each rollout step a task run named after it (control-plane, agent, bridge, canary, rollback-*)."""
    state = _step.with_options(name=name, task_run_name=name)(name, call, return_state=True)
    if state.is_completed():
        return state.result()
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, StepFailed):
        return exc.step
    raise RuntimeError(f"rollout step {name} ended {state.type.value}: {exc!r}")


@flow(name="platform-deploy", flow_run_name=_run_name, persist_result=False)
def platform_deploy(request: dict[str, Any], delivery: str | None = None, force: bool = False) -> State:
    """Deploy a commit of the default branch to production: after a passing ``platform-ci`` for its
    sha (run as a subflow when none is recorded: :func:`apiary.ci.run.ci_gate`), roll the control
    plane, agents and bridge forward one at a time, gated on health, rolled back on a failed gate
    (:func:`apiary.ci.run.deploy_commit`). ``force``: deploy without a passing pipeline (recorded
    as a ``manual`` deployment; the health gates still apply)."""
    log = get_run_logger()
    ci_request = {**request, "kind": "deploy"}
    commit = Commit.from_request(ci_request)
    config = CiConfig.from_env()
    if not force:
        def run_ci() -> tuple[bool, str]:
            state = platform_ci(ci_request, delivery, return_state=True)
            return state.is_completed(), state.message or state.type.value

        passed, why = ci_gate(commit, config, run_ci, log)
        log.info(why)
        if not passed:
            return Failed(message=why[:1000], data={"result": "refused", "reason": why})
    outcome = deploy_commit(commit, config, trigger="manual" if force else "push", flow_run_id=str(flow_run.id),
                            log=log, step_runner=_step_runner, delivery=delivery)
    message = f"{commit.short}: {outcome.result}" + (f" - {outcome.reason}" if outcome.reason else "")
    if outcome.record:
        create_table_artifact(key="deploy-steps", table=outcome.record["steps"], description=message[:500])
    data = {"result": outcome.result, "reason": outcome.reason, "record": outcome.record}
    if outcome.deployed:
        return Completed(message=message[:1000], data=data)
    log.error(message)
    return Failed(message=message[:1000], data=data)
