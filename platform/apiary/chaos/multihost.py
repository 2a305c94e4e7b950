"""Actions and probes for Apiary on many hosts: the faults of a replicated control plane, its store
and its node hosts, on a deployment described by ``<root>/deployment.json``
(:func:`apiary.chaos.target.load_deployment`; the configuration's ``apiary_deployment``).

The hosts are network namespaces of one harness (:meth:`apiary.hosts.netns.Hosts.attach` on the
description's ``hostsRoot``); a component is found, killed, stopped and started again from its
host, argv and environment in the description. ``ip netns exec`` execs the command, so a running
component is the process inside its host whose command line is its argv (:func:`find_pid`); the
pid recorded at start is used while it is still that process.

The leader is the replica whose ``/healthz`` says ``role: leader`` (HTTPS, verified against the
platform CA); while two say so for a moment (a deposed leader that has not noticed yet), the
higher epoch leads, since the store's fence refuses the other's writes (:func:`pick_leader`).

==========================  =========================================  ============================
action                      what                                       undo
==========================  =========================================  ============================
``kill_leader``             kill -9 the leader's control plane         ``restart_replicas``
``freeze_leader``           SIGSTOP the leader (past its lease)        ``thaw_leader``, then
                                                                       ``restart_replicas`` (it
                                                                       steps down: it exits)
``cut_leader_from_store``   a blackhole route to the store's address   ``reconnect_to_store``, then
                            in the leader's host: its store            ``restart_replicas``
                            connections fail, the rest of its network
                            works
``partition_node``          every link of a node's host down           ``heal_partition``
                            (:meth:`Hosts.partition`)
``restart_postgres``        ``pg_ctl stop -m fast`` then start          (it is started again)
``submit_stream``           a stream of jobs, retried through 503s     (the jobs end by themselves)
==========================  =========================================  ============================

``restart_replicas`` starts every replica that is not running with its argv and environment, as
the replicas' supervisor (systemd on real hosts) would: a replica that stepped down exits with
code 3 (:data:`apiary.control.leader.STEPPED_DOWN_EXIT`) and is started again as a follower.
Undo state (the faulted leader, the cut route, the partitioned hosts) is kept in the target's
state directory (``<deployment>/chaos/``) so an operator can finish a rollback by hand.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from apiary.chaos import SteadyStateViolation
from apiary.chaos.probes import FINAL, poll
from apiary.chaos.target import (
    Target,
    accepted_jobs,
    drop_state,
    job_text,
    load_deployment,
    load_state,
    nodes_by_vc,
    record_accepted,
    save_state,
    unique_name,
)
from apiary.client import http_verify
from apiary.errors import ApiaryError, ConflictError, ValidationError
from apiary.hosts.netns import Hosts
from apiary.hosts.postgres import PostgresServer
from apiary.spec.cluster import load_cluster_config

logger = logging.getLogger(__name__)

Configuration = Mapping[str, Any] | None

#: The repository root: the working directory components are started in when the description
#: records none (the deployment starts them there).
REPO_ROOT = Path(__file__).resolve().parents[3]
#: Seconds a ``/healthz`` of one replica may take: a stopped (SIGSTOP) replica's kernel still
#: accepts the connection, so only a read timeout tells it does not answer.
HEALTH_TIMEOUT_S = 2.0
#: The node-lost grace when the replicas' environment sets none (``Settings.node_lost_after_s``).
DEFAULT_NODE_LOST_AFTER_S = 30.0
#: What a leader that loses its lease writes to its log (:mod:`apiary.control.leader`).
STEP_DOWN_LOG = "steps down"

LEADER_FAULT = "leader-fault"
STORE_CUT = "store-cut"
PARTITION = "partition"


# ------------------------------------------------------------------------------ the deployment
@dataclass(frozen=True)
class Layout:
    """A deployment as its ``deployment.json`` describes it. ``replicas``: the replicas' host
    names, in order; ``urls``: host -> its HTTPS URL (by address); ``nodes``: node name -> its
    host; ``postgres``: ``{"host", "address", "port"}``; ``components``: name -> ``{"host",
    "argv", "env", "log", "pid"}`` (a replica is ``control-plane@<host>``)."""

    root: Path
    hosts_root: Path
    ca_cert: Path
    replicas: list[str]
    urls: dict[str, str]
    nodes: dict[str, str]
    postgres: dict[str, Any]
    components: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, target: Target) -> Layout:
        if target.deployment is None:
            raise ValidationError("apiary_deployment", "this activity needs a deployment: set APIARY_DEPLOYMENT "
                                                       "(or apiary chaos run --deployment ROOT)")
        doc = load_deployment(target.deployment)
        replicas = list(doc.get("replicas") or [])
        return cls(root=target.deployment, hosts_root=Path(doc["hostsRoot"]), ca_cert=Path(doc["caCert"]),
                   replicas=replicas, urls=dict(zip(replicas, doc["apiUrls"], strict=True)),
                   nodes=dict(doc.get("nodes") or {}), postgres=dict(doc.get("postgres") or {}),
                   components=dict(doc.get("components") or {}))

    def hosts(self) -> Hosts:
        return Hosts.attach(self.hosts_root)

    def component(self, name: str) -> dict[str, Any]:
        try:
            return self.components[name]
        except KeyError:
            raise ValidationError("component", f"the deployment has no component {name!r} "
                                               f"({', '.join(sorted(self.components))})") from None

    def node_lost_after_s(self) -> float:
        """The replicas' ``APIARY_NODE_LOST_AFTER_S`` (the node-lost grace), default 30 s."""
        for host in self.replicas:
            value = (self.components.get(replica(host), {}).get("env") or {}).get("APIARY_NODE_LOST_AFTER_S")
            if value:
                return float(value)
        return DEFAULT_NODE_LOST_AFTER_S


