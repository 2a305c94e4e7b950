"""apiary.incidents.stats: MTTA / MTTM / MTTR per episode, SLA breaches (monotonic across reopens),
open incidents, notifications and escalations, as a plain snapshot."""

from __future__ import annotations

import json

import pytest

from apiary.errors import ValidationError
from apiary.incidents import Incident, Severity, apply, breaches, open_incident
from apiary.incidents.stats import KNOWN_CHANNELS, episode_breaches, episodes, notification_key, snapshot

T0 = 1_795_600_800.0  # 2026-11-25T10:00:00Z
MIN = 60.0


class Builder:
    """Kueue-style builder: ``Builder("i1", Severity.SEV2).ack(300).mitigate(600).resolve(1800).obj()``.
    Offsets are seconds after T0."""

    def __init__(self, id: str, severity: Severity = Severity.SEV2) -> None:
        self.inc = open_incident(id, f"Alert{id}: something", severity, f"key-{id}", "system", T0)

    def event(self, event: str, offset: float, actor: str = "carol", **detail: object) -> Builder:
        self.inc = apply(self.inc, event, actor, T0 + offset, **detail)
        return self

    def ack(self, offset: float) -> Builder:
        return self.event("acknowledge", offset)

    def mitigate(self, offset: float) -> Builder:
        return self.event("mitigate", offset)

    def resolve(self, offset: float) -> Builder:
        return self.event("resolve", offset)

    def obj(self) -> Incident:
        return self.inc


def test_means_are_per_severity_over_the_episodes_that_reached_each_milestone() -> None:
    a = Builder("a").ack(2 * MIN).mitigate(10 * MIN).resolve(60 * MIN).obj()
    b = Builder("b").ack(4 * MIN).resolve(30 * MIN).obj()  # no mitigate entry: resolving implies it
    c = Builder("c").obj()  # still triggered: no samples
    d = Builder("d", Severity.SEV4).resolve(5 * MIN).obj()  # resolved unacknowledged: acknowledged at 5 min
    snap = snapshot([a, b, c, d], now=T0 + 2 * 3600)
    assert snap["mtta"] == {"sev1": None, "sev2": 3 * MIN, "sev3": None, "sev4": 5 * MIN}
    assert snap["mttm"]["sev2"] == (10 * MIN + 30 * MIN) / 2
    assert snap["mttr"]["sev2"] == (60 * MIN + 30 * MIN) / 2
    assert snap["samples"]["acknowledge"]["sev2"] == 2
    assert snap["total"] == {"sev1": 0, "sev2": 3, "sev3": 0, "sev4": 1}
    assert snap["open"]["sev2"] == {"triggered": 1, "acknowledged": 0, "mitigated": 0}
    json.dumps(snap)  # plain data


def test_a_reopened_incident_counts_one_sample_per_episode_from_each_episode_start() -> None:
    inc = (Builder("r").ack(1 * MIN).resolve(10 * MIN)
           .event("reopen", 20 * MIN, actor="system").ack(23 * MIN).obj())
    eps = episodes(inc)
    assert [(e.start - T0, e.current) for e in eps] == [(0.0, False), (20 * MIN, True)]
    assert eps[1].reached["acknowledge"] == T0 + 23 * MIN and eps[1].reached["resolve"] is None
    snap = snapshot([inc], now=T0 + 30 * MIN)
    assert snap["mtta"]["sev2"] == (1 * MIN + 3 * MIN) / 2
    assert snap["mttr"]["sev2"] == 10 * MIN
    assert snap["open"]["sev2"]["acknowledged"] == 1


def test_a_retrigger_does_not_start_an_episode_and_the_first_ack_counts() -> None:
    inc = Builder("t").ack(2 * MIN).event("retrigger", 30 * MIN, actor="system").ack(31 * MIN).obj()
    assert len(episodes(inc)) == 1
    assert snapshot([inc], now=T0 + 40 * MIN)["mtta"]["sev2"] == 2 * MIN


