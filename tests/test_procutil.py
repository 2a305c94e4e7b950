"""apiary.procutil's remembered ports (the Prefect server's and MLflow's under apiary up)."""

from __future__ import annotations

import socket
from pathlib import Path

from apiary.procutil import remembered_port
from apiary.tracking.prefect_server import free_port


def test_a_port_is_remembered_while_free_and_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "run" / "port"
    first = remembered_port(path, free_port)
    assert remembered_port(path, free_port) == first
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        moved = remembered_port(path, free_port)
    assert moved != first and path.read_text() == str(moved)
    again = remembered_port(path, free_port, taken={moved})  # another server of the platform has it
    assert again != moved and path.read_text() == str(again)
