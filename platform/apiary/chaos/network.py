"""A node whose agent lives in its own network namespace, and a degraded network between that
agent and the control plane.

In ``apiary up`` one agent process serves every node and cannot be moved into another namespace,
so the experiment brings its own node (an honest substitute, documented in chaos/README.md):

1. a network namespace ``apiary-chaos-<id>`` with only ``lo`` up (nothing leaves the machine);
2. :mod:`apiary.chaos.netproxy`, listening on that namespace's ``127.0.0.1`` and relaying to the
   control plane's;
3. a node ``<node>`` and a virtual cluster ``<vc>`` of its own (one GPU), added to the running
   platform's cluster config with ``PUT /api/v2/cluster/config`` (no other agent serves it: the
   platform's agent read its nodes when it started);
4. an agent token for that node (``POST /api/v2/tokens``, kind ``agent``) and ``apiary agent
   --node <node>`` started inside the namespace (``ip netns exec``), reaching the control plane
   only through the relay.

:func:`degrade` then adds delay and loss on the namespace's ``lo``: ``tc qdisc ... netem`` where the
kernel has ``sch_netem``; else loss with ``iptables -m statistic`` and delay in the relay (the
result names the mechanism used). :func:`detach` undoes everything: agent and relay stopped, the
original cluster config applied again, the token revoked, the namespace deleted.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import yaml

from apiary.chaos.target import Target, drop_state, load_state, save_state
from apiary.errors import PlatformError, ValidationError
from apiary.procutil import die_with_parent

logger = logging.getLogger(__name__)

STATE = "netns-node"


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", netns, *args] if netns else list(args)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise PlatformError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def with_node(config_text: str, node: str, vc: str, gpus: int) -> str:
    """The HiveD config ``config_text`` (bare or OpenPAI-wrapped) plus node ``node`` in a virtual
    cluster ``vc`` of its own, with its own SKU and cell types."""
    doc = yaml.safe_load(config_text)
    wrapped = isinstance(doc, dict) and "hivedscheduler" in doc
    cfg = yaml.safe_load(doc["hivedscheduler"]["config"]) if wrapped else doc
    sku, cell, pool = "CHAOS-NET", "CHAOS-NET-NODE", "CHAOS-NET-NODE-POOL"
    pc = cfg["physicalCluster"]
    if vc in cfg.get("virtualClusters", {}):
        raise ValidationError("vc", f"virtual cluster {vc} already exists")
    pc["skuTypes"][sku] = {"gpu": 1, "cpu": 2, "memory": "4096Mi"}
    pc["cellTypes"][cell] = {"childCellType": sku, "childCellNumber": gpus, "isNodeLevel": True}
    pc["cellTypes"][pool] = {"childCellType": cell, "childCellNumber": 1}
    pc["physicalCells"].append({"cellType": pool, "cellChildren": [{"cellAddress": node}]})
    cfg.setdefault("virtualClusters", {})[vc] = {"virtualCells": [{"cellType": f"{pool}.{cell}", "cellNumber": 1}]}
    text = yaml.safe_dump(cfg, sort_keys=False)
    return yaml.safe_dump({"hivedscheduler": {"config": text}}, sort_keys=False) if wrapped else text


def _put_config(t: Target, text: str) -> None:
    r = httpx.put(f"{t.api_url}/api/v2/cluster/config", content=text.encode(), timeout=60.0,
                  headers={"Authorization": f"Bearer {t.token}", "Content-Type": "text/yaml"})
    if r.status_code != 200:
        raise PlatformError(f"PUT /api/v2/cluster/config: {r.status_code} {r.text[:300]}")


def attach(t: Target, node: str, vc: str, gpus: int = 1, ready_timeout_s: float = 60.0) -> dict[str, Any]:
    if load_state(t, STATE) is not None:
        raise ValidationError("node", "a netns node is attached already; detach it first (detach_netns_node)")
    home = t.need_home()
    ns = f"apiary-chaos-{secrets.token_hex(3)}"
    d = t.state_dir() / ns
    (d / "credentials").mkdir(parents=True)
    state: dict[str, Any] = {"netns": ns, "dir": str(d), "node": node, "vc": vc,
                             "original_config": (home / "cluster.yaml").read_text()}
    save_state(t, STATE, state)  # from here on, detach() cleans up whatever was made
    _ip("ip", "netns", "add", ns)
    _ip("ip", "link", "set", "lo", "up", netns=ns)
    target = t.api_url.split("//", 1)[1].split("/", 1)[0]
    delay_file = d / "delay_ms"
    delay_file.write_text("0")
    ready = d / "proxy.port"
    with open(d / "proxy.log", "ab") as log:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "apiary.chaos.netproxy", "--netns", ns, "--target", target, "--ready", str(ready),
             "--delay-file", str(delay_file)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    state["proxy_pid"] = proxy.pid
    save_state(t, STATE, state)
    port = _wait_file(ready, proxy, 20.0)
    _put_config(t, with_node(state["original_config"], node, vc, gpus))
    state["config_applied"] = True
    save_state(t, STATE, state)
    with closing(t.client()) as c:
        tok = c.create_token(node, kind="agent", description="apiary chaos: netns agent", expires_in_s=3600)
    state["token_id"] = tok["id"]
    token_file = d / "credentials" / f"agent-{node}.token"
    token_file.write_text(tok["token"] + "\n")
    os.chmod(token_file, 0o600)
    env = {**os.environ, "APIARY_HOME": str(d), "PYTHONUNBUFFERED": "1"}
    env.pop("APIARY_TOKEN", None)
    with open(d / "agent.log", "ab") as log:
        agent = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "apiary", "agent", "--api", f"http://127.0.0.1:{port}",
             "--node", node, "--simulated-gpus", "--state-dir", str(d / "agents"), "--credentials",
             str(d / "credentials"), "--workdir", str(d)],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)
    state["agent_pid"] = agent.pid
    save_state(t, STATE, state)
    deadline = time.monotonic() + ready_timeout_s
    with closing(t.client()) as c:
        while not any(n["name"] == node and n["ready"] for n in c.nodes()):
            if agent.poll() is not None:
                raise PlatformError(f"the netns agent exited with {agent.returncode}; see {d / 'agent.log'}")
            if time.monotonic() > deadline:
                raise PlatformError(f"node {node} not ready {ready_timeout_s:.0f} s after its agent started in {ns}")
            time.sleep(0.25)
    return {"netns": ns, "node": node, "vc": vc, "relay_port": port, "agent_pid": agent.pid}


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise PlatformError(f"the relay did not start (exit {proc.poll()}); see {path.parent / 'proxy.log'}")
        time.sleep(0.05)
    return int(path.read_text())


def degrade(t: Target, delay_ms: float, loss_pct: float) -> dict[str, Any]:
    state = load_state(t, STATE)
    if state is None:
        raise ValidationError("netns", "no netns node attached (attach_netns_node first)")
    ns = state["netns"]
    r = _ip("tc", "qdisc", "replace", "dev", "lo", "root", "netem", "delay", f"{delay_ms:g}ms",
            "loss", f"{loss_pct:g}%", netns=ns, check=False)
    if r.returncode == 0:
        return {"mechanism": "tc netem on lo", "delay_ms": delay_ms, "loss_pct": loss_pct, "netns": ns}
    if "unknown" not in r.stderr.lower():
        raise PlatformError(f"tc netem in {ns} failed: {r.stderr.strip()}")
    # No sch_netem in this kernel: drop with iptables' statistic match, delay in the relay.
    if loss_pct > 0:
        _ip("iptables", "-A", "INPUT", "-i", "lo", "-m", "statistic", "--mode", "random", "--probability",
            f"{loss_pct / 100:.4f}", "-j", "DROP", netns=ns)
    (Path(state["dir"]) / "delay_ms").write_text(f"{delay_ms:g}")
    return {"mechanism": "iptables statistic drop on lo + relay delay (this kernel has no sch_netem)",
            "delay_ms": delay_ms, "loss_pct": loss_pct, "netns": ns}


def restore(t: Target) -> dict[str, Any]:
    """Remove the delay and loss (idempotent; nothing to do without an attached node)."""
    state = load_state(t, STATE)
    if state is None:
        return {"restored": False}
    ns = state["netns"]
    dropped = 0
    if Path(f"/run/netns/{ns}").exists():
        _ip("tc", "qdisc", "del", "dev", "lo", "root", netns=ns, check=False)
        listing = _ip("iptables", "-L", "INPUT", "-v", "-x", "-n", netns=ns, check=False).stdout
        dropped = sum(int(line.split()[0]) for line in listing.splitlines() if " DROP " in f" {line} ")
        _ip("iptables", "-F", "INPUT", netns=ns, check=False)
    delay = Path(state["dir"]) / "delay_ms"
    if delay.parent.exists():
        delay.write_text("0")
    # iptables' count of the packets its loss rule dropped: proof the link was degraded (0 under netem)
    return {"restored": True, "netns": ns, "iptables_dropped_packets": dropped}


def detach(t: Target) -> dict[str, Any]:
    """Undo :func:`attach` as far as it got (idempotent). Raises PlatformError naming every step that
    failed, after trying all of them."""
    state = load_state(t, STATE)
    if state is None:
        return {"detached": False}
    errors: list[str] = []
    for key, sig in (("agent_pid", signal.SIGTERM), ("proxy_pid", signal.SIGTERM)):
        pid = state.get(key)
        if pid:
            _stop_pid(pid, sig, errors)
    if state.get("config_applied"):
        try:
            _put_config(t, state["original_config"])
        except (PlatformError, httpx.HTTPError) as e:
            errors.append(f"restoring the cluster config: {e}")
    if state.get("token_id"):
        try:
            with closing(t.client()) as c:
                c.revoke_token(state["token_id"])
        except Exception as e:  # noqa: BLE001 - collected, reported below
            errors.append(f"revoking the agent token: {e}")
    ns = state["netns"]
    if Path(f"/run/netns/{ns}").exists():
        r = _ip("ip", "netns", "del", ns, check=False)
        if r.returncode != 0:
            errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
    if errors:
        raise PlatformError("detach_netns_node: " + "; ".join(errors))
    drop_state(t, STATE)
    return {"detached": True, "netns": ns, "node": state["node"]}


def _stop_pid(pid: int, sig: int, errors: list[str]) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # our child: reap it
        except ChildProcessError:
            done = 0 if _alive(pid) else pid
        if done == pid:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    errors.append(f"process {pid} ignored SIGTERM for 15 s (killed)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
