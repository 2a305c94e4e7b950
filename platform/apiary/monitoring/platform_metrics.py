"""Control-plane metrics: jobs, queues, VC cells, nodes, heartbeats, scheduling cycles.

:class:`PlatformCollector` renders a *snapshot* dict the control plane builds on each scrape (cheap
aggregate queries; see :class:`PlatformCollector` for the keys). The scheduling loop calls
:func:`observe_cycle` after every cycle; in-process services may call :func:`beat`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Not registered anywhere by itself: PlatformCollector yields it, so whichever registry holds the
# PlatformCollector exposes it (and importing this module twice cannot collide in a default registry).
SCHEDULING_CYCLE_SECONDS = Histogram(
    "apiary_scheduling_cycle_seconds",
    "Duration of a scheduling cycle (ControlPlane.cycle).",
    buckets=CYCLE_BUCKETS,
    registry=None,
)

_lock = threading.Lock()
_last_cycle_at: float | None = None
_heartbeats: dict[tuple[str, str], float] = {}

CELL_STATES = ("used", "free", "opportunistic", "bad")


def observe_cycle(seconds: float, *, at: float | None = None) -> None:
    """Record one scheduling cycle of ``seconds`` that ended at ``at`` (default: now)."""
    global _last_cycle_at
    SCHEDULING_CYCLE_SECONDS.observe(seconds)
    with _lock:
        _last_cycle_at = time.time() if at is None else at


def beat(service: str, instance: str, *, at: float | None = None) -> None:
    """Record a heartbeat of an in-process service (merged with the snapshot's ``heartbeats``)."""
    with _lock:
        _heartbeats[(service, instance)] = time.time() if at is None else at


def _reset_for_tests() -> None:
    global _last_cycle_at
    with _lock:
        _last_cycle_at = None
        _heartbeats.clear()


Snapshot = Mapping[str, Any]


class PlatformCollector:
    """Renders ``snapshot()`` (and the module-level cycle histogram and heartbeats). Snapshot keys, all optional:

    ``now``
        epoch seconds the snapshot was taken (default ``clock()``), for waiting times.
    ``jobs``
        ``{virtual_cluster: {state: count}}`` -> ``apiary_jobs{state,virtual_cluster}``; include zeros
        for the states you want as explicit 0 series.
    ``waiting_jobs``
        ``[{"job", "user", "virtual_cluster", "submitted_at"}]`` (WAITING jobs, ``submitted_at`` in epoch
        seconds) -> ``apiary_job_waiting_seconds`` = now - submitted_at.
    ``queue_length``
        ``{virtual_cluster: n}`` -> ``apiary_job_queue_length``; default: ``waiting_jobs`` counted per VC.
    ``preemptions``
        ``{virtual_cluster: total}`` (cumulative, counted from the job events in the store) ->
        ``apiary_preemptions_total``.
    ``vc_cells``
        ``{virtual_cluster: {"used"|"free"|"opportunistic"|"bad": n}}`` -> ``apiary_vc_cells`` (leaf
        cells, i.e. GPUs; missing states are exported as 0).
    ``nodes``
        ``[{"node", "healthy": bool, "cordoned": bool}]`` -> ``apiary_node_healthy`` / ``apiary_node_cordoned``.
    ``heartbeats``
        ``[{"service", "instance", "timestamp"}]`` -> ``apiary_service_heartbeat_timestamp_seconds``
        (e.g. ``service="node-agent", instance=<node>`` from the agents' reports).
    ``last_cycle_at``
        epoch seconds of the last scheduling cycle; default: the last :func:`observe_cycle`.
    ``probes``
        ``[{"virtualCluster", "success": bool, "phases": {phase: s}, "at"}]`` (the last inspection probe
        per VC, :class:`apiary.drills.board.DrillBoard`) -> ``apiary_probe_success``,
        ``apiary_probe_duration_seconds``, ``apiary_probe_last_run_timestamp_seconds``.
    ``probe_runs``
        ``{virtual_cluster: {"success"|"failure": n}}`` -> ``apiary_probe_runs_total``.
    ``drills``
        ``[{"drill", "result", "finishedAt", "durationS", "lastSuccessAt"}]`` -> ``apiary_drill_result``,
        ``apiary_drill_last_run_timestamp_seconds``, ``apiary_drill_last_success_timestamp_seconds``,
        ``apiary_drill_duration_seconds``.
    ``drill_runs``
        ``{drill: {"passed"|"failed"|"aborted": n}}`` -> ``apiary_drill_runs_total``.
    ``drill_node_failures``
        ``[{"node", "rule"}]`` (the last stress drill's) -> ``apiary_drill_node_failed``.
    """

    def __init__(self, snapshot: Callable[[], Snapshot] | None = None, *, clock: Callable[[], float] = time.time):
        self._snapshot = snapshot
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        snap: Snapshot = self._snapshot() if self._snapshot is not None else {}
        now = float(snap.get("now") or self._clock())

        jobs = GaugeMetricFamily("apiary_jobs", "Jobs by state.", labels=["state", "virtual_cluster"])
        for vc, states in sorted((snap.get("jobs") or {}).items()):
            for state, n in sorted(states.items()):
                jobs.add_metric([str(state), vc], float(n))
        yield jobs

        waiting = list(snap.get("waiting_jobs") or ())
        queue = snap.get("queue_length")
        if queue is None:
            queue = {}
            for j in waiting:
                queue[j.get("virtual_cluster", "")] = queue.get(j.get("virtual_cluster", ""), 0) + 1
        q = GaugeMetricFamily("apiary_job_queue_length", "WAITING jobs.", labels=["virtual_cluster"])
        for vc, n in sorted(queue.items()):
            q.add_metric([vc], float(n))
        yield q

        w = GaugeMetricFamily(
            "apiary_job_waiting_seconds", "Seconds a WAITING job has waited since submission.",
            labels=["job", "user", "virtual_cluster"],
        )
        for j in waiting:
            submitted = j.get("submitted_at")
            if submitted is None:
                continue
            w.add_metric(
                [str(j.get("job", "")), str(j.get("user", "")), str(j.get("virtual_cluster", ""))],
                max(0.0, now - float(submitted)),
            )
        yield w

        yield from SCHEDULING_CYCLE_SECONDS.collect()
        with _lock:
            last = _last_cycle_at
            beats = dict(_heartbeats)
        last = snap.get("last_cycle_at", last)
        g = GaugeMetricFamily(
            "apiary_scheduling_last_cycle_timestamp_seconds", "End of the last scheduling cycle (epoch seconds)."
        )
        if last is not None:
            g.add_metric([], float(last))
        yield g

        p = CounterMetricFamily(
            "apiary_preemptions", "Jobs preempted since the platform started.", labels=["virtual_cluster"]
        )
        for vc, n in sorted((snap.get("preemptions") or {}).items()):
            p.add_metric([vc], float(n))
        yield p

        cells = GaugeMetricFamily(
            "apiary_vc_cells", "Leaf cells of a VC by state.", labels=["virtual_cluster", "state"]
        )
        for vc, by_state in sorted((snap.get("vc_cells") or {}).items()):
            for state in (*CELL_STATES, *sorted(set(by_state) - set(CELL_STATES))):
                cells.add_metric([vc, state], float(by_state.get(state, 0)))
        yield cells

        healthy = GaugeMetricFamily("apiary_node_healthy", "1 when the node is healthy.", labels=["node"])
        cordoned = GaugeMetricFamily("apiary_node_cordoned", "1 when the node is cordoned.", labels=["node"])
        for n in snap.get("nodes") or ():
            healthy.add_metric([str(n["node"])], 1.0 if n.get("healthy") else 0.0)
            cordoned.add_metric([str(n["node"])], 1.0 if n.get("cordoned") else 0.0)
        yield healthy
        yield cordoned

        for hb in snap.get("heartbeats") or ():
            if hb.get("timestamp") is not None:
                beats[(str(hb["service"]), str(hb["instance"]))] = float(hb["timestamp"])
        h = GaugeMetricFamily(
            "apiary_service_heartbeat_timestamp_seconds", "Last heartbeat of a service instance (epoch seconds).",
            labels=["service", "instance"],
        )
        for (service, instance), ts in sorted(beats.items()):
            h.add_metric([service, instance], ts)
        yield h

        yield from _drill_families(snap)


def _drill_families(snap: Snapshot) -> Iterator[Metric]:
    """The inspection probe's and the drills' families (snapshot keys in :class:`PlatformCollector`)."""
    success = GaugeMetricFamily("apiary_probe_success", "1 when the last inspection probe of the VC met its SLO.",
                                labels=["virtual_cluster"])
    duration = GaugeMetricFamily(
        "apiary_probe_duration_seconds",
        "Phase durations of the last inspection probe: schedule (submit to running), run (running to "
        "succeeded), total (submit to its end).", labels=["virtual_cluster", "phase"])
    last = GaugeMetricFamily("apiary_probe_last_run_timestamp_seconds", "End of the last inspection probe (epoch s).",
                             labels=["virtual_cluster"])
    for p in snap.get("probes") or ():
        vc = str(p["virtualCluster"])
        success.add_metric([vc], 1.0 if p.get("success") else 0.0)
        for phase, seconds in sorted((p.get("phases") or {}).items()):
            duration.add_metric([vc, str(phase)], float(seconds))
        if p.get("at") is not None:
            last.add_metric([vc], float(p["at"]))
    yield success
    yield duration
    yield last
    runs = CounterMetricFamily("apiary_probe_runs", "Inspection probes by result (success, failure).",
                               labels=["virtual_cluster", "result"])
    for vc, counts in sorted((snap.get("probe_runs") or {}).items()):
        for result, n in sorted(counts.items()):
            runs.add_metric([vc, str(result)], float(n))
    yield runs

    result = GaugeMetricFamily("apiary_drill_result", "1 when the drill's last run passed, 0 when it failed or "
                               "was aborted.", labels=["drill"])
    ran = GaugeMetricFamily("apiary_drill_last_run_timestamp_seconds", "End of the drill's last run (epoch s).",
                            labels=["drill"])
    ok = GaugeMetricFamily("apiary_drill_last_success_timestamp_seconds",
                           "End of the drill's last passed run (epoch s); absent until one passes.", labels=["drill"])
    took = GaugeMetricFamily("apiary_drill_duration_seconds", "Duration of the drill's last run.", labels=["drill"])
    for d in snap.get("drills") or ():
        name = str(d["drill"])
        result.add_metric([name], 1.0 if d.get("result") == "passed" else 0.0)
        ran.add_metric([name], float(d["finishedAt"]))
        took.add_metric([name], float(d.get("durationS") or 0.0))
        if d.get("lastSuccessAt") is not None:
            ok.add_metric([name], float(d["lastSuccessAt"]))
    yield result
    yield ran
    yield ok
    yield took
    counted = CounterMetricFamily("apiary_drill_runs", "Drill runs by result (passed, failed, aborted).",
                                  labels=["drill", "result"])
    for name, counts in sorted((snap.get("drill_runs") or {}).items()):
        for res, n in sorted(counts.items()):
            counted.add_metric([name, str(res)], float(n))
    yield counted
    failed = GaugeMetricFamily("apiary_drill_node_failed",
                               "1 for each (node, rule) the last stress drill's diagnosis failed.",
                               labels=["node", "rule"])
    for f in snap.get("drill_node_failures") or ():
        failed.add_metric([str(f["node"]), str(f["rule"])], 1.0)
    yield failed
