"""An in-memory stand-in for :class:`apiary.drills.common.DrillApi`, for the drills' unit tests.

Jobs follow a *plan*: ``plan(job_doc) -> [job dict, ...]``, the answers of successive ``get``
calls (the last one repeats). ``FakeApi.job(...)`` builds those dicts with the API's field names
and ISO times. The real control plane is exercised by tests/drills/test_drills_e2e.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import yaml

from apiary.errors import ForbiddenError, UnavailableError

T0 = 1_700_000_000.0


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(round((ts % 1) * 1000)):03d}Z"


def job(job_id: str, state: str, *, submitted: float = T0, started: float | None = None,
        completed: float | None = None, node: str | None = None, exit_code: int | None = None,
        waiting_reason: str | None = None, platform_retries: int = 0, priority: str = "oppo") -> dict:
    return {
        "id": job_id, "state": state, "priorityClass": priority, "submissionTime": iso(submitted),
        "completionTime": iso(completed), "exitCode": exit_code, "exitPhrase": None,
        "waitingReason": waiting_reason, "retryDetails": {"user": 0, "platform": platform_retries},
        "tasks": [{"node": node, "startTime": iso(started), "state": state}],
    }


Plan = Callable[[dict], list[dict]]


class FakeApi:
    """The DrillApi calls the drills make. ``plan`` decides each job's life; ``logs`` maps a node
    to its benchmark output; ``refuse_cordon`` makes cordons 403 (a service token)."""

    def __init__(self, plan: Plan, *, vcs: tuple[str, ...] = ("default", "vc1"), nodes: list[dict] | None = None,
                 logs: dict[str, str | list[str]] | None = None, refuse_cordon: bool = False) -> None:
        self.plan = plan
        self.vcs = vcs
        self._nodes = [dict(n) for n in nodes or []]  # cordons change the copies only
        self._logs = logs or {}
        self.refuse_cordon = refuse_cordon
        self.api_url, self.token, self.user = "http://fake", "t", "admin"
        self.submitted: list[dict] = []
        self.stopped: list[str] = []
        self.cordons: list[tuple[str, bool]] = []
        self.cordon_calls: list[dict] = []
        self.reports: list[dict] = []
        self.running: list[dict] = []
        self._plans: dict[str, list[dict]] = {}
        self._gets: dict[str, int] = {}
        self.down = False

    def cluster_status(self) -> dict:
        if self.down:
            raise UnavailableError("Apiary API at http://fake is not reachable")
        return {"virtualClusters": {vc: {} for vc in self.vcs}}

    def submit_job(self, text: str) -> dict:
        doc = yaml.safe_load(text)
        job_id = f"{self.user}~{doc['name']}"
        self.submitted.append(doc)
        self._plans[job_id] = self.plan({**doc, "id": job_id})
        return {"id": job_id, "state": "WAITING"}

    def get(self, job_id: str) -> dict:
        if job_id in self._plans:
            plan, n = self._plans[job_id], self._gets.get(job_id, 0)
            self._gets[job_id] = n + 1
            return plan[min(n, len(plan) - 1)]
        return next(j for j in self.running if j["id"] == job_id)

    def list(self, **filters: Any) -> list[dict]:
        return [j for j in self.running if filters.get("state") in (None, j["state"])]

    def stop(self, job_id: str) -> dict:
        self.stopped.append(job_id)
        return {"id": job_id}

    def nodes(self) -> list[dict]:
        return [dict(n) for n in self._nodes]

    def cordon(self, node: str, value: bool = True, *, reason: str | None = None, source: str | None = None,
               all: bool = False) -> dict:
        if self.refuse_cordon:
            raise ForbiddenError("Only admins may do this; you are the service bridge.")
        self.cordons.append((node, value))
        self.cordon_calls.append({"node": node, "value": value, "reason": reason, "source": source, "all": all})
        for n in self._nodes:
            if n["name"] == node:  # a set of cordons by source, as the platform keeps them
                held = [c for c in n.get("cordons") or [] if not all and c["source"] != (source or "admin")]
                if value:
                    held.append({"source": source or "admin", "reason": reason})
                n["cordons"], n["cordoned"], n["schedulable"] = held, bool(held), not held
        return {"name": node}

    def logs(self, job_id: str, task_role: str | None = None, **_: Any) -> str:
        """The node's benchmark output; a list gives one output per job run there (the last repeats)."""
        node = self.get(job_id)["tasks"][0]["node"]
        out = self._logs.get(node, "")
        if isinstance(out, list):
            return out.pop(0) if len(out) > 1 else out[0]
        return out

    def report(self, report: dict) -> dict:
        self.reports.append(report)
        return report


def node(name: str, sku: str = "GPU-C", *, gpus: int = 1, simulated: bool = True, cordoned: bool = False,
         ready: bool = True) -> dict:
    return {"name": name, "skuType": sku, "gpus": gpus, "simulatedGpus": simulated, "cordoned": cordoned,
            "schedulable": ready and not cordoned, "ready": ready}