def replica(host: str) -> str:
    """The component name of the control-plane replica on ``host``."""
    return f"control-plane@{host}"


def find_pid(argv: Sequence[str], pids: Sequence[int], cmdline: Callable[[int], list[str] | None],
             recorded: int | None = None) -> int | None:
    """The process among ``pids`` (those of one host) running ``argv``: ``recorded`` when it is
    one of them and still runs ``argv`` (pids are reused), else the first whose command line is
    ``argv``; None when none runs it. ``cmdline(pid)``: the process's argv, None when it is gone."""
    want = list(argv)
    if recorded is not None and recorded in pids and cmdline(recorded) == want:
        return recorded
    return next((p for p in pids if p != recorded and cmdline(p) == want), None)


def _cmdline(pid: int) -> list[str] | None:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.cmdline()
    except psutil.Error:
        return None


def component_pid(layout: Layout, name: str, hosts: Hosts | None = None) -> int | None:
    """The pid of component ``name`` running in its host now, or None."""
    comp = layout.component(name)
    hosts = hosts or layout.hosts()
    return find_pid(comp["argv"], hosts.pids(comp["host"]), _cmdline, comp.get("pid"))


def start_component(layout: Layout, name: str, hosts: Hosts | None = None) -> int:
    """Start component ``name`` in its host with its argv and environment (output appended to its
    log), as a supervisor would; returns its pid. It outlives this process."""
    comp = layout.component(name)
    hosts = hosts or layout.hosts()
    with open(comp["log"], "ab") as log:
        proc = hosts.run(comp["host"], comp["argv"], env=comp.get("env"), stdout=log, stderr=subprocess.STDOUT,
                         cwd=comp.get("cwd") or str(REPO_ROOT))
    logger.warning("chaos: started %s on %s pid=%d", name, comp["host"], proc.pid)
    return proc.pid


def roles(layout: Layout, timeout_s: float = HEALTH_TIMEOUT_S) -> dict[str, dict | None]:
    """host -> its replica's ``/healthz`` body (``role``, ``epoch``, ``leader``, ...), or None when
    it does not answer 200 within ``timeout_s``."""
    out: dict[str, dict | None] = {}
    with httpx.Client(verify=http_verify(layout.ca_cert), timeout=timeout_s) as http:
        for host, url in layout.urls.items():
            try:
                r = http.get(f"{url}/healthz")
                out[host] = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                out[host] = None
    return out


