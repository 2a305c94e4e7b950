"""The platform's processes run with umask 077 from their entry points, so the store (SQLite creates
it and its WAL with the process umask), the task logs, the agents' records and the bridge's state
are 0600 however they are started (by ``apiary up``, by hand, in a container). Typer's CliRunner,
in process, with each command's work replaced by a probe of the umask it runs under."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from apiary.cli import main as cli


def _current_umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[int]]:
    """The umasks the probed commands ran under; the process starts at 022 and gets its own umask
    back after (the commands set it for good, as a platform process's entry point does)."""
    monkeypatch.setattr(cli, "_logging", lambda verbose=False: None)
    monkeypatch.setenv("APIARY_HOME", str(tmp_path / "home"))
    old = os.umask(0o022)
    try:
        yield []
    finally:
        os.umask(old)


def test_the_control_plane_runs_with_umask_077(seen: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from apiary import wiring as server

    monkeypatch.setattr(server, "serve", lambda *a, **kw: seen.append(_current_umask()))
    result = CliRunner().invoke(cli.app, ["control-plane", "--port", "1"])
    assert result.exit_code == 0, result.output
    assert seen == [0o077]


def test_the_agent_runs_with_umask_077(seen: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from apiary.client import ApiaryClient
    from apiary.runtime import agent

    async def run_agents(*args: Any, **kwargs: Any) -> None:
        seen.append(_current_umask())

    monkeypatch.setattr(ApiaryClient, "nodes", lambda self: [{"name": "n1", "gpus": 1}])
    monkeypatch.setattr(agent, "run_agents", run_agents)
    result = CliRunner().invoke(cli.app, ["agent", "--api", "http://127.0.0.1:1", "--all-nodes"])
    assert result.exit_code == 0, result.output
    assert seen == [0o077]


def test_the_prefect_bridge_runs_with_umask_077(seen: list[int], monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    from apiary.tracking import bridge

    async def run_bridge(*args: Any, **kwargs: Any) -> None:
        seen.append(_current_umask())

    monkeypatch.setattr(bridge, "run_bridge", run_bridge)
    result = CliRunner().invoke(cli.app, ["prefect-bridge", "--api", "http://127.0.0.1:1", "--prefect-api",
                                          "http://127.0.0.1:2/api", "--state", str(tmp_path / "bridge.json")])
    assert result.exit_code == 0, result.output
    assert seen == [0o077]
