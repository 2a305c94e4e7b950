"""The control plane's record of drill results: what ``POST /api/v2/drills/results`` receives and
``/metrics`` renders (``apiary_probe_*``, ``apiary_drill_*``; platform/apiary/monitoring/METRICS.md).

Drills run elsewhere (Prefect flows, ``python -m apiary.drills``) and report here, so their
results reach Prometheus through the one endpoint it already scrapes. The board keeps the last
result per drill and per probed VC, run counters, and the node failures of the last stress drill.

Owner of the fact: this board. With a ``path`` (``apiary up``: ``APIARY_HOME/drills.json``) it is
written through on every report (write to a temporary file, then rename), so a control-plane
restart keeps the last-success timestamps the staleness alerts read; without one it is memory
only (tests, embedders). A file that cannot be read is logged and started afresh: losing drill
history must never keep the control plane from starting.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Results a drill report may carry (``apiary_drill_result`` is 1 for ``passed`` only).
RESULTS = ("passed", "failed", "aborted")
#: Phases of an inspection probe, in order: submit -> running (``schedule``), running -> succeeded
#: (``run``), submit -> end (``total``).
PHASES = ("schedule", "run", "total")


class DrillBoard:
    """Thread-safe; :meth:`record` is idempotent per report only in the sense that it overwrites
    the last values (counters count every call). Fast: no I/O but the optional file write."""

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"drills": {}, "probes": {}, "nodeFailures": [], "runs": {}, "probeRuns": {}}
        if path is not None and path.exists():
            try:
                loaded = json.loads(path.read_text())
                if not isinstance(loaded, dict):
                    raise ValueError("not a JSON object")
                for key in self._state:
                    if key in loaded:
                        self._state[key] = loaded[key]
            except (OSError, ValueError) as e:
                logger.warning("drill results path=%s unreadable, starting afresh: %s", path, e)

    def record(self, report: dict[str, Any]) -> dict[str, Any]:
        """Record one drill report (the wire shape of ``DrillReport`` in apiary.api.schemas):
        ``drill``, ``result`` (passed / failed / aborted), ``startedAt``, ``finishedAt`` (epoch s),
        ``summary``, optional ``probes`` (``virtualCluster``, ``success``, ``phases`` {phase: s},
        ``jobId``, ``reason``) and optional ``nodeFailures`` (``node``, ``rule``, ``detail``; None
        leaves the last stress drill's list as it is, [] clears it). Returns what was stored."""
        drill = str(report["drill"])
        result = str(report["result"])
        if result not in RESULTS:
            raise ValueError(f"result must be one of {RESULTS}, not {result!r}")
        finished = float(report.get("finishedAt") or self._clock())
        started = float(report.get("startedAt") or finished)
        with self._lock:
            last = self._state["drills"].get(drill, {})
            entry = {
                "drill": drill, "result": result, "startedAt": started, "finishedAt": finished,
                "durationS": max(0.0, finished - started), "summary": str(report.get("summary") or ""),
                "lastSuccessAt": finished if result == "passed" else last.get("lastSuccessAt"),
            }
            self._state["drills"][drill] = entry
            runs = self._state["runs"].setdefault(drill, {})
            runs[result] = runs.get(result, 0) + 1
            for p in report.get("probes") or ():
                vc = str(p["virtualCluster"])
                phases = {k: float(v) for k, v in (p.get("phases") or {}).items() if k in PHASES and v is not None}
                self._state["probes"][vc] = {
                    "virtualCluster": vc, "success": bool(p["success"]), "phases": phases, "at": finished,
                    "jobId": p.get("jobId"), "reason": str(p.get("reason") or ""),
                }
                counts = self._state["probeRuns"].setdefault(vc, {})
                key = "success" if p["success"] else "failure"
                counts[key] = counts.get(key, 0) + 1
            if report.get("nodeFailures") is not None:
                self._state["nodeFailures"] = [
                    {"node": str(f["node"]), "rule": str(f["rule"]), "detail": str(f.get("detail") or ""),
                     "drill": drill, "at": finished}
                    for f in report["nodeFailures"]
                ]
            self._save()
            return dict(entry)

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._state, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:  # the metrics still answer from memory; the next report tries again
            logger.warning("drill results path=%s not written: %s", self.path, e)

    def latest(self) -> dict[str, Any]:
        """``{"drills": [...], "probes": [...], "nodeFailures": [...]}``, each list sorted by name."""
        with self._lock:
            return {
                "drills": [dict(v) for _, v in sorted(self._state["drills"].items())],
                "probes": [dict(v) for _, v in sorted(self._state["probes"].items())],
                "nodeFailures": [dict(f) for f in self._state["nodeFailures"]],
            }

    def snapshot(self) -> dict[str, Any]:
        """The keys :class:`~apiary.monitoring.platform_metrics.PlatformCollector` renders:
        ``probes``, ``probe_runs``, ``drills``, ``drill_runs``, ``drill_node_failures``."""
        with self._lock:
            return {
                "probes": [dict(v) for _, v in sorted(self._state["probes"].items())],
                "probe_runs": {vc: dict(c) for vc, c in self._state["probeRuns"].items()},
                "drills": [dict(v) for _, v in sorted(self._state["drills"].items())],
                "drill_runs": {d: dict(c) for d, c in self._state["runs"].items()},
                "drill_node_failures": [dict(f) for f in self._state["nodeFailures"]],
            }
