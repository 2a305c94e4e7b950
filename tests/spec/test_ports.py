"""A task's named ports (apiary.spec.ports) and the node's check that they are free
(apiary.runtime.ports): the same run gets the same ports everywhere, a retry gets others, and a
port held on the node fails the launch with OpenPAI's 253 before anything starts."""

from __future__ import annotations

import socket

from apiary.lifecycle import classify_exit
from apiary.runtime.ports import EXIT_PORT_CONFLICT, own_ports, taken
from apiary.spec.ports import PORT_BASE, PORT_SPAN, task_ports


def test_ports_follow_the_run_id_and_differ_within_a_run() -> None:
    a = task_ports("alice~j.a0.train.0.t0", ["ssh", "http", "jupyter"])
    assert a == task_ports("alice~j.a0.train.0.t0", ["jupyter", "http", "ssh", "ssh"])
    assert len(set(a.values())) == 3 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in a.values())
    retry = task_ports("alice~j.a1.train.0.t0", ["ssh", "http", "jupyter"])
    assert retry != a
    # Many names in one run never share a port.
    many = task_ports("r", [f"p{i}" for i in range(500)])
    assert len(set(many.values())) == 500


def test_a_taken_port_is_found_and_is_openpais_platform_failure() -> None:
    assert own_ports({"PAI_CONTAINER_HOST_PORT_LIST": "http:20001;ssh:20002"}) == {"http": 20001, "ssh": 20002}
    assert own_ports({}) == {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert taken({"http": port}) == [f"http:{port}"]
    assert taken({"http": port}) == []
    info = classify_exit(EXIT_PORT_CONFLICT)
    assert info.phrase == "ContainerPortConflict" and info.type == "PLATFORM_FAILURE"