def pick_leader(seen: Mapping[str, Mapping[str, Any] | None]) -> str | None:
    """The host that leads, from each replica's ``/healthz`` body (None: no answer): the one whose
    role is ``leader``; of several (a deposed leader that has not noticed yet), the one with the
    highest epoch, whose writes the fence lets through; None when none says it leads."""
    leading = [(int(b.get("epoch") or 0), h) for h, b in seen.items() if b and b.get("role") == "leader"]
    return max(leading)[1] if leading else None


def _leader(layout: Layout, timeout_s: float, other_than: str | None = None) -> tuple[str, dict]:
    def found() -> tuple[str, dict] | None:
        seen = roles(layout)
        host = pick_leader({h: b for h, b in seen.items() if h != other_than})
        return (host, seen[host] or {}) if host else None

    what = f"a leader other than {other_than}" if other_than else "a leader among the replicas"
    return poll(found, timeout_s, what)


def _log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _fault_leader(t: Target, fault: str, timeout_s: float) -> tuple[Layout, dict]:
    """Find the leader and its pid, and record them as the target of ``fault``."""
    layout = Layout.of(t)
    if (load_state(t, LEADER_FAULT) or {}).get("frozen"):
        raise ValidationError("leader", "a leader is still frozen by this experiment: thaw_leader first")
    host, health = _leader(layout, timeout_s)
    name = replica(host)
    pid = component_pid(layout, name)
    if pid is None:
        raise SteadyStateViolation(f"the leader {host} answers but no process of {name} runs in its host")
    state = {"fault": fault, "host": host, "pid": pid, "epoch": health.get("epoch"), "at": time.time(),
             "log": layout.component(name)["log"], "log_offset": _log_size(layout.component(name)["log"])}
    save_state(t, LEADER_FAULT, state)
    return layout, state


# ------------------------------------------------------------------------------ actions
def kill_leader(timeout_s: float = 30.0, configuration: Configuration = None) -> dict:
    """kill -9 the leading replica's control plane (found through ``/healthz``; waits up to
    ``timeout_s`` for one to lead) and wait until it is gone. Returns ``{"host", "pid",
    "epoch"}``. Undo: :func:`restart_replicas`."""
    t = Target.of(configuration)
    _, state = _fault_leader(t, "kill", timeout_s)
    pid = state["pid"]
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, 10.0)
    logger.warning("chaos: killed -9 the leader %s pid=%d epoch=%s", state["host"], pid, state["epoch"])
    return {"host": state["host"], "pid": pid, "epoch": state["epoch"]}


def freeze_leader(timeout_s: float = 30.0, configuration: Configuration = None) -> dict:
    """SIGSTOP the leading replica's control plane (a VM stop, a long GC pause): its lease
    expires while it cannot know. Returns ``{"host", "pid", "epoch"}``. Undo: :func:`thaw_leader`
    (it then finds its lease lost and steps down: it exits) and :func:`restart_replicas`."""
    t = Target.of(configuration)
    _, state = _fault_leader(t, "freeze", timeout_s)
    save_state(t, LEADER_FAULT, {**state, "frozen": True, "frozen_at": time.monotonic()})
    os.kill(state["pid"], signal.SIGSTOP)
    logger.warning("chaos: froze the leader %s pid=%d epoch=%s", state["host"], state["pid"], state["epoch"])
    return {"host": state["host"], "pid": state["pid"], "epoch": state["epoch"]}


