"""The durable escalation worker: pages whoever is due, from deadlines kept in the store.

Each incident with an escalation policy has one ``escalations`` row: the facts
:func:`apiary.oncall.next_page` needs and the next page's deadline ``next_at``. The worker (a
thread in the control-plane process, like the scheduling loop) sleeps until the earliest
deadline (at most ``poll_s``; a new deadline wakes it), pages, then stores the following
deadline. Nothing is kept in memory, so a control plane killed during a wait pages on time when
it is back (late by its restart at most), and one killed between sending a page and storing the
next deadline sends that page again: at least once, never lost.

A page: the tier's targets are resolved against the schedules at the page's instant
(:func:`apiary.oncall.resolve_targets`); each person is reached on the channels the routing
table gives for the incident's severity and the hour (:meth:`Routing`'s rule, ``notify`` first
or all), through :class:`apiary.response.channels.Dispatcher` (retries, fallback, circuit
breaker). Every attempt is a ``notify`` entry in the timeline and an ``incident_notifications``
row; a page to tier 2 or later (or a later loop) is an ``escalate`` entry first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from apiary.incidents import Incident, IncidentState
from apiary.oncall import next_page, resolve_targets
from apiary.oncall.routing import Severity as RoutingSeverity
from apiary.oncall.routing import match_rule
from apiary.response.channels import Attempt, Contact, Dispatcher, Message, delivered
from apiary.response.links import LinkSigner
from apiary.response.service import SYSTEM, IncidentService
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

_TICK = timedelta(microseconds=1)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class Pager:
    """Reaches people about an incident. ``contact(user)``: their :class:`Contact` (None: unknown)."""

    def __init__(self, service: IncidentService, dispatcher: Dispatcher, contact: Callable[[str], Contact | None],
                 signer: LinkSigner | None) -> None:
        self.service, self.dispatcher, self.contact, self.signer = service, dispatcher, contact, signer

    def message(self, incident: Incident, recipient: str, why: str) -> Message:
        links = incident.links
        body = "\n".join(filter(None, [
            why, f"Incident {incident.id}: {incident.title}", f"Severity: {incident.severity.value}",
            f"State: {incident.state.value}", f"Opened: {iso(incident.opened_at)}",
            f"Nodes: {', '.join(links.nodes)}" if links.nodes else "",
            f"Jobs: {', '.join(links.jobs)}" if links.jobs else "",
            f"CLI: apiary incident ack {incident.id}",
        ]))
        return Message(incident_id=incident.id, severity=incident.severity.value, title=incident.title, body=body,
                       ack_url=self.signer.url(incident.id, "acknowledge", recipient) if self.signer else None,
                       resolve_url=self.signer.url(incident.id, "resolve", recipient) if self.signer else None)

    def page(self, incident: Incident, users: list[str], at: float, why: str, tier: int | None = None) -> None:
        """Notify each of ``users`` (blocking; records every attempt)."""
        routing = self.service.config.oncall.routing
        rule = match_rule(routing.rules, routing.working_hours, RoutingSeverity.parse(incident.severity.value),
                          _dt(at))
        channels = [c.value for c in rule.channels]
        for user in users:
            contact = self.contact(user)
            if contact is None:
                self.service._apply(incident.id, "notify", SYSTEM, recipient=user, ok=False, tier=tier,
                                    detail=f"no contact for {user}: add them to contacts or give them an email")
                continue
            message = self.message(incident, user, why)
            if rule.notify == "all":
                # Every channel once: one that fails falls back to those after it, and a channel
                # a fallback already reached is not paged again on its own turn.
                reached: set[str] = set()
                for i, channel in enumerate(channels):
                    if channel in reached:
                        continue
                    rest = [c for c in channels[i + 1:] if c not in reached]
                    sent = delivered(self._deliver(incident.id, message, contact, [channel, *rest], tier))
                    if sent is not None:
                        reached.add(sent.channel)
            else:
                self._deliver(incident.id, message, contact, channels, tier)

    def _deliver(self, incident_id: str, message: Message, contact: Contact, channels: list[str],
                 tier: int | None) -> list[Attempt]:
        attempts = self.dispatcher.deliver(message, contact, channels)
        for a in attempts:
            self.service.store.record_notification(incident_id, at=a.at.timestamp(), channel=a.channel,
                                                   recipient=a.recipient, attempt=a.attempt, ok=a.ok,
                                                   detail=a.detail)
            self.service._apply(incident_id, "notify", SYSTEM, channel=a.channel, recipient=a.recipient,
                                attempt=a.attempt, ok=a.ok, outcome=a.outcome.value, detail=a.detail, tier=tier)
        return attempts


class EscalationWorker:
    """Start with :meth:`start`, stop with :meth:`stop`. :meth:`tick` does one pass (tests call it)."""

    def __init__(self, service: IncidentService, pager: Pager, *, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.time,
                 periodic: tuple[float, Callable[[], object]] | None = None) -> None:
        """``periodic``: ``(every_s, fn)`` run between passes at most every ``every_s`` (the job
        triage); its failures are logged."""
        self.service, self.pager, self.poll_s, self.clock = service, pager, poll_s, clock
        self.periodic, self._periodic_at = periodic, 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="escalation-worker", daemon=True)
        service.wake = self._wake.set

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(join_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                if self.periodic is not None and time.monotonic() >= self._periodic_at:
                    self._periodic_at = time.monotonic() + self.periodic[0]
                    self.periodic[1]()
                nxt = self.service.store.next_deadline()
            except Exception:  # keep escalating: a store hiccup must not end the thread
                logger.exception("escalation pass failed")
                nxt = None
            wait = self.poll_s if nxt is None else min(self.poll_s, max(0.0, nxt - self.clock()))
            self._wake.wait(wait)
            self._wake.clear()

    def tick(self) -> int:
        """Send every page that is due; returns how many deadlines were handled."""
        handled = 0
        for incident_id, due_at in self.service.store.due(self.clock()):
            try:
                self._handle(incident_id, due_at)
            except Exception:
                logger.exception("escalation of incident %s failed; retried next pass", incident_id)
                continue
            handled += 1
        return handled

    def _handle(self, incident_id: str, due_at: float) -> None:
        store, config = self.service.store, self.service.config
        incident = store.get(incident_id)
        esc = store.escalation(incident_id)
        if esc is None:
            return
        if not incident.state.is_open:
            store.advance(incident_id, due_at, None)
            return
        policy = config.oncall.policy(esc["policy"])
        started, ack = esc["startedAt"], esc["acknowledgedAt"]
        page = next_page(policy, _dt(started), _dt(ack) if ack is not None else None, _dt(due_at))
        if page is None:
            store.advance(incident_id, due_at, None)
            return
        if ack is not None:
            # The acknowledgement timed out (PagerDuty's ack timeout): back to triggered, and a new
            # plan from tier 1 at this instant.
            if incident.state != IncidentState.ACKNOWLEDGED:
                store.advance(incident_id, due_at, None)  # mitigated: someone is on it
                return
            incident = self.service._apply(incident_id, "retrigger", SYSTEM,
                                           reason="not resolved within the policy's acknowledgement timeout")
            started, ack = page.at.timestamp(), None
            store.set_escalation(incident_id, policy=esc["policy"], started_at=started, acknowledged_at=None,
                                 next_at=due_at)
            page = next_page(policy, page.at, None, page.at)
            assert page is not None
        now = self.clock()
        tier = policy.tiers[page.tier - 1]
        users = resolve_targets(tier, config.oncall.schedule_map(), _dt(now))
        if page.tier > 1 or page.loop > 0:
            incident = self.service._apply(incident_id, "escalate", SYSTEM, tier=page.tier, loop=page.loop,
                                           targets=users, dueAt=iso(page.at.timestamp()),
                                           lateS=round(now - page.at.timestamp(), 3),
                                           reason="nobody acknowledged in time")
        why = (f"You are paged (tier {page.tier}" + (f", loop {page.loop + 1}" if page.loop else "") +
               ") because nobody has acknowledged this incident." if page.tier > 1 or page.loop
               else f"You are on call (tier {page.tier}) for a new incident.")
        logger.info("incident %s: paging tier %d loop %d: %s (due %.3f, now %.3f)", incident_id, page.tier,
                    page.loop, users, page.at.timestamp(), now)
        self.pager.page(incident, users, now, why, tier=page.tier)
        nxt = next_page(policy, _dt(started), None, page.at + _TICK)
        store.advance(incident_id, due_at, nxt.at.timestamp() if nxt else None)
