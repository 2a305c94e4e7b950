"""apiary.procutil's remembered ports (the Prefect server's and MLflow's under apiary up)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

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


def test_replace_file_swaps_in_a_private_file_and_leaves_no_temp_behind_when_it_fails(tmp_path, monkeypatch):
    import os
    import stat

    from apiary import procutil

    target = tmp_path / "state.json"
    target.write_text("old")
    procutil.replace_file(target, "new")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]

    def refused(src, dst):
        raise OSError("rename refused")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="rename refused"):
        procutil.replace_file(target, "newer")
    assert target.read_text() == "new"  # the old content stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