def thaw_leader(frozen_at_least_s: float = 0.0, configuration: Configuration = None) -> dict:
    """SIGCONT what :func:`freeze_leader` stopped, once it has been stopped ``frozen_at_least_s``
    seconds (its lease is 6 s by default: 12 s is well past it). Idempotent. Returns
    ``{"thawed": [pid], "frozen_s"}``."""
    t = Target.of(configuration)
    state = load_state(t, LEADER_FAULT)
    if not state or not state.get("frozen"):
        return {"thawed": []}
    elapsed = time.monotonic() - float(state.get("frozen_at", 0.0))
    if 0 <= elapsed < frozen_at_least_s:
        time.sleep(frozen_at_least_s - elapsed)
        elapsed = frozen_at_least_s
    thawed = []
    try:
        os.kill(state["pid"], signal.SIGCONT)
        thawed.append(state["pid"])
    except ProcessLookupError:
        pass
    save_state(t, LEADER_FAULT, {**state, "frozen": False, "thawed_at": time.time()})
    return {"thawed": thawed, "frozen_s": round(elapsed, 2)}


def blackhole_argv(address: str, add: bool) -> list[str]:
    """``ip route add|del blackhole <address>/32``: run inside a host, its packets to ``address``
    are dropped (ip-route(8): a local sender gets EINVAL, so connections fail at once instead of
    timing out) while its other traffic flows."""
    return ["ip", "route", "add" if add else "del", "blackhole", f"{address}/32"]


def cut_leader_from_store(timeout_s: float = 30.0, configuration: Configuration = None) -> dict:
    """Cut the leading replica's host off from PostgreSQL only (:func:`blackhole_argv` for the
    store's address, inside that host): it cannot renew its lease, so it steps down at its renew
    deadline and another replica takes over; agents and clients still reach it. Returns
    ``{"host", "pid", "epoch", "store"}``. Undo: :func:`reconnect_to_store`, then
    :func:`restart_replicas`."""
    t = Target.of(configuration)
    layout, state = _fault_leader(t, "cut", timeout_s)
    address = layout.postgres.get("address")
    if not address:
        raise ValidationError("postgres", "the deployment names no PostgreSQL address")
    save_state(t, STORE_CUT, {"host": state["host"], "address": address})  # before: the undo must find it
    layout.hosts().exec(state["host"], blackhole_argv(address, True), check=True, timeout=10)
    logger.warning("chaos: cut the leader %s off from the store at %s", state["host"], address)
    return {"host": state["host"], "pid": state["pid"], "epoch": state["epoch"], "store": address}


def reconnect_to_store(configuration: Configuration = None) -> dict:
    """Remove :func:`cut_leader_from_store`'s route (idempotent). Returns ``{"reconnected": [host]}``."""
    t = Target.of(configuration)
    state = load_state(t, STORE_CUT)
    if state is None:
        return {"reconnected": []}
    r = Layout.of(t).hosts().exec(state["host"], blackhole_argv(state["address"], False), timeout=10)
    if r.returncode != 0 and "No such process" not in r.stderr:  # ip's words for a route that is not there
        raise SteadyStateViolation(f"could not remove the blackhole route on {state['host']}: {r.stderr.strip()}")
    drop_state(t, STORE_CUT)
    return {"reconnected": [state["host"]]}


def restart_replicas(timeout_s: float = 60.0, configuration: Configuration = None) -> dict:
    """Start every control-plane replica whose process is not running (killed, or exited after
    stepping down) with its argv and environment, as its supervisor would, then wait up to
    ``timeout_s`` until every replica answers ``/healthz`` and one leads. Idempotent. Returns
    ``{"restarted": [host], "leader"}``."""
    t = Target.of(configuration)
    layout = Layout.of(t)
    hosts = layout.hosts()
    restarted = []
    for host in layout.replicas:
        name = replica(host)
        if component_pid(layout, name, hosts) is None:
            start_component(layout, name, hosts)
            restarted.append(host)
    seen = poll(lambda: (lambda s: s if all(s.values()) and pick_leader(s) else None)(roles(layout)), timeout_s,
                "every replica answering /healthz with one leader")
    return {"restarted": restarted, "leader": pick_leader(seen)}


