"""``apiary hosts``: hosts made by one command outlive it, and later commands find them by --root."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apiary.cli.hosts import hosts_app
from apiary.hosts.netns import STATE_FILE, cleanup_stale

pytestmark = pytest.mark.netns


def test_up_exec_down_across_invocations(netns_root):
    runner = CliRunner()
    root = str(netns_root / "h")
    up = runner.invoke(hosts_app, ["up", "db", "cp1", "--root", root])
    assert up.exit_code == 0, up.output
    prefix = json.loads((netns_root / "h" / STATE_FILE).read_text())["prefix"]
    try:
        assert "198.18." in up.output and "operator" in up.output
        assert prefix not in cleanup_stale()  # a detached harness is live while its state file names it
        again = runner.invoke(hosts_app, ["up", "db", "--root", root])
        assert again.exit_code == 1 and "already" in again.output
        ok = runner.invoke(hosts_app, ["exec", "cp1", "--root", root, "--", "getent", "hosts", "db"])  # resolves
        assert ok.exit_code == 0
        failing = runner.invoke(hosts_app, ["exec", "cp1", "--root", root, "--", "sh", "-c", "exit 3"])
        assert failing.exit_code == 3
        unknown = runner.invoke(hosts_app, ["exec", "nope", "--root", root, "--", "true"])
        assert unknown.exit_code == 1 and "no host 'nope'" in unknown.output
        down = runner.invoke(hosts_app, ["down", "--root", root])
        assert down.exit_code == 0 and prefix in down.output
        assert not (netns_root / "h" / STATE_FILE).exists()
        assert runner.invoke(hosts_app, ["down", "--root", root]).exit_code == 1  # nothing there any more
    finally:
        cleanup_stale(prefix, force=True)
