"""Actions: what an experiment does to the platform, and the undo of each (for its rollbacks).

Every undo is idempotent and safe to call when its action never ran or failed half-way, so an
experiment can list it as a rollback unconditionally. What an action leaves for its undo is kept in
``APIARY_HOME/run/chaos/`` (frozen pids, fill files, the netns node), so after a crash an operator
can finish by hand what the rollback could not.

==========================  =====================================  ===============================
action                      what                                   undo
==========================  =====================================  ===============================
``kill_child``              kill -9 a platform process, wait until (the supervisor restarts it;
                            it is back                             PostgreSQL: restarted here)
``freeze_agent``            "VM stop": SIGSTOP the agent process   ``thaw_agent``
                            and its tasks
``inject_ecc_double_bit``,  simulated DCGM faults through          ``clear_gpu_faults``
``inject_xid``,             ``POST /api/v2/nodes/{n}/faults``
``inject_thermal``
``cordon_node``             what the alert actions do for broken   ``uncordon_node``
                            GPUs
``submit_job``              a background user job                  (it ends by itself)
``submit_gpu_oom_job``      a job that runs out of GPU memory      (it fails by itself)
``fill_disk``               fill the home's dedicated tmpfs        ``free_disk``
``attach_netns_node``       a node whose agent is in a netns       ``detach_netns_node``
``degrade_network``         delay and loss on that netns' ``lo``   ``restore_network``
==========================  =====================================  ===============================
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

import psutil

from apiary.chaos import disk, network, processes
from apiary.chaos.probes import poll
from apiary.chaos.target import Target, drop_state, job_text, load_state, record_accepted, save_state, unique_name
from apiary.client import Tenants
from apiary.errors import NotFoundError, UnavailableError, ValidationError
from apiary.lifecycle.exitspec import exit_spec

logger = logging.getLogger(__name__)

Configuration = Mapping[str, Any] | None


# ------------------------------------------------------------------------------ processes
def kill_child(name: str, wait_restart: bool = True, timeout_s: float = 90.0, restart_postgres: bool = True,
               configuration: Configuration = None) -> dict:
    """kill -9 the platform process ``name``: ``control-plane``, ``agent``, ``prefect-server``,
    ``prefect-bridge``, ``prefect-serve`` (children of ``apiary up``; its supervisor restarts them) or
    ``postgres`` (the postmaster of the store's PostgreSQL, which Apiary does not supervise: with
    ``restart_postgres`` this action starts it again as it was, as systemd would). With
    ``wait_restart``, waits until a new process runs (and, for the control plane, answers
    ``/healthz``). Pids: :mod:`apiary.chaos.processes`."""
    t = Target.of(configuration)
    home = t.need_home()
    t0 = time.monotonic()
    if name == processes.POSTGRES:
        pm = processes.find_postmaster(processes.database_url(home, (configuration or {}).get("apiary_database_url")))
        processes.kill9(psutil.Process(pm.pid))
        processes.wait_gone([pm.pid], 10.0)
        logger.warning("chaos: killed -9 postgres pid=%d", pm.pid)
        new_pid = processes.restart_postmaster(pm, timeout_s) if restart_postgres else None
        return {"name": name, "killed": [pm.pid], "new_pid": new_pid, "back_in_s": round(time.monotonic() - t0, 2)}
    old = processes.find_child(home, name)
    killed = processes.kill9(old, tree=processes.CHILDREN[name].tree)
    processes.wait_gone(killed, 10.0)
    logger.warning("chaos: killed -9 %s pids=%s", name, killed)
    out: dict[str, Any] = {"name": name, "killed": killed}
    if not wait_restart:
        return out

    def restarted() -> int | None:
        try:
            p = processes.find_child(home, name)
        except NotFoundError:
            return None
        return p.pid if p.pid != old.pid else None

    out["new_pid"] = poll(restarted, timeout_s, f"{name} restarted by the supervisor")
    if name == "control-plane":
        with closing(t.client(timeout=5.0)) as c:
            poll(c.health, timeout_s, "the restarted control plane to answer")
    out["back_in_s"] = round(time.monotonic() - t0, 2)
    return out


FREEZE = "freeze"


def freeze_agent(node: str | None = None, with_tasks: bool = True, configuration: Configuration = None) -> dict:
    """"VM stop" of the node(s) an agent process serves: SIGSTOP the agent (its heartbeats, long
    polls and log uploads stop) and, with ``with_tasks``, every task process under it, as a paused
    VM stops its workloads too. In ``apiary up`` one agent process serves every node, so every node
    stops at once (the result's ``nodes`` says so); with per-node agents (``apiary agent --node``)
    only ``node``'s. The control plane declares the nodes lost after ``APIARY_NODE_LOST_AFTER_S``
    (probe ``nodes_lost``). Undo: :func:`thaw_agent`."""
    t = Target.of(configuration)
    if load_state(t, FREEZE):
        raise ValidationError("node", "an agent is frozen already; thaw_agent first")
    agent = processes.find_child(t.need_home(), "agent")
    argv = agent.cmdline()
    serves: Any = "all (one agent process serves every node)" if "--all-nodes" in argv else [
        argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--node"]
    if node and isinstance(serves, list) and node not in serves:
        raise NotFoundError(f"the agent process {agent.pid} does not serve node {node} (it serves {serves})")
    tasks = agent.children(recursive=True) if with_tasks else []
    save_state(t, FREEZE, {"agent": agent.pid, "tasks": [p.pid for p in tasks]})  # before: thaw must find them
    agent.send_signal(signal.SIGSTOP)
    for p in tasks:
        try:
            p.send_signal(signal.SIGSTOP)
        except psutil.NoSuchProcess:
            continue
    logger.warning("chaos: froze agent pid=%d and %d task processes", agent.pid, len(tasks))
    return {"agent_pid": agent.pid, "task_pids": [p.pid for p in tasks], "nodes": serves}


def thaw_agent(configuration: Configuration = None) -> dict:
    """SIGCONT what :func:`freeze_agent` stopped, tasks first (idempotent)."""
    t = Target.of(configuration)
    state = load_state(t, FREEZE)
    if state is None:
        return {"thawed": []}
    thawed = []
    for pid in [*state["tasks"], state["agent"]]:
        try:
            psutil.Process(pid).send_signal(signal.SIGCONT)
            thawed.append(pid)
        except psutil.NoSuchProcess:
            continue
    drop_state(t, FREEZE)
    return {"thawed": thawed}


# ------------------------------------------------------------------------------ GPU faults
def _fault(t: Target, node: str, body: dict) -> dict:
    """POST the fault ``body`` to ``node`` ("" or None: the target's fault node)."""
    node = node or t.fault_node
    r = t.request("POST", f"/api/v2/nodes/{node}/faults", json_body=body)
    if r.status_code != 200:
        raise ValidationError("node", f"POST /api/v2/nodes/{node}/faults {body}: {r.status_code} {r.text[:300]}")
    return dict(r.json())


def inject_ecc_double_bit(node: str, gpu: int = 0, count: int = 1, configuration: Configuration = None) -> dict:
    """Add ``count`` double-bit (uncorrectable) ECC errors to the node's simulated GPU (DCGM
    ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``)."""
    return _fault(Target.of(configuration), node, {"gpu": gpu, "eccDbe": count})


def inject_xid(node: str, xid: int, gpu: int = 0, configuration: Configuration = None) -> dict:
    """Raise XID ``xid`` on the node's simulated GPU (``DCGM_FI_DEV_XID_ERRORS``): 48 is a double-bit
    ECC error, 79 the GPU fallen off the bus."""
    return _fault(Target.of(configuration), node, {"gpu": gpu, "xid": xid})


def inject_thermal(node: str, gpu: int = 0, celsius: float = 95.0, configuration: Configuration = None) -> dict:
    """Hold the simulated GPU at ``celsius`` (``DCGM_FI_DEV_GPU_TEMP``; above ~90 C a real GPU
    throttles its clocks) until cleared."""
    return _fault(Target.of(configuration), node, {"gpu": gpu, "temp": celsius})


def clear_gpu_faults(node: str, gpus: list[int] | None = None, configuration: Configuration = None) -> dict:
    """Reset the faults of the node's GPUs ``gpus`` (default: all of them), like a GPU reset."""
    t = Target.of(configuration)
    node = node or t.fault_node
    if gpus is None:
        with closing(t.client()) as c:
            n = next((x for x in c.nodes() if x["name"] == node), None)
        if n is None:
            raise NotFoundError(f"Node {node} is not in the cluster config.")
        gpus = list(range(int(n["gpus"])))
    return {"cleared": [_fault(t, node, {"gpu": g, "clear": True})["gpu"] for g in gpus]}


#: The source of the chaos actions' cordons (:data:`apiary.control.nodes.CORDON_SOURCE`): its own
#: key, so :func:`uncordon_node` never lifts an admin's, an alert's or an incident's cordon.
CORDON_SOURCE = "chaos:cordon_node"


def cordon_node(node: str, reason: str = "chaos experiment", configuration: Configuration = None) -> dict:
    """Cordon ``node`` ("": the target's fault node; no new placements) as :data:`CORDON_SOURCE`
    with ``reason``, what the default alert actions do for broken GPUs. Returns ``{"node",
    "cordoned", "cordons": [source, ...]}``."""
    t = Target.of(configuration)
    node = node or t.fault_node
    with closing(t.client()) as c:
        n = c.cordon(node, True, source=CORDON_SOURCE, reason=reason)
    return {"node": node, "cordoned": n["cordoned"], "cordons": [x["source"] for x in n.get("cordons", [])]}


def uncordon_node(node: str, configuration: Configuration = None) -> dict:
    """Remove :func:`cordon_node`'s cordon from ``node`` ("": the target's fault node); the node's
    other cordons stay. Returns ``{"node", "cordoned", "cordons": [source, ...]}``."""
    t = Target.of(configuration)
    node = node or t.fault_node
    with closing(t.client()) as c:
        n = c.cordon(node, False, source=CORDON_SOURCE)
    return {"node": node, "cordoned": n["cordoned"], "cordons": [x["source"] for x in n.get("cordons", [])]}


# ------------------------------------------------------------------------------ jobs
def _submit(t: Target, text: str, user: str | None) -> str:
    with closing(t.client()) as c:
        job_id = str((Tenants(c).submit(text, user) if user else c.submit(text))["id"])
    record_accepted(job_id)
    return job_id


def submit_job(name: str = "chaos-load", seconds: float = 5, vc: str | None = None, user: str | None = None,
               priority: str = "prod", configuration: Configuration = None) -> dict:
    """Submit a one-GPU job that sleeps ``seconds`` (``<name>-<hex>``, in VC ``vc``, default the
    target's load VC; as ``user`` if given: created with a one-hour token when missing), so a fault
    meets work in flight. The job counts for
    ``no_accepted_job_lost`` and ``no_task_ran_twice``; probe ``job_succeeds`` waits for it."""
    t = Target.of(configuration)
    job_id = _submit(t, job_text(unique_name(name), vc or t.load_vc, [f"sleep {seconds:g}"], priority=priority,
                                 role="train"), user)
    return {"job": job_id}


def submit_gpu_oom_job(name: str = "cuda-oom", vc: str | None = None, user: str | None = None, retries: int = 2,
                       configuration: Configuration = None) -> dict:
    """A user job that runs out of GPU memory: it prints PyTorch's CUDA out-of-memory message and
    exits with the code of the exit spec's CUDA OOM entry (226 ``ContainerCudaOOMKilled``,
    NEVER_RETRY), so its exit code, phrase and log are what OpenPAI's runtime would report for a
    real one. ``retries`` (jobRetryCount) shows that the platform does not retry it. Probe:
    ``job_failed_as(phrase="ContainerCudaOOMKilled")``."""
    t = Target.of(configuration)
    entry = next(e for e in exit_spec().values() if e.phrase == "ContainerCudaOOMKilled")
    message = ("RuntimeError: cuda runtime error (2) : out of memory at "
               "/pytorch/aten/src/THC/generic/THCStorage.cu:58")
    commands = ["echo 'allocating 81920 MiB on GPU 0'", f"echo '{message}' >&2", f"exit {entry.code}"]
    job_id = _submit(t, job_text(unique_name(name), vc or t.probe_vc, commands, retries=retries, role="train",
                                 priority="test"), user)
    return {"job": job_id, "exitCode": entry.code, "phrase": entry.phrase}


# ------------------------------------------------------------------------------ disk
FILL = "disk-fill"


def fill_disk(path: str | None = None, leave_kb: int = 0, max_mb: float = 1024,
              configuration: Configuration = None) -> dict:
    """Fill the filesystem of ``path`` (default: the platform home, where the SQLite store, the logs
    and the agents' state live) with one file, until ``leave_kb`` KiB are left. Refuses unless that
    filesystem is a tmpfs of at most ``max_mb`` MiB mounted at the home or below it
    (:func:`apiary.chaos.disk.check_dedicated`): never the real disk. Undo: :func:`free_disk`."""
    t = Target.of(configuration)
    home = t.need_home()
    mount = disk.check_dedicated(Path(path) if path else home, home, max_mb)
    state = load_state(t, FILL) or {"files": []}
    target_file = str(mount.point / disk.FILL_NAME)
    if target_file not in state["files"]:
        state["files"].append(target_file)
    # The state goes next to the fill file's mount only if there is room: record it first.
    save_state(t, FILL, state)
    out = disk.fill(mount, leave_kb)
    logger.warning("chaos: filled %s (%d bytes, %d left)", mount.point, out["bytes"], out["free_bytes"])
    return {**out, "mount": str(mount.point)}


def free_disk(configuration: Configuration = None) -> dict:
    """Remove the files :func:`fill_disk` wrote (idempotent)."""
    t = Target.of(configuration)
    state = load_state(t, FILL)
    files = state["files"] if state else [str(t.need_home() / disk.FILL_NAME)]
    removed = disk.free(files)
    drop_state(t, FILL)
    return {"removed": removed}


def submit_while_degraded(vc: str | None = None, configuration: Configuration = None) -> dict:
    """Try to submit a job while the platform is degraded; either answer is fine, and it is
    recorded: accepted (then it must not be lost: it is in the run's accepted jobs) or refused
    with 503 ("the store cannot commit; nothing was accepted"). Any other answer fails."""
    t = Target.of(configuration)
    try:
        job_id = _submit(t, job_text(unique_name("chaos-degraded"), vc or t.probe_vc, ["sleep 1"]), None)
    except UnavailableError as e:
        return {"accepted": False, "refused": str(e)}
    return {"accepted": True, "job": job_id}


# ------------------------------------------------------------------------------ network
def attach_netns_node(node: str = "chaos-net-0", vc: str = "chaos-net", gpus: int = 1,
                      ready_timeout_s: float = 60.0, configuration: Configuration = None) -> dict:
    """Add node ``node`` (VC ``vc`` of its own) whose agent runs in a new network namespace and
    reaches the control plane through a relay on that namespace's loopback (see
    :mod:`apiary.chaos.network`); waits until the node is ready. Needs root. Undo:
    :func:`detach_netns_node`."""
    return network.attach(Target.of(configuration), node, vc, gpus, ready_timeout_s)


def degrade_network(delay_ms: float = 100, loss_pct: float = 5, configuration: Configuration = None) -> dict:
    """Delay and drop packets between the netns node's agent and the control plane: ``tc netem``
    on the namespace's ``lo``, or (kernel without ``sch_netem``) ``iptables`` statistic drops and a
    relay delay; the result names the mechanism. Undo: :func:`restore_network`."""
    return network.degrade(Target.of(configuration), delay_ms, loss_pct)


def restore_network(configuration: Configuration = None) -> dict:
    return network.restore(Target.of(configuration))


def detach_netns_node(configuration: Configuration = None) -> dict:
    return network.detach(Target.of(configuration))