def partition_node(node: str = "", job: str = "", configuration: Configuration = None) -> dict:
    """Take every link of ``node``'s host down (:meth:`Hosts.partition`; ``node`` "": the node job
    ``job`` of this run is running on). Its agent and tasks keep running, cut off from every
    control plane. Returns ``{"node", "host"}``. Undo: :func:`heal_partition`."""
    t = Target.of(configuration)
    layout = Layout.of(t)
    if not node:
        if not job:
            raise ValidationError("node", "give the node to partition, or the job whose node it is")
        node = _job_node(t, job)
    host = layout.nodes.get(node)
    if host is None:
        raise ValidationError("node", f"node {node!r} has no host in this deployment ({', '.join(layout.nodes)})")
    state = load_state(t, PARTITION) or {"hosts": []}
    state["hosts"] = sorted({*state["hosts"], host})
    save_state(t, PARTITION, {**state, "node": node, "at": time.time()})  # before: heal must find it
    layout.hosts().partition(host)
    logger.warning("chaos: partitioned node %s (host %s)", node, host)
    return {"node": node, "host": host}


def heal_partition(configuration: Configuration = None) -> dict:
    """Bring the links of the hosts :func:`partition_node` cut back up (idempotent). Returns
    ``{"healed": [host], "partitioned_s"}``."""
    t = Target.of(configuration)
    state = load_state(t, PARTITION)
    if state is None:
        return {"healed": []}
    hosts = Layout.of(t).hosts()
    for host in state["hosts"]:
        hosts.heal(host)
    drop_state(t, PARTITION)
    return {"healed": state["hosts"], "partitioned_s": round(time.time() - float(state.get("at", time.time())), 1)}


def restart_postgres(configuration: Configuration = None) -> dict:
    """Restart the deployment's PostgreSQL (:meth:`PostgresServer.restart`: a fast shutdown, which
    disconnects every client and rolls back their open transactions, then a start on the same
    cluster). Returns ``{"host", "down_s"}``: the seconds from the stop to accepting connections."""
    t = Target.of(configuration)
    layout = Layout.of(t)
    host = layout.postgres.get("host") or "db"
    server = PostgresServer.attach(layout.hosts(), host)
    t0 = time.monotonic()
    server.restart()
    down = round(time.monotonic() - t0, 2)
    logger.warning("chaos: restarted PostgreSQL on %s (%.1f s)", host, down)
    return {"host": host, "down_s": down}


# ------------------------------------------------------------------------------ submissions
@dataclass
class _Stream:
    done: threading.Event
    result: dict[str, Any]


_streams: dict[str, _Stream] = {}
_streams_lock = threading.Lock()


def _stream(name: str) -> _Stream:
    with _streams_lock:
        return _streams.setdefault(name, _Stream(threading.Event(), {}))


def replaceable_vc(vc_nodes: Mapping[str, list[str]], preferred: Sequence[str]) -> str:
    """A VC whose jobs can be re-placed on another node (two or more nodes), the first of
    ``preferred`` that is, else the first such VC; raises ValidationError when none is."""
    for vc in [*preferred, *vc_nodes]:
        if vc and len(vc_nodes.get(vc, [])) >= 2:
            return vc
    raise ValidationError("vc", f"no virtual cluster has two nodes to re-place a job on ({dict(vc_nodes)})")


