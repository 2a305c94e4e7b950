"""The people and machines that use an Apiary platform, as Locust users.

Imported by the profile locustfiles (``smoke.py``, ``ramp.py``, ``steady.py``, ``spike.py``); Locust
runs them in its own process (it monkey-patches the standard library with gevent), never inside
Apiary. Everything comes from the JSON file named by ``APIARY_LOAD_TOKENS_FILE``, which
``apiary load run`` (:mod:`apiary.load.runner`) writes after creating the users and tokens on the
target with the admin token::

    {"runId": "...", "virtualCluster": "default", "gpus": 1, "command": "sleep 1",
     "image": "python:3.11-slim", "priority": null, "acceptedFile": "/out/accepted.txt",
     "engineers": [{"user": "load-eng-000", "token": "..."}, ...],
     "operators": [{"user": "admin", "token": "..."}],
     "agents": [{"node": "n1", "token": "...", "gpus": 8, "simulatedGpus": true,
                 "address": "127.0.0.1", "metricsUrl": null}, ...]}

Users and weights (Locust spawns the weighted classes in this ratio; the fixed ones first):

* :class:`MLEngineer`, weight 9: submits tiny jobs (``command`` in ``virtualCluster``, ``gpus`` GPUs,
  a unique name) with their own token, polls their newest unfinished job (else their last finished
  one), reads a job's logs (the last finished one's, else the newest), lists their jobs
  (``?username=``). Every 202 is appended to ``acceptedFile`` (the runner checks afterwards that
  each one is listed: no accepted job lost). Task weights: submit 1, poll 5, logs 2, list 2; a
  pause of 1-4 s between tasks.
* :class:`Operator`, weight 1: the node list and the cluster status (1:1), with the admin token,
  a pause of 2-5 s between them.
* :class:`NodeAgentReports` and :class:`NodeAgentWatch`, one of each per node (``fixed_count``),
  only when the run asks for them (``apiary load run --agents``; otherwise ``agents`` is empty):
  node agents' traffic on top of the real agents', with each node's own agent token, shaped like
  ``apiary.runtime.agent.NodeAgent``: a heartbeat every 2 s (``POST /api/v2/nodes/{node}/status``)
  and the long poll of ``GET /api/v2/nodes/{node}/assignments`` (``generation``, ``wait=10``).
  They never interfere with the platform's real agents: a heartbeat carries an empty run list (no
  run is ever reported started, exited or lost) and the node's real GPU count, address and metrics
  URL (read by the runner from ``GET /api/v2/nodes``), and the assignments are read, never acted
  on. The runner only lists nodes whose real agent reports (``ready``), so a load agent never makes
  a dead node look alive. What differs is the ``agentId`` (``load-<node>``): the control plane
  records the last reporter's id, so each heartbeat of either kind changes it and is written to
  the store, a heavier background than real agents alone.

Request names group per endpoint: ``/api/v2/jobs/[id]``, ``/api/v2/nodes/[node]/status``; the gate
files key them as ``"<METHOD> <name>"``.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

from locust import between, constant
from locust.contrib.fasthttp import FastHttpUser

#: The agent's heartbeat period and long-poll wait (apiary.runtime.agent: HEARTBEAT_S, LONG_POLL_S).
HEARTBEAT_S = 2.0
LONG_POLL_S = 10.0
FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


def _config() -> dict[str, Any]:
    path = os.environ.get("APIARY_LOAD_TOKENS_FILE")
    if not path:
        raise RuntimeError("APIARY_LOAD_TOKENS_FILE is not set: run the load test with `apiary load run`, "
                           "which creates the users and tokens on the target and writes that file")
    return json.loads(Path(path).read_text(encoding="utf-8"))


CONFIG = _config()
_accepted = None


def record_accepted(job_id: str) -> None:
    """Append an accepted (202) job id to the file the runner reads after the run."""
    global _accepted
    if _accepted is None:
        _accepted = open(CONFIG["acceptedFile"], "a", buffering=1, encoding="utf-8")  # open for the whole run
    _accepted.write(job_id + "\n")


def job_yaml(name: str) -> str:
    """A one-instance OpenPAI v2 job running the configured command."""
    priority = CONFIG.get("priority")
    extras = f"extras:\n  hivedScheduler:\n    jobPriorityClass: {priority}\n" if priority else ""
    return f"""\
protocolVersion: 2
name: {name}
type: job
prerequisites:
  - protocolVersion: 2
    name: load_image
    type: dockerimage
    uri: {CONFIG.get("image", "python:3.11-slim")}
taskRoles:
  main:
    instances: 1
    dockerImage: load_image
    resourcePerInstance:
      cpu: 1
      memoryMB: 1024
      gpu: {int(CONFIG.get("gpus", 1))}
    commands:
      - {CONFIG.get("command", "sleep 1")}
