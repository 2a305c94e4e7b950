"""The predictor: warns degrading nodes before they fail, stays quiet on benign noise, rules switch off."""

from __future__ import annotations

import pytest

from apiary.aiops import (
    FAILURE_RULE,
    AiopsConfig,
    DrillRun,
    FailureModel,
    Finding,
    Frame,
    GpuReading,
    NodeSample,
    Predictor,
    check_separate,
    evaluate,
    finding_to_event,
    score_runs,
)
from apiary.errors import ValidationError
from apiary.incidents import AlertGroup, Severity


def node(name: str, temp: float = 70.0, sbe: float = 0.0, xid_last: float = 0.0, xid_events: float = 0.0,
         gpus: int = 2) -> NodeSample:
    """A node whose GPU 0 has the given readings; the others sit at 65 C with no errors."""
    rest = [GpuReading(i, temp_c=65.0, sbe_total=0.0, xid_last=0.0, xid_events=0.0, util_pct=90.0)
            for i in range(1, gpus)]
    return NodeSample(name, (GpuReading(0, temp_c=temp, sbe_total=sbe, xid_last=xid_last, xid_events=xid_events,
                                        util_pct=90.0), *rest))


def noisy_healthy_series(n: int = 40) -> list[tuple[float, NodeSample]]:
    """A healthy node with a one-off 22 C spike at 20 and a one-off burst of 12 single-bit errors at 30."""
    out = []
    sbe = 0.0
    for k in range(n):
        if k == 30:
            sbe += 12
        out.append((k * 300.0, node("n-noisy", temp=70.0 + (22.0 if k == 20 else (k % 3) * 0.5), sbe=sbe)))
    return out


def feed(pred: Predictor, series: list[tuple[float, NodeSample]]) -> list[Finding]:
    return [f for t, s in series for f in pred.observe(s.node, t, s)]


def test_degrading_nodes_are_warned_before_they_fail(model: FailureModel, config: AiopsConfig,
                                                     held_out: list[DrillRun]) -> None:
    degrading = [(run, f) for run in held_out for f in run.fates.values() if f.fate == "degrading"]
    assert len(degrading) >= 3, "the held-out seeds should hold degrading nodes"
    warned_before = 0
    for run, fate in degrading:
        pred = Predictor(config, model)
        firsts = [f.t for fr in run.frames for f in pred.observe_frame(fr)
                  if f.rule == FAILURE_RULE and f.subject == fate.node]
        assert fate.fail_s is not None
        if firsts and firsts[0] < fate.fail_s:
            warned_before += 1
    assert warned_before / len(degrading) >= 0.8


def test_noisy_healthy_node_is_not_warned_but_its_spike_is_an_anomaly(model: FailureModel,
                                                                        config: AiopsConfig) -> None:
    findings = feed(Predictor(config, model), noisy_healthy_series())
    assert not [f for f in findings if f.rule == FAILURE_RULE]
    assert {f.rule for f in findings} >= {"gpu-temperature", "ecc-sbe-rate"}
    spike = next(f for f in findings if f.rule == "gpu-temperature")
    assert spike.t == 20 * 300.0 and spike.evidence["value"] == 92.0 and spike.evidence["gpu"] == 0


@pytest.mark.parametrize("rule", ["gpu-temperature", "ecc-sbe-rate"])
def test_a_rule_switched_off_raises_nothing(model: FailureModel, config: AiopsConfig, rule: str) -> None:
    off = config.with_disabled(rule)
    assert not off.enabled(rule) and config.enabled(rule)
    rules = {f.rule for f in feed(Predictor(off, model), noisy_healthy_series())}
    assert rule not in rules and rules  # the other rule still fires


def test_failure_rule_switched_off(model: FailureModel, config: AiopsConfig, held_out: list[DrillRun]) -> None:
    def failure_findings(cfg: AiopsConfig) -> list[Finding]:
        preds = [Predictor(cfg, model) for _ in held_out]
        return [f for pred, run in zip(preds, held_out, strict=True) for fr in run.frames
                for f in pred.observe_frame(fr) if f.rule == FAILURE_RULE]

    assert failure_findings(config)
    assert not failure_findings(config.with_disabled(FAILURE_RULE))


def test_unknown_rule_cannot_be_switched_off(config: AiopsConfig) -> None:
    with pytest.raises(ValidationError, match="rules"):
        config.with_disabled("no-such-rule")


def test_job_stall_and_queue_surge_are_anomalies(config: AiopsConfig) -> None:
    from apiary.aiops import JobSample

    pred = Predictor(config)
    found = []
    for k in range(40):
        util = 88.0 + (k % 4) if k < 30 else 0.0
        delay = 200.0 + (k % 5) * 20 if k < 35 else 3600.0
        frame = Frame(t=k * 300.0, jobs=(JobSample("u~j", "vc-a", "n1", util),), vc_delay_s={"vc-a": delay})
        found += pred.observe_frame(frame)
    assert [(f.rule, f.subject, f.t) for f in found] == [
        ("job-utilisation", "u~j", 30 * 300.0), ("vc-queue-delay", "vc-a", 35 * 300.0)]


def test_train_and_test_seeds_are_kept_apart(model: FailureModel, config: AiopsConfig,
                                             held_out: list[DrillRun]) -> None:
    with pytest.raises(ValidationError, match="test_seeds"):
        check_separate([1, 2], [2, 3])
    with pytest.raises(ValidationError, match="test_seeds"):
        evaluate([1, 2], [2, 3])  # refused before generating anything
    assert not model.seeds & {r.seed for r in held_out}
    score_runs(model, held_out, config)  # fine: unseen
    seen = min(model.seeds)
    leaked = [DrillRun(seed=seen, interval_s=300.0, frames=(), fates={})]
    with pytest.raises(ValidationError, match="training seeds"):
        score_runs(model, leaked, config)


def test_scores_on_held_out_runs_are_counted_per_node(model: FailureModel, config: AiopsConfig,
                                                      held_out: list[DrillRun]) -> None:
    r = score_runs(model, held_out, config)
    failures = sum(len(run.failures) for run in held_out)
    assert r["tp"] + r["fn"] == failures and r["nodes"] == sum(len(run.fates) for run in held_out)
    assert r["fn"] >= r["fn_sudden"] == sum(f.fate == "sudden" for run in held_out for f in run.fates.values())
    assert 0.0 <= r["precision"] <= 1.0 and 0.0 <= r["recall"] <= 1.0
    assert r["tp"] == 0 or r["lead_time_s"] >= 300.0


def test_a_finding_becomes_a_sev4_events_v2_trigger(model: FailureModel, config: AiopsConfig,
                                                    held_out: list[DrillRun]) -> None:
    pred = Predictor(config, model)
    finding = next(f for run in held_out for fr in run.frames for f in pred.observe_frame(fr)
                   if f.rule == FAILURE_RULE)
    event = finding_to_event(finding)
    assert event["dedup_key"] == f"aiops:node-failure:{finding.subject}"
    assert event["payload"]["source"] == finding.subject == finding.node
    details = event["payload"]["custom_details"]
    assert details["probability"] >= config.rules.node_failure.probability_min
    assert details["window"]["observations"] == len(details["series"]["sbeIncrease"])
    group = AlertGroup.from_events_v2(event)
    assert group.severity is Severity.SEV4 and group.action == "trigger"
    assert group.dedup_key == event["dedup_key"] and group.title == event["payload"]["summary"]
