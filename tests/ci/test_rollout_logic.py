"""The rollout's decisions (apiary.ci.rollout), without Docker: the pure policy ``next_action`` over a
table of gate outcomes, and ``rollout`` driving a fake platform that records what was replaced."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import pytest

from apiary.ci.containers import GateResult, PlatformImages
from apiary.ci.rollout import (
    GATES,
    Finish,
    Plan,
    Replace,
    RunCanary,
    Step,
    make_plan,
    next_action,
    rollout,
)

OLD = PlatformImages.from_registry("reg:5000", "r1")
NEW = PlatformImages.from_registry("reg:5000", "r2")
ALL = ("control-plane", "agent", "bridge")


def test_images_round_trip_and_names():
    assert OLD.control_plane == "reg:5000/apiary/control-plane:r1"
    assert OLD.as_dict() == {"control-plane": "reg:5000/apiary/control-plane:r1",
                             "agent": "reg:5000/apiary/agent:r1", "prefect": "reg:5000/apiary/prefect:r1"}
    assert PlatformImages.from_dict(OLD.as_dict()) == OLD
    assert OLD.for_component("bridge") == OLD.prefect


def test_plan_maps_the_bridge_to_the_prefect_image_and_skips_what_is_not_running():
    plan = make_plan(("control-plane", "agent"), NEW, {"control-plane": OLD.control_plane}, canary=False)
    assert plan.components == ("control-plane", "agent")
    assert plan.new == {"control-plane": NEW.control_plane, "agent": NEW.agent}
    assert plan.previous == {"control-plane": OLD.control_plane}
    full = make_plan(ALL, NEW, OLD.as_dict(), canary=True)
    assert full.new["bridge"] == NEW.prefect and full.previous["bridge"] == OLD.prefect
    with pytest.raises(ValueError):
        make_plan(("scheduler",), NEW, {}, canary=False)


# ------------------------------------------------------------------------------ next_action table


def drive(plan: Plan, outcomes: dict[tuple[str, str], bool]) -> tuple[list[tuple[str, str, str]], Finish]:
    """Run ``next_action`` to the end; ``outcomes[(phase, component)]`` is each gate's verdict
    (default ok). Returns the actions taken as (phase, component, image tag) and the finish."""
    steps: list[Step] = []
    taken = []
    for _ in range(20):
        action = next_action(plan, steps)
        if isinstance(action, Finish):
            return taken, action
        if isinstance(action, RunCanary):
            ok = outcomes.get(("canary", "canary"), True)
            steps.append(Step("canary", "canary", "", "canary", ok, "canary detail", 1.0))
            taken.append(("canary", "canary", ""))
            continue
        assert isinstance(action, Replace) and action.gate == GATES[action.component]
        ok = outcomes.get((action.phase, action.component), True)
        steps.append(Step(action.phase, action.component, action.image, action.gate, ok,
                          f"{action.component} detail\nsecond line", 1.0))
        taken.append((action.phase, action.component, action.image.rsplit(":", 1)[1]))
    raise AssertionError("next_action did not finish")


FWD = [("forward", c, "r2") for c in ALL]
CASES = [
    # id, failing gates, expected actions after the forward ones that ran, result, reason contains
    ("all-ok", {}, FWD + [("canary", "canary", "")], "succeeded", None),
    ("control-plane-fails", {("forward", "control-plane"): False},
     [("forward", "control-plane", "r2"), ("rollback", "control-plane", "r1")],
     "rolled_back", "control-plane: gate healthz failed: control-plane detail"),
    ("agent-fails", {("forward", "agent"): False},
     FWD[:2] + [("rollback", "agent", "r1"), ("rollback", "control-plane", "r1")],
     "rolled_back", "agent: gate agents failed"),
    ("bridge-fails", {("forward", "bridge"): False},
     FWD + [("rollback", "bridge", "r1"), ("rollback", "agent", "r1"), ("rollback", "control-plane", "r1")],
     "rolled_back", "bridge: gate bridge failed"),
    ("canary-fails", {("canary", "canary"): False},
     FWD + [("canary", "canary", ""), ("rollback", "bridge", "r1"), ("rollback", "agent", "r1"),
            ("rollback", "control-plane", "r1")],
     "rolled_back", "canary: gate canary failed"),
    ("rollback-fails-keeps-going", {("forward", "agent"): False, ("rollback", "agent"): False},
     FWD[:2] + [("rollback", "agent", "r1"), ("rollback", "control-plane", "r1")],
     "failed", "rollback failed: agent back to reg:5000/apiary/agent:r1: gate agents failed"),
    ("second-rollback-fails", {("forward", "agent"): False, ("rollback", "control-plane"): False},
     FWD[:2] + [("rollback", "agent", "r1"), ("rollback", "control-plane", "r1")],
     "failed", "rollback failed: control-plane back to"),
]


@pytest.mark.parametrize(("failing", "expected", "result", "reason"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_next_action_table(failing, expected, result, reason):
    plan = make_plan(ALL, NEW, OLD.as_dict(), canary=True)
    taken, finish = drive(plan, failing)
    assert taken == expected
    assert finish.result == result
    if reason is None:
        assert finish.reason is None
    else:
        assert reason in finish.reason
        assert "second line" not in finish.reason  # the reason keeps the detail's first line only


def test_no_canary_planned_means_none_run():
    taken, finish = drive(make_plan(ALL, NEW, OLD.as_dict(), canary=False), {})
    assert taken == FWD and finish.result == "succeeded"


def test_a_component_without_a_previous_image_cannot_go_back():
    plan = make_plan(ALL, NEW, {"control-plane": OLD.control_plane, "agent": OLD.agent}, canary=False)
    taken, finish = drive(plan, {("forward", "bridge"): False})
    # the bridge was not running before: nothing to go back to, the others still go back
    assert taken == FWD + [("rollback", "agent", "r1"), ("rollback", "control-plane", "r1")]
    assert finish.result == "failed" and "bridge: no previous image" in finish.reason


# ------------------------------------------------------------------------------ rollout over a fake


@dataclass
class FakePlatform:
    """Holds images per component; a gate fails while its component runs an image in ``bad``."""

    components: tuple[str, ...] = ("control-plane", "agent")
    images: dict[str, str] = field(default_factory=lambda: {"control-plane": OLD.control_plane, "agent": OLD.agent})
    bad: set[str] = field(default_factory=set)
    unpullable: set[str] = field(default_factory=set)
    canary_ok: bool = True
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def current_images(self) -> dict[str, str]:
        return {{"bridge": "prefect"}.get(c, c): img for c, img in self.images.items()}

    def replace(self, component: str, image: str) -> None:
        self.calls.append(("replace", component, image))
        if image in self.unpullable:
            raise RuntimeError(f"pull access denied for {image}")
        self.images[component] = image

    def _gate(self, gate: str, component: str) -> GateResult:
        self.calls.append(("gate", gate))
        ok = self.images.get(component) not in self.bad
        return GateResult(ok, gate, "ok" if ok else f"container exited (exit code 1); log tail:\n{component} boom", 0.5)

    def gate_healthz(self, timeout_s: float) -> GateResult:
        return self._gate("healthz", "control-plane")

    def gate_agents(self, timeout_s: float) -> GateResult:
        return self._gate("agents", "agent")

    def gate_bridge(self, timeout_s: float) -> GateResult:
        return self._gate("bridge", "bridge")

    def gate_canary(self, timeout_s: float, job_yaml: str) -> GateResult:
        self.calls.append(("gate", "canary"))
        return GateResult(self.canary_ok, "canary", "canary SUCCEEDED" if self.canary_ok else "canary FAILED", 2.0)


def ticking(step: float = 1.0):
    counter = itertools.count()
    return lambda: 1_700_000_000.0 + step * next(counter)


def test_rollout_succeeds_and_records_every_step():
    p = FakePlatform()
    result = rollout(p, NEW, sha="abc123", actor="ci", canary_job="name: canary\n", clock=ticking())
    assert result.result == "succeeded" and result.ok
    assert p.calls == [("replace", "control-plane", NEW.control_plane), ("gate", "healthz"),
                       ("replace", "agent", NEW.agent), ("gate", "agents"), ("gate", "canary")]
    record = result.to_record()
    assert set(record) == {"sha", "images", "previousImages", "actor", "trigger", "startedAt", "finishedAt",
                           "durationS", "result", "reason", "steps", "flowRunId"}
    assert record["images"] == NEW.as_dict()
    assert record["previousImages"] == {"control-plane": OLD.control_plane, "agent": OLD.agent}
    assert record["trigger"] == "push" and record["actor"] == "ci" and record["flowRunId"] is None
    assert record["startedAt"] == "2023-11-14T22:13:20.000Z" and record["reason"] is None
    assert record["durationS"] == 7.0  # 8 clock reads, one second apart
    assert [(s["component"], s["gate"], s["ok"]) for s in record["steps"]] == [
        ("control-plane", "healthz", True), ("agent", "agents", True), ("canary", "canary", True)]
    assert set(record["steps"][0]) == {"component", "image", "gate", "ok", "detail", "durationS"}


def test_rollout_to_a_broken_control_plane_rolls_it_back():
    broken = PlatformImages(control_plane="reg:5000/apiary/control-plane:r2-broken", agent=NEW.agent,
                            prefect=NEW.prefect)
    p = FakePlatform(bad={broken.control_plane})
    result = rollout(p, broken, sha="def456", actor="ci", clock=ticking())
    assert result.result == "rolled_back"
    assert "control-plane" in result.reason and "healthz" in result.reason
    assert p.images == {"control-plane": OLD.control_plane, "agent": OLD.agent}  # the agent was never touched
    assert [(s.phase, s.component, s.ok) for s in result.steps] == [("forward", "control-plane", False),
                                                                   ("rollback", "control-plane", True)]


def test_rollout_with_an_unpullable_agent_image_rolls_both_back():
    p = FakePlatform(unpullable={NEW.agent})
    result = rollout(p, NEW, sha="1", actor="ci", clock=ticking())
    assert result.result == "rolled_back"
    assert "agent: gate agents failed: replace failed: RuntimeError: pull access denied" in result.reason
    assert p.images == {"control-plane": OLD.control_plane, "agent": OLD.agent}
    assert [c for c in p.calls if c[0] == "replace"][-2:] == [("replace", "agent", OLD.agent),
                                                              ("replace", "control-plane", OLD.control_plane)]


def test_rollout_whose_rollback_fails_is_failed():
    p = FakePlatform(bad={NEW.agent, OLD.agent})  # the old agent does not come back either
    result = rollout(p, NEW, sha="1", actor="ci", trigger="rollback", clock=ticking())
    assert result.result == "failed" and "rollback failed" in result.reason
    assert result.to_record()["trigger"] == "rollback"


def test_a_gate_that_raises_is_a_failed_gate():
    p = FakePlatform()

    def boom(timeout_s: float) -> GateResult:
        raise ConnectionError("dockerd went away")

    p.gate_agents = boom  # type: ignore[method-assign]
    result = rollout(p, NEW, sha="1", actor="ci", clock=ticking())
    assert result.result == "failed"  # the rollback's agents gate raises too
    assert "ConnectionError: dockerd went away" in result.steps[1].detail


# ------------------------------------------------------------------------------ apiary deploy rollback


def deployment(id_: int, sha: str, tag: str, trigger: str = "push") -> dict:
    return {"id": id_, "sha": sha, "images": PlatformImages.from_registry("reg:5000", tag).as_dict(),
            "trigger": trigger, "result": "succeeded", "finishedAt": "2026-01-01T00:00:00Z"}


RUNNING_R3 = {"control-plane": "reg:5000/apiary/control-plane:r3", "agent": "reg:5000/apiary/agent:r3"}
HISTORY = [deployment(3, "ccc333", "r3"), deployment(2, "bbb222", "r2"), deployment(1, "bbb999", "r1")]


@pytest.mark.parametrize(("history", "running", "to", "expected"), [
    pytest.param(HISTORY, RUNNING_R3, None, 2, id="the-one-before-the-current"),
    pytest.param(HISTORY, {"control-plane": "reg:5000/apiary/control-plane:r2", "agent": "reg:5000/apiary/agent:r2"},
                 None, 1, id="current-is-not-the-newest"),
    pytest.param(HISTORY, {"control-plane": "x/control-plane:hotfix"}, None, 3, id="running-images-unknown"),
    pytest.param([deployment(4, "bbb222", "r2", "rollback"), *HISTORY],
                 {"control-plane": "reg:5000/apiary/control-plane:r2", "agent": "reg:5000/apiary/agent:r2"},
                 None, 3, id="second-rollback-undoes-the-first"),
    pytest.param(HISTORY, RUNNING_R3, "BBB2", 2, id="to-prefix"),
    pytest.param(HISTORY, RUNNING_R3, "bbb999", 1, id="to-full-sha"),
])
def test_pick_target(history, running, to, expected):
    from apiary.cli.rollout import pick_target

    assert pick_target(history, running, to)["id"] == expected


@pytest.mark.parametrize(("history", "to", "message"), [
    pytest.param([], None, "no succeeded deployment is recorded", id="empty"),
    pytest.param(HISTORY[:1], None, "no succeeded deployment before the current one (ccc333)", id="nothing-older"),
    pytest.param(HISTORY, "bbb", "ambiguous: it matches bbb222, bbb999", id="ambiguous-prefix"),
    pytest.param(HISTORY, "ddd", "no succeeded deployment of a commit starting with ddd", id="unknown-sha"),
])
def test_pick_target_refuses(history, to, message):
    from apiary.cli.rollout import RollbackError, pick_target

    with pytest.raises(RollbackError, match=re.escape(message)):
        pick_target(history, RUNNING_R3, to)


@pytest.fixture
def rollback_cli(monkeypatch, tmp_path):
    """``apiary deploy rollback`` on a typer group of its own, against a fake platform (no Docker)
    and a mocked API; returns (invoke, the fake platform, the requests the API saw)."""
    import httpx
    import typer
    from typer.testing import CliRunner

    import apiary.ci.containers as containers
    import apiary.cli.rollout as cli_rollout
    import apiary.images.daemons as daemons
    from apiary.cli.rollout import add_rollout_commands

    (tmp_path / "token").write_text("admin-token\n")
    fake = FakePlatform(images={"control-plane": RUNNING_R3["control-plane"], "agent": RUNNING_R3["agent"]})
    seen: list[httpx.Request] = []
    routes = {"history": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.headers["Authorization"] == "Bearer admin-token"
        if request.method == "GET":
            if routes["history"] == 404:
                return httpx.Response(404, json={"detail": "Not Found"})
            assert request.url.params["result"] == "succeeded"
            return httpx.Response(200, json={"deployments": HISTORY})
        return httpx.Response(201, json={"id": 9})

    real_client = httpx.Client
    monkeypatch.setattr(cli_rollout.httpx, "Client",
                        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    monkeypatch.setattr(daemons, "docker_client", lambda: object())
    monkeypatch.setattr(cli_rollout, "running_settings", lambda client, name: {})
    monkeypatch.setattr(containers, "ContainerPlatform", lambda *a, **kw: fake)
    group = typer.Typer()
    add_rollout_commands(group)

    @group.callback()
    def _group() -> None:  # a group of one command still takes the command's name
        pass

    def invoke(*args: str):
        return CliRunner().invoke(group, ["rollback", "--home", str(tmp_path), "--port", "1", "--name", "prod", *args])

    return invoke, fake, seen, routes


def test_rollback_cli_rolls_back_and_records(rollback_cli):
    import json

    invoke, fake, seen, _routes = rollback_cli
    result = invoke()
    assert result.exit_code == 0, result.output
    assert fake.images == {"control-plane": "reg:5000/apiary/control-plane:r2", "agent": "reg:5000/apiary/agent:r2"}
    posted = json.loads(seen[-1].content)
    assert seen[-1].method == "POST" and seen[-1].url.path == "/api/v2/deployments"
    assert posted["trigger"] == "rollback" and posted["sha"] == "bbb222" and posted["result"] == "succeeded"
    assert posted["previousImages"] == RUNNING_R3
    assert "result: succeeded" in result.output and "healthz" in result.output


def test_rollback_cli_without_the_deployments_api_says_so(rollback_cli):
    invoke, fake, _seen, routes = rollback_cli
    routes["history"] = 404
    result = invoke()
    assert result.exit_code == 1
    assert "answered 404" in result.output and "no deployment history" in result.output
    assert fake.calls == []  # nothing was touched


def test_rollback_cli_whose_gate_fails_exits_1(rollback_cli):
    invoke, fake, _seen, _routes = rollback_cli
    fake.bad = {"reg:5000/apiary/control-plane:r1"}
    result = invoke("--to", "bbb9")
    assert result.exit_code == 1, result.output
    assert "result: rolled_back" in result.output
    assert fake.images["control-plane"] == RUNNING_R3["control-plane"]


def test_a_first_deployment_has_no_previous_images():
    p = FakePlatform(images={})
    result = rollout(p, NEW, sha="1", actor="ci", clock=ticking())
    assert result.result == "succeeded" and result.to_record()["previousImages"] is None


def test_the_decision_table_imports_neither_the_store_nor_the_control_plane() -> None:
    """ci.rollout is a pure decision table: it took its time formatter from the control plane,
    which pulled SQLAlchemy and the store into every importer."""
    import subprocess
    import sys

    code = ("import sys, apiary.ci.rollout; "
            "print(sorted(m for m in sys.modules if m == 'sqlalchemy' or m.startswith('apiary.control')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
