"""Running the pipelines for one commit, with their records: what flows/ci.py calls (without Prefect).

* :func:`ci_pipeline`: records the run as ``running`` on the control plane and posts a ``pending``
  commit status, runs the stages (:func:`apiary.ci.pipeline.run_pipeline`), removes the workspace
  (the artifacts stay), records the final result.
* :func:`ci_gate` then :func:`deploy_commit`: for a push to the default branch. The gate asks the
  recording API for a ``success`` run of the pipeline for that sha (the store filters; runs the
  pipeline when there is none); the deploy rolls the
  production platform forward to the sha's images (:func:`apiary.ci.rollout.rollout`: one
  component at a time, each gated on health, everything rolled back on a failed gate) and records
  the deployment. Forcing (an operator's decision) skips the gate; the health gates still guard
  production.

Both report the GitHub ``delivery`` that started them, when there is one, so the delivery, its
pipeline run and its deployment are one CI record (:mod:`apiary.ci.records`). Recording is best
effort: an unreachable control plane is logged and the pipeline goes on (the verdict and the
commit status do not depend on it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apiary.ci.config import CiConfig
from apiary.ci.pipeline import CiContext, Commit, PipelineReport, Runner, Stage, direct_runner, run_pipeline
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

#: The canary job a rollout runs after its last component when the target names none: Lab 6's
#: job-config-0 (the MNIST example, one GPU in VC vc1).
DEFAULT_CANARY = Path(__file__).resolve().parents[3] / "examples" / "lab6" / "job-config-0.yaml"


def _client(config: CiConfig) -> Any:
    from apiary.client import ApiaryClient

    if not config.record_url:
        return None
    return ApiaryClient(config.record_url, token=config.record_token, timeout=30)


def record(config: CiConfig, what: str, body: dict[str, Any], log: Any = logger) -> dict[str, Any] | None:
    """POST ``body`` as a CI run (``what="ci_run"``) or a deployment (``"deployment"``) to the
    recording control plane; None (logged) when none is configured or it fails."""
    client = _client(config)
    if client is None:
        log.warning("no APIARY_CI_RECORD_URL/APIARY_API_URL: the %s is not recorded", what)
        return None
    try:
        return client.record_ci_run(body) if what == "ci_run" else client.record_deployment(body)
    except Exception as exc:  # recording must not change the verdict
        log.warning("recording the %s failed: %s: %s", what, type(exc).__name__, exc)
        return None
    finally:
        client.close()


def target_url(config: CiConfig, flow_run_id: str | None) -> str | None:
    """The flow run's page in the Prefect UI (``PREFECT_UI_URL``), the commit status's link."""
    if not (config.ui_url and flow_run_id):
        return None
    return f"{config.ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"


def make_context(commit: Commit, config: CiConfig, flow_run_id: str | None = None, log: Any = None) -> CiContext:
    """A fresh context: artifacts in ``<artifacts>/<flow run id>/`` (a uuid when there is no flow
    run), the workspace in ``<workdir>/ws-<short sha>-<id>``."""
    key = flow_run_id or f"local-{uuid.uuid4().hex[:12]}"
    artifacts = Path(config.artifacts) / key
    artifacts.mkdir(parents=True, exist_ok=True)
    workspace = Path(config.workdir) / f"ws-{commit.short}-{key[:8]}"
    return CiContext(commit=commit, config=config, workspace=workspace, artifacts=artifacts,
                     log=log or logger, flow_run_id=flow_run_id, target_url=target_url(config, flow_run_id))


def ci_pipeline(commit: Commit, config: CiConfig, *, runner: Runner = direct_runner, flow_run_id: str | None = None,
                log: Any = None, stages: dict[str, Stage] | None = None,
                on_context: Callable[[CiContext], None] | None = None, delivery: str | None = None) -> PipelineReport:
    """Run ``platform-ci`` for ``commit`` (see the module docstring); returns the report.
    ``on_context`` sees the context before the first stage (the flow uses it to switch loggers);
    ``delivery``: the GitHub delivery that asked for the run (its CI record gets the run)."""
    from apiary.ci import stages as stage_mod

    ctx = make_context(commit, config, flow_run_id, log)
    if on_context:
        on_context(ctx)
    started: dict[str, Any] = {
        "flowRunId": flow_run_id or ctx.artifacts.name, "repo": commit.repo, "prNumber": commit.pr_number,
        "sha": commit.sha, "ref": commit.ref or "-", "kind": commit.kind, "result": "running",
        "startedAt": iso(time.time()), "stages": [], "targetUrl": ctx.target_url}
    if delivery:
        started["delivery"] = delivery
    record(config, "ci_run", started, ctx.log)
    try:
        stage_mod.post_status(config, commit.repo, commit.sha,
                              {"state": "pending", "context": config.context,
                               "description": "platform-ci running", "target_url": ctx.target_url})
    except Exception as exc:  # the receiver being down must not stop the pipeline
        ctx.log.warning("pending status not posted: %s", exc)
    try:
        report = run_pipeline(ctx, stages if stages is not None else stage_mod.STAGE_FUNCS, runner=runner)
    finally:
        shutil.rmtree(ctx.workspace, ignore_errors=True)
    report.flow_run_id = str(started["flowRunId"])
    final = report.record()
    if delivery:
        final["delivery"] = delivery
    record(config, "ci_run", final, ctx.log)
    ctx.log.info("platform-ci %s: %s (%s)", commit.run_name(), report.result, report.description())
    return report


@dataclass
class DeployOutcome:
    """What :func:`deploy_commit` did: ``result`` (the rollout's: ``succeeded``, ``rolled_back``,
    ``failed``), ``reason`` and the deployment ``record`` as posted."""

    result: str
    reason: str | None
    record: dict[str, Any] | None = None

    @property
    def deployed(self) -> bool:
        return self.result == "succeeded"


def passing_run(config: CiConfig, sha: str) -> dict[str, Any] | None:
    """The latest recorded ``success`` run of the pipeline for ``sha`` (None: none, or no recorder),
    asked of the API by sha (``GET /api/v2/ci/runs?sha=&result=success&limit=1``: the store filters)."""
    client = _client(config)
    if client is None:
        return None
    try:
        runs = client.ci_runs(limit=1, result="success", sha=sha.lower())
    except Exception as exc:
        logger.warning("cannot read the CI runs: %s", exc)
        return None
    finally:
        client.close()
    # the API matches a prefix: a longer sha that starts with this one is another commit
    return next((r for r in runs if str(r.get("sha", "")) == sha.lower()), None)


def production_platform(config: CiConfig) -> Any:
    """The :class:`~apiary.ci.containers.ContainerPlatform` of ``config.production``."""
    from apiary.ci.containers import ContainerPlatform
    from apiary.ci.stages import docker

    target = config.production
    if target is None:
        raise ValueError("no production platform configured (APIARY_CI_PRODUCTION)")
    return ContainerPlatform(docker(), target.name, target.home, target.port, agent_runtime=target.agent_runtime,
                             image_map=target.image_map, registry=target.registry or config.registry,
                             prefect_api_url=target.prefect_api_url)


def ci_gate(commit: Commit, config: CiConfig, run_ci: Callable[[], tuple[bool, str]] | None = None,
            log: Any = None) -> tuple[bool, str]:
    """Whether ``commit`` may go to production: a recorded ``success`` run of the pipeline for its
    sha, or else the pipeline run now (``run_ci`` returns ``(passed, description)``; default
    :func:`ci_pipeline` inline). Returns ``(passed, why)``."""
    log = log or logger
    found = passing_run(config, commit.sha)
    if found is not None:
        return True, f"platform-ci passed for {commit.short} (flow run {found.get('flowRunId')})"
    log.info("no passing platform-ci run recorded for %s: running it", commit.short)
    if run_ci is None:
        report = ci_pipeline(commit, config, log=log)
        passed, description = report.passed, report.description()
    else:
        passed, description = run_ci()
    if passed:
        return True, f"platform-ci passed for {commit.short}: {description}"
    return False, f"platform-ci failed for {commit.short}: {description}; not deployed"


def deploy_commit(commit: Commit, config: CiConfig, *, trigger: str = "push", flow_run_id: str | None = None,
                  log: Any = None, rollout_fn: Callable[..., Any] | None = None,
                  step_runner: Callable[..., Any] | None = None, delivery: str | None = None) -> DeployOutcome:
    """Roll production forward to ``commit``'s images (the caller checked :func:`ci_gate`, or an
    operator forces it: ``trigger="manual"``) and record the deployment (on ``delivery``'s CI
    record when given). ``step_runner``: passed to :func:`apiary.ci.rollout.rollout`. Never raises
    for a failed gate; raises ValueError when no production platform or registry is configured."""
    from apiary.ci.containers import PlatformImages
    from apiary.ci.rollout import rollout

    log = log or logger
    target = config.production
    if target is None:
        raise ValueError("no production platform configured (APIARY_CI_PRODUCTION)")
    registry = target.registry or config.registry
    if not registry:
        raise ValueError("no registry configured (APIARY_CI_REGISTRY or the production target's)")
    images = PlatformImages.from_registry(registry, commit.sha[:12])
    canary = (target.canary_job or DEFAULT_CANARY).read_text()
    result = (rollout_fn or rollout)(production_platform(config), images, sha=commit.sha,
                                     actor=commit.sender or os.environ.get("USER", "platform-deploy"),
                                     trigger=trigger, canary_job=canary, gate_timeout_s=target.gate_timeout_s,
                                     **({"step_runner": step_runner} if step_runner else {}))
    body = result.to_record()
    body["flowRunId"] = flow_run_id
    if delivery:
        body["delivery"] = delivery
    record(config, "deployment", body, log)
    log.info("deploy %s: %s %s", commit.short, body["result"], body.get("reason") or "")
    return DeployOutcome(body["result"], body.get("reason"), body)