def submit_stream(name: str = "chaos-stream", jobs: int = 20, interval_s: float = 0.5, vc: str = "",
                  command: str = "sleep 1", retry_s: float = 60.0, configuration: Configuration = None) -> dict:
    """Submit ``jobs`` one-GPU jobs (``command``; VC ``vc``, "": the probe VC), one every
    ``interval_s`` seconds, as a client that retries: a 5xx answer or an unreachable API (a
    failover, a store restart) is retried with the same job name for up to ``retry_s`` seconds
    (the name makes the retry safe: a 409 for a name this stream sent before means an earlier try
    was committed, and then it counts as accepted); a 4xx fails at once. Every accepted job
    counts for ``no_accepted_job_lost`` and :func:`stream_jobs_succeed`. Meant to run in the
    background of a method (``"background": true``). Returns ``{"accepted", "retries",
    "unavailable_s", "answers"}``: ``unavailable_s`` sums the seconds from a job's first failed
    try to its acceptance; ``answers`` counts the failed tries by status (``"503"``; a transport
    error or no replica reachable is ``"transport"`` or ``"503"``), so the journal shows what
    clients saw.
    Raises SteadyStateViolation when a job could not be submitted within ``retry_s``."""
    t = Target.of(configuration)
    stream = _stream(name)
    stream.done.clear()
    result: dict[str, Any] = {"accepted": 0, "retries": 0, "unavailable_s": 0.0, "answers": {}}
    stream.result = result
    try:
        with closing(t.client(timeout=10.0)) as c:
            me = c.me()
            user = str(me.get("name") or me.get("username"))
            for i in range(jobs):
                if i:
                    time.sleep(interval_s)
                job_name = unique_name(name)
                text = job_text(job_name, vc or t.probe_vc, [command], role="train")
                first_try = time.monotonic()
                failed = False
                while True:
                    try:
                        job_id = str(c.submit(text)["id"])
                        break
                    except ConflictError:
                        if not failed:
                            raise
                        job_id = f"{user}~{job_name}"  # an earlier try was committed after all
                        break
                    except (ApiaryError, httpx.HTTPError) as e:
                        status = getattr(e, "status_code", 503) if isinstance(e, ApiaryError) else "transport"
                        if isinstance(status, int) and status < 500:
                            raise
                        failed = True
                        result["retries"] += 1
                        seen = result["answers"]
                        seen[str(status)] = seen.get(str(status), 0) + 1
                        if time.monotonic() - first_try >= retry_s:
                            raise SteadyStateViolation(f"job {job_name} not accepted within {retry_s:.0f} s: {e}"
                                                       ) from e
                        time.sleep(0.5)
                if failed:
                    result["unavailable_s"] = round(result["unavailable_s"] + time.monotonic() - first_try, 2)
                record_accepted(job_id)
                result["accepted"] += 1
    finally:
        stream.done.set()
    logger.info("chaos: stream %s: %s", name, result)
    return result


def stream_jobs_succeed(name: str = "chaos-stream", timeout_s: float = 180.0, configuration: Configuration = None
                        ) -> dict:
    """Wait until :func:`submit_stream` ``name`` has finished submitting, then until every job it
    got accepted ended, within ``timeout_s`` in all; every one must have SUCCEEDED. Returns
    ``{"jobs", "succeeded", "retried"}`` (``retried``: those that needed a platform retry)."""
    t = Target.of(configuration)
    deadline = time.monotonic() + timeout_s
    stream = _stream(name)
    if not stream.done.wait(timeout_s):
        raise SteadyStateViolation(f"the submission stream {name} did not finish within {timeout_s:.0f} s")
    ids = [j for j in accepted_jobs() if j.split("~", 1)[1].startswith(name + "-")]
    if not ids:
        raise SteadyStateViolation(f"the submission stream {name} got no job accepted")
    final: dict[str, dict] = {}
    with closing(t.client()) as c:
        def all_final() -> bool:
            for j in ids:
                if j not in final:
                    job = c.get(j)
                    if job["state"] in FINAL:
                        final[j] = job
            return len(final) == len(ids)

        poll(all_final, max(1.0, deadline - time.monotonic()), f"the {len(ids)} jobs of stream {name} to end")
    failed = [f"{j} {job['state']}" for j, job in final.items() if job["state"] != "SUCCEEDED"]
    if failed:
        raise SteadyStateViolation(f"{len(failed)} of {len(ids)} stream jobs did not succeed: {', '.join(failed)}")
    retried = sum(1 for job in final.values() if job.get("attempt", 0) > 0)
    return {"jobs": len(ids), "succeeded": len(ids), "retried": retried}


