"""``apiary ci runs`` and ``apiary deploy history`` against a live platform: a real control-plane app
served on loopback (tests.support.serving) over a temp SQLite store, records posted through
:class:`apiary.client.ApiaryClient` with the service token as the CI/CD flows post them, and the CLI
run with the admin's token (``APIARY_API_URL`` / ``APIARY_TOKEN``). Tables are read at 80 columns:
ids and short shas are never cut."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console
from tests.api.test_ci_records import a_deployment, a_run, finished_run
from tests.support.auth import Principals
from tests.support.plane import Harness
from tests.support.serving import serving
from typer.testing import CliRunner

from apiary.api import create_app
from apiary.auth import Directory
from apiary.cli import ci as ci_cli
from apiary.cli import deploy as deploy_cli
from apiary.cli import main as cli
from apiary.client import ApiaryClient

LONG_REPO = "acme-corporation-platform-team/apiary-gpu-cluster-platform"  # wider than its column at 80


@dataclass
class Live:
    url: str
    flows: ApiaryClient  # the service token, as the CI/CD flows post
    tokens: dict[str, str]


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    plane = Harness(tmp_path).plane
    p = Principals(Directory(plane.sessions), plane.cluster.virtual_clusters)
    tokens = {"admin": p.admin(), "alice": p.user("alice"), "bridge": p.service("bridge")}
    monkeypatch.setenv("APIARY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("APIARY_TOKEN", tokens["admin"])
    for module in (ci_cli, deploy_cli):
        monkeypatch.setattr(module, "console", Console(file=io.StringIO(), width=80))
    with serving(create_app(plane)) as url:
        monkeypatch.setenv("APIARY_API_URL", url)
        flows = ApiaryClient(url, token=tokens["bridge"])
        yield Live(url, flows, tokens)
        flows.close()


def shown(module) -> str:
    return module.console.file.getvalue()


def invoke(*args: str) -> str:
    result = CliRunner().invoke(cli.app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def cells(table: str, header: str, next_header: str | None = None) -> list[str]:
    """The text of the column under ``header`` (up to ``next_header``'s column) on each body line
    of a borderless rich table (a rule under the header; a folded cell continues on the next lines)."""
    lines = table.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.strip() and not any(c.isalnum() for c in line))
    start = lines[rule - 1].index(header)
    end = lines[rule - 1].index(next_header) if next_header else None
    return [line[start:end].strip() for line in lines[rule + 1:]]


def test_ci_runs_shows_the_recorded_runs_newest_first_at_80_columns(live: Live) -> None:
    first = live.flows.record_ci_run(a_run("fr-old", startedAt="2026-11-25T09:00:00Z"))
    live.flows.record_ci_run(finished_run("fr-old", result="failure", startedAt="2026-11-25T09:00:00Z"))
    newest = live.flows.record_ci_run(finished_run("fr-new", repo=LONG_REPO, kind="deploy", prNumber=None,
                                                   sha="c3" * 20, startedAt="2026-11-25T10:00:00Z"))
    invoke("ci", "runs")
    table = shown(ci_cli)
    assert max(map(len, table.splitlines())) <= 80, table
    assert [c for c in cells(table, "id", "repo") if c] == [str(newest["id"]), str(first["id"])], table
    assert [c for c in cells(table, "sha", "kind") if c] == ["c3c3c3c", "a1a1a1a"], table  # whole, one line
    assert LONG_REPO in "".join(cells(table, "repo", "PR")), table  # folded, never cut with an ellipsis
    assert "…" not in table
    assert "failure" in table and "unit" in table and "5m00s" in table and "2026-11-25" in table


def test_ci_runs_json_and_filters(live: Live) -> None:
    live.flows.record_ci_run(finished_run("a", result="success"))
    live.flows.record_ci_run(finished_run("b", result="failure", repo="acme/docs", startedAt="2026-11-25T10:01:00Z"))
    live.flows.record_ci_run(a_run("c", kind="deploy", prNumber=None, startedAt="2026-11-25T10:02:00Z"))
    everything = json.loads(invoke("ci", "runs", "--json"))
    assert [r["flowRunId"] for r in everything] == ["c", "b", "a"]
    assert everything == live.flows.as_token(live.tokens["admin"]).ci_runs()
    assert [r["flowRunId"] for r in json.loads(invoke("ci", "runs", "--json", "--limit", "1"))] == ["c"]
    assert [r["flowRunId"] for r in json.loads(invoke("ci", "runs", "--json", "--repo", "acme/docs"))] == ["b"]
    assert [r["flowRunId"] for r in json.loads(invoke("ci", "runs", "--json", "--result", "success"))] == ["a"]
    assert [r["flowRunId"] for r in json.loads(invoke("ci", "runs", "--json", "--kind", "deploy"))] == ["c"]


def test_ci_runs_needs_an_admin_and_says_why(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_TOKEN", live.tokens["alice"])
    result = CliRunner().invoke(cli.app, ["ci", "runs"])
    assert result.exit_code == 1
    assert "403" in result.output and "Only admins" in " ".join(result.output.split())
    monkeypatch.setenv("APIARY_TOKEN", live.tokens["admin"])
    bad = CliRunner().invoke(cli.app, ["ci", "runs", "--result", "green"])
    assert bad.exit_code == 1 and "result" in bad.output


def test_deploy_history_shows_the_deployments_newest_first(live: Live) -> None:
    ok = live.flows.record_deployment(a_deployment())
    rolled = live.flows.record_deployment(a_deployment(
        sha="d4" * 20, result="rolled_back", startedAt="2026-11-25T12:00:00Z", finishedAt="2026-11-25T12:10:00Z",
        reason="the smoke job on the new agent image did not start within 300 s; restored the previous images"))
    invoke("deploy", "history")
    table = shown(deploy_cli)
    assert max(map(len, table.splitlines())) <= 80, table
    assert [c for c in cells(table, "id", "sha") if c] == [str(rolled["id"]), str(ok["id"])], table
    assert [c for c in cells(table, "sha", "result") if c] == ["d4d4d4d", "b2b2b2b"], table
    assert [c for c in cells(table, "result", "trigger") if c] == ["rolled_back", "succeeded"], table
    assert "10m00s" in table and "…" not in table
    assert "restored the previous images" in " ".join(cells(table, "reason")), table  # folded, not cut
    history = json.loads(invoke("deploy", "history", "--json", "--sha", "d4d4"))
    assert [d["id"] for d in history] == [rolled["id"]]
    assert history[0]["images"] == a_deployment()["images"]
    assert [d["id"] for d in json.loads(invoke("deploy", "history", "--json", "--limit", "1"))] == [rolled["id"]]


def test_the_client_methods_round_trip(live: Live) -> None:
    admin = live.flows.as_token(live.tokens["admin"])
    run = live.flows.record_ci_run(a_run("rt"))
    assert admin.ci_runs(limit=5, repo="acme/apiary", result=None) == [run]
    d = live.flows.record_deployment(a_deployment(flowRunId="rt-deploy"))
    assert admin.deployments(sha=d["sha"][:10], result="succeeded") == [d]
    assert admin.deployments(result="failed") == []