defaults:
  virtualCluster: {CONFIG["virtualCluster"]}
{extras}"""


class _Authed(FastHttpUser):
    abstract = True
    #: long polls answer after LONG_POLL_S; anything slower than this is a failure
    network_timeout = 60.0
    connection_timeout = 30.0

    def _auth(self, token: str) -> None:
        self.auth_headers = {"Authorization": f"Bearer {token}"}


class MLEngineer(_Authed):
    """An ML engineer with their own user and token (one Apiary user per concurrent engineer)."""

    weight = 9
    wait_time = between(1, 4)
    _seq = itertools.count()

    def on_start(self) -> None:
        me = next(MLEngineer._seq)
        people = CONFIG["engineers"]
        account = people[me % len(people)]
        self.user_name: str = account["user"]
        self._auth(account["token"])
        self._prefix = f"load-{CONFIG['runId']}-{me}"
        self._n = itertools.count()
        self.active: list[str] = []  # submitted, not yet seen final
        self.finished: list[str] = []  # seen final (newest last)
        self.submit()

    def submit(self) -> None:
        name = f"{self._prefix}-{next(self._n)}"
        with self.client.post("/api/v2/jobs", data=job_yaml(name), name="/api/v2/jobs", catch_response=True,
                              headers={**self.auth_headers, "Content-Type": "text/yaml"}) as r:
            if r.status_code != 202:
                r.failure(f"submit answered {r.status_code}: {(r.text or '')[:200]}")
                return
            job_id = r.json()["id"]
            record_accepted(job_id)
            self.active.append(job_id)

    def poll(self) -> None:
        job_id = (self.active or self.finished or [None])[-1]
        if job_id is None:
            return
        with self.client.get(f"/api/v2/jobs/{job_id}", name="/api/v2/jobs/[id]", headers=self.auth_headers,
                             catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"get answered {r.status_code}: {(r.text or '')[:200]}")
                return
            if job_id in self.active and r.json().get("state") in FINAL_STATES:
                self.active.remove(job_id)
                self.finished = [*self.finished[-4:], job_id]

    def logs(self) -> None:
        job_id = (self.finished or self.active or [None])[-1]
        if job_id is None:
            return
        self.client.get(f"/api/v2/jobs/{job_id}/logs?taskRole=main&index=0", name="/api/v2/jobs/[id]/logs",
                        headers=self.auth_headers)

    def list_mine(self) -> None:
        self.client.get(f"/api/v2/jobs?username={self.user_name}", name="/api/v2/jobs?username=[user]",
                        headers=self.auth_headers)

    tasks = {submit: 1, poll: 5, logs: 2, list_mine: 2}


class Operator(_Authed):
    """An operator watching the cluster, with the admin token."""

    weight = 1
    wait_time = between(2, 5)

    def on_start(self) -> None:
        self._auth(CONFIG["operators"][0]["token"])

    def nodes(self) -> None:
        self.client.get("/api/v2/nodes", name="/api/v2/nodes", headers=self.auth_headers)

    def cluster_status(self) -> None:
        self.client.get("/api/v2/cluster/status", name="/api/v2/cluster/status", headers=self.auth_headers)

    tasks = {nodes: 1, cluster_status: 1}


def _node(seq: itertools.count) -> dict[str, Any]:
    """The next node of the tokens file, round robin."""
    agents = CONFIG["agents"]
    return agents[next(seq) % len(agents)]


class NodeAgentReports(_Authed):
    """A node agent's heartbeat: an empty run list, the node's real GPUs, every 2 s."""

    fixed_count = len(CONFIG.get("agents") or [])
    wait_time = constant(HEARTBEAT_S)
    _seq = itertools.count()

    def on_start(self) -> None:
        a = _node(NodeAgentReports._seq)
        self.node: str = a["node"]
        self._auth(a["token"])
        self.body = {
            "agentId": f"load-{self.node}",
            "metricsUrl": a.get("metricsUrl"),
            "gpus": int(a.get("gpus") or 0),
            "simulatedGpus": bool(a.get("simulatedGpus")),
            "address": a.get("address") or "127.0.0.1",
            "runs": [],
        }

    def report(self) -> None:
        self.client.post(f"/api/v2/nodes/{self.node}/status", json=self.body, name="/api/v2/nodes/[node]/status",
                         headers=self.auth_headers)

    tasks = [report]


class NodeAgentWatch(_Authed):
    """A node agent's assignments long poll: the first read without a generation, then
    ``generation=<last>&wait=10`` (answers at once when the node's assignments change)."""

    fixed_count = len(CONFIG.get("agents") or [])
    wait_time = constant(0)
    _seq = itertools.count()

    def on_start(self) -> None:
        a = _node(NodeAgentWatch._seq)
        self.node = a["node"]
        self._auth(a["token"])
        self.generation: int | None = None

    def watch(self) -> None:
        path = f"/api/v2/nodes/{self.node}/assignments"
        if self.generation is None:
            with self.client.get(path, name=path.replace(self.node, "[node]"), headers=self.auth_headers,
                                 catch_response=True) as r:
                self._read(r)
            return
        with self.client.get(f"{path}?generation={self.generation}&wait={LONG_POLL_S:g}",
                             name="/api/v2/nodes/[node]/assignments?wait", headers=self.auth_headers,
                             catch_response=True) as r:
            self._read(r)

    def _read(self, r) -> None:
        if r.status_code != 200:
            r.failure(f"assignments answered {r.status_code}: {(r.text or '')[:200]}")
            self.generation = None
            return
        self.generation = r.json()["generation"]

    tasks = [watch]


if not CONFIG.get("agents"):  # no simulated agents (the default): not Locust users at all
    NodeAgentReports.abstract = True
    NodeAgentWatch.abstract = True
if not CONFIG.get("operators"):  # no admin token given: no operators
    Operator.abstract = True
