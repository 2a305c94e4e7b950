"""Roll a container platform forward one component at a time, behind health gates, and back on failure.

:func:`rollout` is what the deploy flow (``flows/ci.py``) and ``apiary deploy rollback`` call. The
decisions are pure and table-like (:func:`next_action` over the steps taken so far); the I/O is the
platform's (:class:`apiary.ci.containers.ContainerPlatform`: replace a container, run a gate).

The sequence, for components ``control-plane``, ``agent``, ``bridge`` (the bridge only when the
platform has a Prefect URL)::

    forward:   replace control-plane -> gate healthz   replace agent -> gate agents
               replace bridge -> gate bridge            canary job -> gate canary (if one is given)
    all ok:    succeeded
    a gate (or a replace) fails:
    rollback:  every component replaced so far, the failed one included (all of them after a
               failed canary), newest first: replace with its previous image -> its gate again
               every rollback gate ok: rolled_back     any fails, or no previous image: failed

Each row of that table is one :class:`Step`; a rollback keeps going after a failed rollback step
(the other components still go back). Running jobs survive: the control plane's state is in the
store under the platform's home, and with the docker runtime the tasks are sibling containers the
new agent re-adopts (see :mod:`apiary.ci.containers`).

The record (:meth:`DeploymentResult.to_record`) is what the flow posts to ``POST /api/v2/deployments``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

from apiary.ci.containers import COMPONENT_IMAGE, COMPONENTS, GateResult, PlatformImages
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

__all__ = ["COMPONENTS", "GATES", "DeploymentResult", "Finish", "Plan", "Replace", "RunCanary", "Step",
           "make_plan", "next_action", "rollout"]

#: The gate that follows each component's replacement.
GATES = {"control-plane": "healthz", "agent": "agents", "bridge": "bridge"}
#: The component name of the canary step.
CANARY = "canary"

Phase = Literal["forward", "canary", "rollback"]
Result = Literal["succeeded", "rolled_back", "failed"]


# ------------------------------------------------------------------------------ the decisions


@dataclass(frozen=True)
class Step:
    """One thing done: a component replaced with ``image`` and its ``gate`` run (or the canary).
    ``phase``: ``forward`` | ``canary`` | ``rollback`` (not in the record: a rollback step is
    the one whose image is the previous one). ``duration_s``: replace + gate, seconds."""

    phase: Phase
    component: str
    image: str
    gate: str
    ok: bool
    detail: str
    duration_s: float

    def to_record(self) -> dict[str, Any]:
        return {"component": self.component, "image": self.image, "gate": self.gate, "ok": self.ok,
                # The record keeps the last 2,000 characters (the API's bound): a log tail's end says most.
                "detail": self.detail[-2000:], "durationS": round(self.duration_s, 3)}


@dataclass(frozen=True)
class Plan:
    """What a rollout will do: ``components`` in forward order, the ``new`` and ``previous`` image
    of each (component -> image; a component missing from ``previous`` was not running), and
    whether a canary job follows."""

    components: tuple[str, ...]
    new: dict[str, str]
    previous: dict[str, str]
    canary: bool


@dataclass(frozen=True)
class Replace:
    """Replace ``component`` with ``image``, then run ``gate``."""

    phase: Phase
    component: str
    image: str
    gate: str


@dataclass(frozen=True)
class RunCanary:
    """Run the canary job (gate ``canary``)."""


@dataclass(frozen=True)
class Finish:
    """Done: ``result`` and, unless it succeeded, why."""

    result: Result
    reason: str | None


Action = Replace | RunCanary | Finish


def make_plan(components: Sequence[str], images: PlatformImages, previous_images: dict[str, str],
              canary: bool) -> Plan:
    """The plan for ``components`` (a platform's, in :data:`COMPONENTS` order) from ``images`` and
    ``previous_images`` (image key -> name, :meth:`ContainerPlatform.current_images`)."""
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown components {unknown}; known: {COMPONENTS}")
    ordered = tuple(c for c in COMPONENTS if c in components)
    previous = {c: previous_images[COMPONENT_IMAGE[c]] for c in ordered if COMPONENT_IMAGE[c] in previous_images}
    return Plan(ordered, {c: images.for_component(c) for c in ordered}, previous, canary)


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failure_reason(step: Step) -> str:
    """``<component>: gate <gate> failed: <first line of the detail>``."""
    return f"{step.component}: gate {step.gate} failed: {_first_line(step.detail)}"


def next_action(plan: Plan, steps: Sequence[Step]) -> Action:
    """What to do after ``steps`` (everything done so far, in order). Pure; the whole policy:

    1. No forward or canary step failed: replace the next component not yet replaced; then the
       canary (if planned); then ``Finish("succeeded")``.
    2. The first failed forward/canary step starts the rollback of every component replaced so far
       (the failed one included; all of them after the canary), newest first, each to its
       previous image. A component with no previous image is skipped and makes the result failed.
    3. When every such component has had its rollback step: ``rolled_back`` if all their gates
       passed, else ``failed``; the reason names the failed component, gate and detail, then what
       the rollback could not do.
    """
    done = {s.component for s in steps if s.phase == "forward"}
    failed = next((s for s in steps if s.phase in ("forward", "canary") and not s.ok), None)
    if failed is None:
        for component in plan.components:
            if component not in done:
                return Replace("forward", component, plan.new[component], GATES[component])
        if plan.canary and not any(s.phase == "canary" for s in steps):
            return RunCanary()
        return Finish("succeeded", None)
    if failed.phase == "canary":
        updated = list(plan.components)
    else:
        updated = list(plan.components[: plan.components.index(failed.component) + 1])
    reverted = {s.component: s for s in steps if s.phase == "rollback"}
    problems: list[str] = []
    for component in reversed(updated):
        if component not in plan.previous:
            problems.append(f"{component}: no previous image to roll back to")
        elif component not in reverted:
            return Replace("rollback", component, plan.previous[component], GATES[component])
        elif not reverted[component].ok:
            problems.append(f"{component} back to {reverted[component].image}: gate {reverted[component].gate} "
                            f"failed: {_first_line(reverted[component].detail)}")
    reason = failure_reason(failed)
    if problems:
        return Finish("failed", f"{reason}; rollback failed: {'; '.join(problems)}")
    return Finish("rolled_back", f"{reason}; rolled back {', '.join(reversed(updated))} to the previous images")


# ------------------------------------------------------------------------------ the record



@dataclass
class DeploymentResult:
    """One rollout: what was deployed over what, by whom, when, how it ended and every step.
    Times are unix seconds; :meth:`to_record` is the wire shape."""

    sha: str
    images: dict[str, str]
    previous_images: dict[str, str]
    actor: str
    trigger: str
    started_at: float
    finished_at: float
    result: Result
    reason: str | None
    steps: list[Step] = field(default_factory=list)
    flow_run_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.result == "succeeded"

    def to_record(self) -> dict[str, Any]:
        """The deployment record (``POST /api/v2/deployments``; camelCase, ISO 8601 UTC times;
        ``previousImages`` None when nothing ran before)."""
        return {
            "sha": self.sha, "images": dict(self.images), "previousImages": dict(self.previous_images) or None,
            "actor": self.actor, "trigger": self.trigger, "startedAt": iso(self.started_at),
            "finishedAt": iso(self.finished_at), "durationS": round(self.finished_at - self.started_at, 3),
            "result": self.result, "reason": self.reason[:4000] if self.reason else None,
            "steps": [s.to_record() for s in self.steps],
            "flowRunId": self.flow_run_id,
        }


# ------------------------------------------------------------------------------ the shell


class RolloutTarget(Protocol):
    """What :func:`rollout` needs of a platform (:class:`~apiary.ci.containers.ContainerPlatform`;
    the unit tests pass a fake)."""

    @property
    def components(self) -> tuple[str, ...]: ...

    def current_images(self) -> dict[str, str]: ...

    def replace(self, component: str, image: str) -> None: ...

    def gate_healthz(self, timeout_s: float) -> GateResult: ...

    def gate_agents(self, timeout_s: float) -> GateResult: ...

    def gate_bridge(self, timeout_s: float) -> GateResult: ...

    def gate_canary(self, timeout_s: float, job_yaml: str) -> GateResult: ...


def _gate(platform: RolloutTarget, gate: str, timeout_s: float, canary_job: str | None) -> GateResult:
    """Run ``gate``; an exception (the gates should not raise) is a failed gate."""
    t0 = time.monotonic()
    try:
        if gate == "healthz":
            return platform.gate_healthz(timeout_s)
        if gate == "agents":
            return platform.gate_agents(timeout_s)
        if gate == "bridge":
            return platform.gate_bridge(timeout_s)
        if gate == "canary" and canary_job is not None:
            return platform.gate_canary(timeout_s, canary_job)
        raise ValueError(f"unknown gate {gate!r}")
    except Exception as exc:  # any failure of a gate is that gate failing
        logger.exception("gate=%s raised", gate)
        return GateResult(False, gate, f"the gate raised {type(exc).__name__}: {exc}", time.monotonic() - t0)


def _execute(platform: RolloutTarget, action: Replace | RunCanary, gate_timeout_s: float, canary_job: str | None,
             clock: Callable[[], float]) -> Step:
    t0 = clock()
    if isinstance(action, RunCanary):
        result = _gate(platform, "canary", gate_timeout_s, canary_job)
        return Step("canary", CANARY, "", "canary", result.ok, result.detail, clock() - t0)
    try:
        platform.replace(action.component, action.image)
    except Exception as exc:  # dockerd refused (an image that cannot be pulled...)
        logger.warning("component=%s image=%s replace failed: %s", action.component, action.image, exc)
        return Step(action.phase, action.component, action.image, action.gate, False,
                    f"replace failed: {type(exc).__name__}: {exc}", clock() - t0)
    result = _gate(platform, action.gate, gate_timeout_s, canary_job)
    return Step(action.phase, action.component, action.image, action.gate, result.ok, result.detail, clock() - t0)


def rollout(
    platform: RolloutTarget,
    images: PlatformImages,
    *,
    sha: str,
    actor: str,
    trigger: str = "push",
    canary_job: str | None = None,
    gate_timeout_s: float = 120,
    clock: Callable[[], float] = time.time,
    step_runner: Callable[[str, Callable[[], Step]], Step] | None = None,
) -> DeploymentResult:
    """Roll ``platform`` forward to ``images`` component by component behind the gates, rolling
    back what was replaced on the first failure (see the module doc and :func:`next_action`).

    ``sha``: the commit deployed; ``actor``/``trigger`` (``push``, ``rollback``, ``manual``) go
    into the record; ``canary_job``: an OpenPAI job (YAML) run after the last component (None: no
    canary); ``gate_timeout_s``: each gate's deadline. Blocks for the whole rollout (a few seconds
    per component plus the gates). Never raises for an unhealthy platform: the result says what
    happened; raises only when the platform's containers cannot be listed (dockerd down).
    ``step_runner(name, call)`` runs each step's ``call`` (the deploy flow makes each a Prefect
    task run named ``control-plane``, ``agent``, ``bridge``, ``canary`` or ``rollback-<component>``);
    it must return the call's step."""
    started = clock()
    previous = platform.current_images()
    plan = make_plan(platform.components, images, previous, canary_job is not None)
    logger.info("rollout sha=%s trigger=%s actor=%s from=%s to=%s", sha, trigger, actor, previous, images.as_dict())
    steps: list[Step] = []
    finish: Finish | None = None
    # Every component has at most one forward and one rollback step, plus the canary.
    for _ in range(2 * len(plan.components) + 2):
        action = next_action(plan, steps)
        if isinstance(action, Finish):
            finish = action
            break
        name = CANARY if isinstance(action, RunCanary) else (
            f"rollback-{action.component}" if action.phase == "rollback" else action.component)
        call = partial(_execute, platform, action, gate_timeout_s, canary_job, clock)
        step = step_runner(name, call) if step_runner is not None else call()
        logger.info("rollout sha=%s phase=%s component=%s image=%s gate=%s ok=%s duration_s=%.1f detail=%s", sha,
                    step.phase, step.component, step.image, step.gate, step.ok, step.duration_s,
                    _first_line(step.detail))
        steps.append(step)
    if finish is None:  # next_action always finishes within the bound; this guards a bug in it
        finish = Finish("failed", "the rollout did not finish (internal error: too many steps)")
    result = DeploymentResult(sha=sha, images=images.as_dict(), previous_images=previous, actor=actor,
                              trigger=trigger, started_at=started, finished_at=clock(), result=finish.result,
                              reason=finish.reason, steps=steps)
    logger.info("rollout sha=%s result=%s duration_s=%.1f reason=%s", sha, result.result,
                result.finished_at - result.started_at, result.reason)
    return result