def submit_replaceable_job(name: str = "chaos-partitioned", seconds: float = 0.0, vc: str = "",
                           configuration: Configuration = None) -> dict:
    """Submit a one-GPU job that sleeps ``seconds`` (0: the node-lost grace plus 5 s, so it still
    runs when its node is declared lost) in a VC that can re-place it on another node (``vc``,
    else the probe VC when it has two nodes, else the first VC that has). Returns ``{"job", "vc",
    "seconds"}``."""
    t = Target.of(configuration)
    layout = Layout.of(t)
    if not vc:
        cluster = t.cluster_file
        if cluster is None or not cluster.exists():
            raise ValidationError("vc", "the cluster config is unknown: give the VC")
        vc = replaceable_vc(nodes_by_vc(load_cluster_config(cluster)), [t.probe_vc])
    seconds = seconds or layout.node_lost_after_s() + 5.0
    with closing(t.client()) as c:
        job_id = str(c.submit(job_text(unique_name(name), vc, [f"sleep {seconds:g}"], role="train"))["id"])
    record_accepted(job_id)
    return {"job": job_id, "vc": vc, "seconds": seconds}


# ------------------------------------------------------------------------------ probes
def new_leader_elected(timeout_s: float = 30.0, configuration: Configuration = None) -> dict:
    """A replica other than the faulted leader leads within ``timeout_s``, at a later epoch.
    Returns ``{"leader", "epoch", "old", "failover_s"}``: ``failover_s`` from the fault to the
    first answer that names the new leader."""
    t = Target.of(configuration)
    state = load_state(t, LEADER_FAULT)
    if state is None:
        raise SteadyStateViolation("no leader was faulted in this run")
    host, health = _leader(Layout.of(t), timeout_s, other_than=state["host"])
    took = round(time.time() - float(state["at"]), 2)
    epoch = health.get("epoch")
    if state.get("epoch") is not None and epoch is not None and int(epoch) <= int(state["epoch"]):
        raise SteadyStateViolation(f"{host} leads at epoch {epoch}, not after the old leader's {state['epoch']}")
    logger.info("chaos: %s leads at epoch %s, %.1f s after the fault on %s", host, epoch, took, state["host"])
    return {"leader": host, "epoch": epoch, "old": state["host"], "failover_s": took}


def old_leader_stepped_down(timeout_s: float = 30.0, configuration: Configuration = None) -> dict:
    """The faulted leader's process exits within ``timeout_s`` and its log says it stepped down
    (:data:`STEP_DOWN_LOG`, written since the fault): it found its lease lost and stopped leading
    instead of going on. Returns ``{"host", "pid", "log"}`` (``log``: that line)."""
    t = Target.of(configuration)
    state = load_state(t, LEADER_FAULT)
    if state is None:
        raise SteadyStateViolation("no leader was faulted in this run")
    pid = state["pid"]
    poll(lambda: _gone(pid), timeout_s, f"the old leader {state['host']} (pid {pid}) to exit")
    try:
        with open(state["log"], "rb") as f:
            f.seek(int(state.get("log_offset", 0)))
            text = f.read().decode(errors="replace")
    except OSError as e:
        raise SteadyStateViolation(f"cannot read the old leader's log {state['log']}: {e}") from e
    line = next((x for x in text.splitlines() if STEP_DOWN_LOG in x), None)
    if line is None:
        raise SteadyStateViolation(f"the old leader {state['host']} exited without stepping down: "
                                   f"{' '.join(text[-400:].split())}")
    return {"host": state["host"], "pid": pid, "log": line.strip()[-300:]}


def replicas_healthy(timeout_s: float = 60.0, configuration: Configuration = None) -> dict:
    """Every replica answers ``/healthz`` within ``timeout_s``, exactly one as the leader and the
    others as followers naming it. Returns ``{"leader", "epoch", "followers"}``."""
    t = Target.of(configuration)
    layout = Layout.of(t)
    seen: dict[str, dict | None] = {}

    def settled() -> bool:
        seen.clear()
        seen.update(roles(layout))
        if not all(seen.values()):
            return False
        leaders = [h for h, b in seen.items() if b and b.get("role") == "leader"]
        return len(leaders) == 1 and all(b and b.get("leader") for b in seen.values())

    try:
        poll(settled, timeout_s, "every replica healthy with one leader")
    except SteadyStateViolation:
        raise SteadyStateViolation("replicas not settled: " + ", ".join(
            f"{h}={(b or {}).get('role', 'no answer')}" for h, b in seen.items())) from None
    leader = pick_leader(seen)
    return {"leader": leader, "epoch": (seen[leader] or {}).get("epoch") if leader else None,
            "followers": sorted(h for h in seen if h != leader)}


