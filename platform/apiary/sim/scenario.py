"""Scenarios: a deterministic replay of a timed event list against a HiveD cluster config.

Format (YAML; paths relative to the scenario file)::

    cluster: hived-config.yaml
    events:
      - at: 0                      # simulated seconds
        user: alice                # default "user"
        duration: 100              # each task runs this long once started, then exits 0
        submit: job-config-1.yaml  # an OpenPAI job file, or an inline job object
      - at: 30
        fail-node: hostname-dan
      - at: 60
        recover-node: hostname-dan

Semantics are the live platform's: every job runs through the same lifecycle core
(:mod:`apiary.lifecycle.reducer`) and the same ``HivedScheduler`` as :mod:`apiary.control.plane`, and a
test replays scenarios through both and compares them. Jobs are tried by priority, then submission
time, then arrival order; a job the scheduler refuses at submission (unknown
VC, gang job larger than its VC, ...) or whose ``user~name`` already exists is ``REJECTED``;
``preempt`` stops the victims at once, and a preempted job restarts from scratch in a new attempt
(platform retry); gang jobs place all instances or none, ``gangAllocation: false`` jobs place what
fits; the completion policy (``minSucceededInstances``/``minFailedInstances``) decides success;
``fail-node`` marks the node unhealthy until ``recover-node`` and ends its tasks as platform
failures (the job is retried).  Events at the same instant apply in this order: task completions,
node events, submissions; then scheduling passes run until nothing changes.

Output: ``{"jobs": {"alice~name": {"state", "submitted", "started", "finished", "retries",
"preemptions", "waitingReasons": [...], "attempts": [{"started", "finished", "placements":
[{"taskRole", "index", "node", "leafCellIndices"}]}]}}}``; times in simulated seconds,
``leafCellIndices`` the leaf cells' (GPUs') indices within their node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from apiary.errors import ApiaryError, ValidationError
from apiary.lifecycle.reducer import job_policy
from apiary.scheduler import HivedScheduler
from apiary.sim.cluster import vc_gpus
from apiary.sim.engine import Engine, SimJob
from apiary.spec.cluster import ClusterConfig, load_cluster_config
from apiary.spec.job import parse_job


def _num(x: float | None) -> float | int | None:
    if x is None:
        return None
    return int(x) if float(x).is_integer() else x


def load_scenario(path: str | Path) -> tuple[ClusterConfig, list[dict]]:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ValidationError("scenario", f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or "cluster" not in doc or not isinstance(doc.get("events"), list):
        raise ValidationError("scenario", "expected a mapping with 'cluster' and a list 'events'")
    base = path.parent
    cluster = doc["cluster"]
    config = load_cluster_config(base / cluster) if isinstance(cluster, str) else ClusterConfig.from_dict(cluster)
    events = []
    for i, ev in enumerate(doc["events"]):
        where = f"events[{i}]"
        if not isinstance(ev, dict) or "at" not in ev:
            raise ValidationError(where, "each event needs 'at' (seconds)")
        kinds = [k for k in ("submit", "fail-node", "recover-node") if k in ev]
        if len(kinds) != 1:
            raise ValidationError(where, "each event needs exactly one of submit, fail-node, recover-node")
        out = dict(ev)
        out["at"] = float(ev["at"])
        if kinds[0] == "submit":
            sub = ev["submit"]
            if isinstance(sub, str):
                try:
                    out["text"] = (base / sub).read_text(encoding="utf-8")
                except OSError as e:
                    raise ValidationError(f"{where}.submit", f"cannot read {sub}: {e}") from None
            elif isinstance(sub, dict):
                out["text"] = yaml.safe_dump(sub, sort_keys=False)
            else:
                raise ValidationError(f"{where}.submit", "a job file path or an inline job object")
            if "duration" not in ev:
                raise ValidationError(f"{where}.duration", "a submit event needs duration (seconds)")
            out["duration"] = float(ev["duration"])
        events.append(out)
    return config, events


def simulate(path: str | Path) -> tuple[Engine, list[str], dict[str, dict]]:
    """Replay the scenario file at ``path``. Returns the engine after the run (its ``jobs`` carry
    every job's lifecycle record and, in order, its events ``(time, type, data)``), the accepted job
    ids in submission order, and the jobs refused before they reached the engine (bad spec,
    duplicate name) as output documents."""
    config, events = load_scenario(path)
    sched = HivedScheduler(config)
    engine = Engine(sched, "hived", vc_quota=vc_gpus(config), record=True)
    rejected: dict[str, dict] = {}
    order: list[str] = []
    nodes = sched.nodes()
    for i, ev in enumerate(sorted(events, key=lambda e: e["at"])):
        at = ev["at"]
        if "submit" in ev:
            user = str(ev.get("user", "user"))
            try:
                spec = parse_job(ev["text"])
            except ApiaryError as e:
                rejected[f"{user}~events[{i}]"] = _rejected(at, e.message)
                continue
            job_id = f"{user}~{spec.name}"
            if job_id in engine.jobs or job_id in rejected:
                rejected.setdefault(f"{job_id}#{i}", _rejected(at, f"Job name {spec.name} already exists for user "
                                                                   f"{user}."))
                continue
            policy = job_policy(job_id, spec)
            job = SimJob(id=job_id, vc=spec.virtual_cluster, priority=spec.priority, gang=spec.gang, policy=policy,
                         duration=ev["duration"], submit=at, user=user, name=spec.name,
                         priority_class=spec.priority_class,
                         gpus=sum(t.instances * t.gpu for t in policy.request.tasks))
            engine.submit(job, at)
            order.append(job_id)
        else:
            node = ev.get("fail-node") or ev.get("recover-node")
            if node not in nodes:
                raise ValidationError(f"events[{i}]", f"unknown node {node!r}")
            engine.node_event(at, node, healthy="recover-node" in ev)
    engine.run()
    return engine, order, rejected


def run_scenario(path: str | Path) -> dict:
    """Replay the scenario file at ``path``; the output document of the module docstring."""
    engine, order, rejected = simulate(path)
    out: dict[str, Any] = {}
    for job_id in order:
        j = engine.jobs[job_id]
        if j.state == "REJECTED":
            out[job_id] = _rejected(j.submit, j.rejected or "")
            continue
        rec = j.record
        assert rec is not None
        out[job_id] = {
            "state": j.state,
            "submitted": _num(j.submit),
            "started": _num(j.first_start),
            "finished": _num(j.finish),
            "retries": rec.retries_user + rec.retries_platform,
            "preemptions": j.preemptions,
            "waitingReasons": list(j.reasons),
            "attempts": [
                {"started": _num(a["started"]), "finished": _num(a["finished"]), "placements": a["placements"]}
                for a in j.attempts
            ],
        }
    out.update(rejected)
    return {"jobs": out}


def _rejected(at: float, reason: str) -> dict:
    return {"state": "REJECTED", "submitted": _num(at), "started": None, "finished": None, "retries": 0,
            "preemptions": 0, "waitingReasons": [reason], "attempts": []}