@pytest.mark.parametrize(
    ("build", "now_offset", "expected"),
    [
        # sev2: ack 15 min, mitigate 2 h, resolve 24 h.
        (lambda: Builder("x").ack(15 * MIN).obj(), 20 * MIN, {}),  # exactly at the deadline is in time
        (lambda: Builder("x").ack(16 * MIN).obj(), 20 * MIN, {"acknowledge": 1}),
        (lambda: Builder("x").obj(), 14 * MIN, {}),
        (lambda: Builder("x").obj(), 3 * 3600, {"acknowledge": 1, "mitigate": 1}),
        (lambda: Builder("x").ack(MIN).resolve(25 * 3600).obj(), 26 * 3600, {"mitigate": 1, "resolve": 1}),
        # sev3 has no mitigation target: never a mitigate breach.
        (lambda: Builder("x", Severity.SEV3).obj(), 5 * 86400, {"acknowledge": 1, "resolve": 1}),
    ],
    ids=["ack-at-deadline", "ack-late", "before-deadline", "unacked-past-two", "resolved-late", "sev3-no-mitigate"],
)
def test_sla_breaches_by_milestone(build, now_offset: float, expected: dict[str, int]) -> None:
    inc = build()
    snap = snapshot([inc], now=T0 + now_offset)
    sev = inc.severity.value
    assert snap["sla_breaches"][sev] == {m: expected.get(m, 0) for m in ("acknowledge", "mitigate", "resolve")}
    # the current episode's breaches are exactly model.breaches'
    assert [b.milestone for b in episode_breaches(inc, T0 + now_offset)] == breaches(inc, T0 + now_offset)


def test_breaches_of_a_past_episode_stay_counted_after_a_reopen() -> None:
    late = Builder("late").ack(20 * MIN).resolve(30 * MIN).obj()  # ack breached in episode 0
    before = snapshot([late], now=T0 + 40 * MIN)["sla_breaches"]["sev2"]["acknowledge"]
    reopened = apply(late, "reopen", "system", T0 + 50 * MIN)
    reopened = apply(reopened, "acknowledge", "carol", T0 + 51 * MIN)
    after = snapshot([reopened], now=T0 + 60 * MIN)["sla_breaches"]["sev2"]["acknowledge"]
    assert before == 1 and after == 1  # a counter: the reopen does not make it go down
    assert breaches(reopened, T0 + 60 * MIN) == []  # while the model's current-episode view is clean


def test_notifications_and_escalations_are_counted_from_the_timeline() -> None:
    inc = (Builder("n").event("notify", 1, actor="system", channel="email", target="dri@example.org")
           .event("notify", 2, actor="system", channel="im", result="failed", error="HTTP 500")
           .event("notify", 3, actor="system", channel="pager-duty")  # an unknown channel still counts
           .event("escalate", 900, actor="escalation-policy", tier=2)
           .event("escalate", 1800, actor="escalation-policy", tier=3).obj())
    snap = snapshot([inc], now=T0 + 3600)
    assert snap["notifications"]["email"] == {"sent": 1, "failed": 0}
    assert snap["notifications"]["im"] == {"sent": 0, "failed": 1}
    assert snap["notifications"]["pager-duty"] == {"sent": 1, "failed": 0}
    assert set(KNOWN_CHANNELS) <= set(snap["notifications"])  # zeros for the known channels
    assert snap["notifications"]["phone"] == {"sent": 0, "failed": 0}
    assert snap["escalations"] == 2


@pytest.mark.parametrize(
    ("detail", "key"),
    [
        ({"channel": "sms", "ok": True, "outcome": "sent"}, ("sms", "sent")),
        ({"channel": "sms", "ok": False, "outcome": "rejected"}, ("sms", "rejected")),
        ({"channel": "email", "ok": False}, ("email", "failed")),
        ({"recipient": "dave", "ok": False, "detail": "no contact for dave"}, ("unknown", "failed")),
        ({"channel": "im", "result": "failed", "outcome": "sent"}, ("im", "failed")),  # result wins
    ],
    ids=["outcome-sent", "outcome-rejected", "ok-false", "no-channel", "result-first"],
)
def test_notification_key_reads_the_dispatchers_fields(detail: dict, key: tuple[str, str]) -> None:
    inc = Builder("k").event("notify", 1, actor="system", **detail).obj()
    assert notification_key(inc.timeline[-1]) == key
    channel, result = key
    assert snapshot([inc], now=T0 + 2)["notifications"][channel][result] == 1


def test_an_empty_list_gives_zeros_and_no_means() -> None:
    snap = snapshot([], now=T0)
    assert snap["total"] == dict.fromkeys(("sev1", "sev2", "sev3", "sev4"), 0)
    assert all(v is None for v in snap["mttr"].values())
    assert all(n == 0 for per in snap["sla_breaches"].values() for n in per.values())
    assert snap["escalations"] == 0


@pytest.mark.parametrize("now", [float("nan"), float("inf"), True], ids=["nan", "inf", "bool"])
def test_a_non_finite_now_is_refused(now: float) -> None:
    with pytest.raises(ValidationError) as e:
        snapshot([], now=now)
    assert e.value.field == "now"