def partitioned_node_lost(timeout_s: float = 90.0, configuration: Configuration = None) -> dict:
    """The control plane declares the partitioned node lost (not ready) within ``timeout_s``
    (its node-lost grace and a scheduling tick). Returns ``{"node", "lost_after_s"}``, seconds
    from the partition."""
    t = Target.of(configuration)
    state = load_state(t, PARTITION)
    if state is None:
        raise SteadyStateViolation("no node was partitioned in this run")
    node = state["node"]
    with closing(t.client(timeout=10.0)) as c:
        poll(lambda: not next((n["ready"] for n in c.nodes() if n["name"] == node), True), timeout_s,
             f"node {node} declared lost")
    return {"node": node, "lost_after_s": round(time.time() - float(state["at"]), 1)}


def job_replaced_and_succeeds(name: str, timeout_s: float = 180.0, configuration: Configuration = None) -> dict:
    """Job ``name`` (this run's), whose node was partitioned, ends SUCCEEDED within ``timeout_s``
    on another node, in a later attempt (a platform retry, not a user one). Returns ``{"job",
    "attempt", "node", "lost_node", "retryDetails"}``."""
    t = Target.of(configuration)
    state = load_state(t, PARTITION) or {}
    job_id = _accepted(name)
    with closing(t.client()) as c:
        job = poll(lambda: (lambda j: j if j["state"] in FINAL else None)(c.get(job_id)), timeout_s,
                   f"job {job_id} to finish")
    nodes = sorted({x["node"] for x in job["tasks"] if x.get("node")})
    problems = []
    if job["state"] != "SUCCEEDED":
        problems.append(f"ended {job['state']}")
    if state.get("node") and state["node"] in nodes:
        problems.append(f"finished on the partitioned node {state['node']}")
    if job["attempt"] < 1:
        problems.append("was never re-placed (attempt 0)")
    if job["retryDetails"].get("user"):
        problems.append(f"{job['retryDetails']['user']} user retries")
    if problems:
        raise SteadyStateViolation(f"job {job_id}: " + "; ".join(problems))
    return {"job": job_id, "attempt": job["attempt"], "node": nodes[0] if nodes else None,
            "lost_node": state.get("node"), "retryDetails": job["retryDetails"]}


# ------------------------------------------------------------------------------ helpers
def _accepted(name: str) -> str:
    ids = [j for j in accepted_jobs() if j.split("~", 1)[1] == name or j.split("~", 1)[1].startswith(name + "-")]
    if not ids:
        raise SteadyStateViolation(f"this run submitted no job named {name!r}")
    return ids[-1]


def _job_node(t: Target, name: str) -> str:
    job_id = _accepted(name)
    with closing(t.client()) as c:
        job = c.get(job_id)
    nodes = [x["node"] for x in job["tasks"] if x.get("state") == "RUNNING" and x.get("node")]
    if not nodes:
        raise SteadyStateViolation(f"job {job_id} runs on no node ({job['state']})")
    return str(nodes[0])


def _gone(pid: int) -> bool:
    return _cmdline(pid) is None


def _wait_gone(pid: int, timeout_s: float) -> None:
    poll(lambda: _gone(pid), timeout_s, f"pid {pid} to exit", every_s=0.05)


__all__ = [
    "Layout", "blackhole_argv", "component_pid", "cut_leader_from_store", "find_pid", "freeze_leader",
    "heal_partition", "job_replaced_and_succeeds", "kill_leader", "new_leader_elected", "old_leader_stepped_down",
    "partition_node", "partitioned_node_lost", "pick_leader", "reconnect_to_store", "replaceable_vc",
    "replicas_healthy", "restart_postgres", "restart_replicas", "roles", "start_component", "stream_jobs_succeed",
    "submit_replaceable_job", "submit_stream", "thaw_leader",
]
