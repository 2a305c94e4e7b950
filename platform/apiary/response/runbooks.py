"""Runbooks: the repairs the response rules name (``runbook: runbook/gpu-node-repair``), as steps
over the REST API. ``flows/runbooks.py`` runs each as a Prefect flow (each step a task run), so an
operator sees every run, its steps and their results in the UI and re-runs it from there.

Every step acts through the incident's own routes (``POST /api/v2/incidents/{id}/actions``,
``.../comment``), so each is recorded in the incident's timeline with the runbook's token as the
actor, and undone the same way (the undo of a cordon is ``uncordon-node``).

* :func:`gpu_node_repair` (AI-System 7.6.5: mitigate, then repair): contain (cordon, drain),
  reset the GPUs (simulated GPUs: the fault queue's ``clear``, as ``nvidia-smi -r`` resets a real
  one; a real node stops here and asks a person, the reset needs the node's root), verify that no
  fault is left, return the node to service (uncordon) and comment.
* :func:`node_drain`: contain only (cordon, drain), for a node someone must look at.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from apiary.errors import ApiaryError


@dataclass(frozen=True)
class Step:
    """One step's outcome: ``name``, ``ok``, and ``detail`` for people."""

    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunbookApi:
    """The calls a runbook makes; ``client`` is an :class:`apiary.client.ApiaryClient` (admin token)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def action(self, incident_id: str, action: str, node: str) -> dict[str, Any]:
        return self.client._call("POST", f"/api/v2/incidents/{incident_id}/actions",
                                 json={"action": action, "node": node}).json()

    def comment(self, incident_id: str, text: str) -> None:
        self.client._call("POST", f"/api/v2/incidents/{incident_id}/comment", json={"message": text})

    def node(self, node: str) -> dict[str, Any]:
        return next(n for n in self.client.nodes() if n["name"] == node)

    def clear_faults(self, node: str, gpus: int) -> None:
        for gpu in range(gpus):
            self.client._call("POST", f"/api/v2/nodes/{node}/faults", json={"gpu": gpu, "clear": True})

    def pending_faults(self, node: str) -> list[dict[str, Any]]:
        return self.client._call("GET", f"/api/v2/nodes/{node}/faults").json().get("faults", [])


def _act(api: RunbookApi, incident_id: str, action: str, node: str) -> Step:
    try:
        out = api.action(incident_id, action, node)
    except ApiaryError as e:
        return Step(action, False, e.message)
    return Step(action, out.get("result") == "ok", str(out.get("detail", "")))


def node_drain(api: RunbookApi, incident_id: str, node: str) -> list[Step]:
    """Cordon and drain ``node`` for ``incident_id``; stops at the first failed step."""
    steps: list[Step] = []
    for action in ("cordon-node", "drain-node"):
        steps.append(_act(api, incident_id, action, node))
        if not steps[-1].ok:
            break
    return steps


def gpu_node_repair(api: RunbookApi, incident_id: str, node: str, *, verify_s: float = 60.0,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> list[Step]:
    """The GPU node repair (module docstring). ``verify_s``: how long to wait for the node's agent
    to apply the reset. Returns the steps run, in order; a failed step ends the runbook (the node
    stays cordoned) and is commented on the incident."""
    steps = node_drain(api, incident_id, node)
    if steps and not steps[-1].ok:
        return _finish(api, incident_id, node, steps)
    info = api.node(node)
    if not info.get("simulatedGpus"):
        steps.append(Step("reset-gpus", False, f"{node} has real GPUs: reset them on the node (nvidia-smi -r, "
                                                f"or reboot), then re-run this runbook"))
        return _finish(api, incident_id, node, steps)
    try:
        api.clear_faults(node, int(info.get("gpus") or 0))
    except ApiaryError as e:
        steps.append(Step("reset-gpus", False, e.message))
        return _finish(api, incident_id, node, steps)
    steps.append(Step("reset-gpus", True, f"reset queued for {info.get('gpus')} GPUs of {node}"))
    deadline = clock() + verify_s
    while api.pending_faults(node):  # the agent applies the reset at its next report
        if clock() > deadline:
            steps.append(Step("verify", False, f"the agent of {node} did not apply the reset in {verify_s:g} s"))
            return _finish(api, incident_id, node, steps)
        sleep(0.5)
    steps.append(Step("verify", True, f"no fault left queued on {node}"))
    steps.append(_act(api, incident_id, "uncordon-node", node))
    return _finish(api, incident_id, node, steps)


def _finish(api: RunbookApi, incident_id: str, node: str, steps: list[Step]) -> list[Step]:
    ok = all(s.ok for s in steps)
    lines = [f"runbook gpu-node-repair on {node}: {'done' if ok else 'stopped'}"] + [
        f"- {s.name}: {'ok' if s.ok else 'FAILED'} ({s.detail})" for s in steps]
    try:
        api.comment(incident_id, "\n".join(lines))
    except ApiaryError:
        pass  # the steps are already in the timeline; the summary is a convenience
    return steps
