"""The hosts harness (apiary.hosts.netns) on real network namespaces: hosts reach each other by
name and nothing else, partitions cut and heal, teardown leaves nothing, not even after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.hosts.helpers import connect, ping
from tests.support.polling import until

from apiary.hosts import netns
from apiary.hosts.netns import ETC_NETNS, REGISTRY, Hosts, HostsError, cleanup_stale, hosts

pytestmark = pytest.mark.netns


def harness_objects(prefix: str) -> list[str]:
    """The namespaces, links, /etc/netns entries and registry entry of harness ``prefix`` still on the machine."""
    names = [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                        check=True).stdout.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout.splitlines()]
    found = [n for n in names if n.startswith(prefix)]
    if ETC_NETNS.is_dir():
        found += [str(p) for p in ETC_NETNS.glob(f"{prefix}*")]
    entry = REGISTRY / f"{prefix.rstrip('-')}.json"
    return found + ([str(entry)] if entry.exists() else [])


def gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, waiting for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_bad_host_names_are_refused_naming_the_field():
    for names in (["Db"], ["db_1"], ["db", "db"], ["operator"], []):
        with pytest.raises(HostsError, match="names"):
            Hosts(names, "/nonexistent")


def test_hosts_reach_each_other_by_name_and_nothing_else(netns_root):
    with hosts(["db", "cp1", "node1"], netns_root) as h:
        addrs = [h.address(n) for n in ("db", "cp1", "node1")]
        k = h.prefix.removeprefix("apy").rstrip("-")
        assert addrs == [f"198.18.{k}.1", f"198.18.{k}.2", f"198.18.{k}.3"]
        for name in ("db", "cp1", "node1"):
            others = [n for n in ("db", "cp1", "node1") if n != name]
            assert ping(h, name, *others, "operator") == {n: "ok" for n in [*others, "operator"]}
            assert h.state_dir(name) == netns_root / name and h.state_dir(name).is_dir()
            # No default route: the only route is the harness's own /24.
            routes = h.exec(name, ["ip", "-4", "route", "show"], check=True).stdout.strip().splitlines()
            assert len(routes) == 1 and routes[0].startswith(f"198.18.{k}.0/24 dev eth0"), routes

        # Off the harness's /24 there is no route: 198.18.255.0/24 is never given out.
        assert ping(h, "cp1", "198.18.255.1", "192.0.2.1") == {"198.18.255.1": "ENETUNREACH",
                                                               "192.0.2.1": "ENETUNREACH"}
        # The root namespace's loopback is not the host's: a server there is not reachable.
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # reachable from the root namespace itself
            assert connect(h, "cp1", "127.0.0.1", port) == "ECONNREFUSED"

        # A second harness at once: its own subnet, and its hosts cannot reach the first's.
        with hosts(["db"], netns_root / "second") as h2:
            assert h2.prefix != h.prefix
            assert h2.address("db") not in addrs
            assert ping(h2, "db", h.address("db"))[h.address("db")] == "ENETUNREACH"
            assert ping(h, "cp1", "db") == {"db": "ok"}  # its name stays its own harness's db


def test_partition_cuts_every_link_and_heal_restores_them(netns_root):
    with hosts(["a", "b"], netns_root) as h:
        assert ping(h, "a", "b") == {"b": "ok"}
        h.partition("b")
        assert ping(h, "a", "b", timeout_s=0.5) == {"b": "timeout"}  # dropped, no answer
        assert ping(h, "b", "a")["a"] == "ENETUNREACH"  # its link is down inside too
        assert ping(h, "a", "operator") == {"operator": "ok"}  # the others are unaffected
        h.heal("b")
        until(lambda: ping(h, "a", "b", timeout_s=0.5) == {"b": "ok"}, 30, "b reachable after heal")
        assert ping(h, "b", "a") == {"a": "ok"}


def test_netem_delays_packets(netns_root):
    with hosts(["a", "b"], netns_root) as h:
        try:
            h.netem("b", delay_ms=200)
        except HostsError as e:
            if "CONFIG_NET_SCH_NETEM" in str(e):
                pytest.skip(str(e))
            raise
        started = time.monotonic()
        assert ping(h, "a", "b") == {"b": "ok"}
        assert time.monotonic() - started >= 0.4  # 200 ms each way
        h.netem("b")  # removed


IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print(1, flush=True); time.sleep(600)")


def test_teardown_stops_every_process_in_the_hosts_and_removes_everything(netns_root, monkeypatch):
    monkeypatch.setattr(netns, "STOP_GRACE_S", 1.0)
    h = Hosts(["a"], netns_root).up()
    prefix = h.prefix
    started = h.run("a", ["sleep", "600"])
    stubborn = h.run("a", [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == b"1"
    # A process that left the started one's session and group: found by its namespace.
    escaped = h.run("a", ["sh", "-c", "setsid sleep 600 & echo $!; wait"], stdout=subprocess.PIPE)
    assert escaped.stdout is not None
    escaped_pid = int(escaped.stdout.readline())
    until(lambda: {started.pid, escaped_pid} <= set(h.pids("a")), 10, "processes in host a")
    h.down()
    assert started.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL  # after the grace
    until(lambda: gone(escaped_pid), 15, "the escaped process to be killed")
    assert harness_objects(prefix) == []
    h.down()  # idempotent
    assert (netns_root / "a").is_dir()  # state directories stay


CRASHING_OWNER = """
import json, sys, time
from apiary.hosts.netns import Hosts
h = Hosts(["a", "b"], sys.argv[1]).up()
p = h.run("a", ["sleep", "600"])
print(json.dumps({"prefix": h.prefix, "pid": p.pid}), flush=True)
time.sleep(600)
"""


def test_cleanup_stale_removes_what_a_killed_owner_left(netns_root):
    owner = subprocess.Popen([sys.executable, "-c", CRASHING_OWNER, str(netns_root)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    prefix = None
    try:
        assert owner.stdout is not None
        made = json.loads(owner.stdout.readline())
        prefix, sleeper = made["prefix"], made["pid"]
        assert cleanup_stale(prefix) == []  # its owner lives: left alone
        assert len(harness_objects(prefix)) >= 6
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        assert not gone(sleeper) and len(harness_objects(prefix)) >= 6  # the crash left them
        assert cleanup_stale(prefix) == [prefix]
        assert harness_objects(prefix) == []
        until(lambda: gone(sleeper), 15, "the dead owner's process to be killed")
        assert cleanup_stale(prefix) == []  # idempotent
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
        if prefix is not None:
            cleanup_stale(prefix, force=True)


FORGETFUL_OWNER = """
import json, sys
from apiary.hosts.netns import Hosts
h = Hosts(["a"], sys.argv[1]).up()
p = h.run("a", ["sleep", "600"])
print(json.dumps({"prefix": h.prefix, "pid": p.pid}), flush=True)
"""


def test_an_owner_that_exits_without_down_leaves_nothing(netns_root):
    r = subprocess.run([sys.executable, "-c", FORGETFUL_OWNER, str(netns_root)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    try:
        assert harness_objects(made["prefix"]) == []  # the finalizer ran at interpreter exit
        assert gone(made["pid"])
    finally:
        cleanup_stale(made["prefix"], force=True)
