"""The CLI's tables at 80 columns: ids and node names are never cut, nor are the short columns
beside them (a job's state), a waiting reason is shown whole, and ``cluster status`` prints a
table unless asked for JSON (httpx.MockTransport, no server)."""

from __future__ import annotations

import io
import json

import httpx
import pytest
from rich.console import Console
from tests.support.builders import LAB6, healthy_scheduler
from typer.testing import CliRunner

from apiary.cli import main as cli
from apiary.client import ApiaryClient

LONG_ID = "alice~" + "mnist-learning-rate-sweep-0-01-batch-64-run-7"  # 51 characters
HUGE_ID = "bob~" + "x" * 120  # wider than the terminal


def job(job_id: str, **changes) -> dict:
    return {"id": job_id, "state": "WAITING", "virtualCluster": "default", "priorityClass": "prod", "retries": 0,
            "waitingReason": "Waiting for resources: VC default has 0 of 1 GPU-C leaf cells free", **changes}


def node(name: str, *cordons: tuple[str, str]) -> dict:
    """A ``GET /api/v2/nodes`` entry holding ``cordons`` ((source, reason), ...)."""
    return {"name": name, "gpus": 8, "gpusUsed": 2, "simulatedGpus": True, "healthy": True,
            "cordoned": bool(cordons), "schedulable": not cordons, "skuType": "GPU-C",
            "cordons": [{"source": src, "reason": why, "by": "root", "at": "2026-11-28T05:00:00.000Z"}
                        for src, why in cordons]}


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """path -> JSON the mocked API answers; the CLI's console is 80 columns wide (read it with ``shown()``)."""
    routes: dict[str, object] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=routes[request.url.path])

    monkeypatch.setattr(cli, "_client", lambda: ApiaryClient("http://apiary.test",
                                                             transport=httpx.MockTransport(handler)))
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=80))
    return routes


def shown() -> str:
    return cli.console.file.getvalue()  # type: ignore[attr-defined]


def first_column(table: str) -> list[str]:
    """The first column's cell text of each body line of a rich table."""
    body = table.split("┡", 1)[1].splitlines()[1:]
    return [line.split("│")[1].strip() for line in body if line.startswith("│")]


def rows(listing: str) -> list[dict[str, str]]:
    """The rows of a ``print_rows`` listing (header, a rule, then the body up to a blank line), each
    as {header: cell}; a cell folded over several lines is joined back into one string."""
    lines = listing.splitlines()
    header = lines[0]
    starts = [i for i in range(len(header)) if header[i] != " " and (i == 0 or header[i - 2:i] == "  ")]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    out: list[dict[str, str]] = []
    for line in lines[2:]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        if any(cells[1:]) or not out:
            out.append(dict(zip(names, cells, strict=True)))
        else:  # a continuation line: only the first column goes on
            out[-1][names[0]] += cells[0]
    return out


REASON = "Waiting for resources: VC default has 0 of 1 GPU-C leaf cells free"


def test_job_list_keeps_a_long_id_and_every_state_whole_at_80_columns(answers) -> None:
    answers["/api/v2/jobs"] = [job(LONG_ID), job("bob~x", state="SUCCEEDED", waitingReason=None)]
    result = CliRunner().invoke(cli.app, ["job", "list"])
    assert result.exit_code == 0, result.output
    listing = shown()
    assert max(map(len, listing.splitlines())) <= 80  # nothing runs past the terminal
    assert "…" not in listing  # nothing cut with an ellipsis (the state column was "WAIT…")
    assert [(r["id"], r["state"], r["vc"], r["priority"]) for r in rows(listing)] == [
        (LONG_ID, "WAITING", "default", "prod"), ("bob~x", "SUCCEEDED", "default", "prod")]
    # no room beside the table for a sentence: the reason is listed under it, whole
    tail = " ".join(listing.split("waiting reason:", 1)[1].split())
    assert tail == f"{LONG_ID}: {REASON}"


def test_job_list_shows_the_waiting_reason_in_its_column_when_there_is_room(answers, monkeypatch) -> None:
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=160))
    answers["/api/v2/jobs"] = [job("alice~mnist", waitingReason="Waiting [for] a cell")]  # not rich markup
    assert CliRunner().invoke(cli.app, ["job", "list"]).exit_code == 0
    [row] = rows(shown())
    assert row["waiting reason"] == "Waiting [for] a cell" and "waiting reason:" not in shown()


def test_job_list_folds_an_id_wider_than_the_terminal_and_keeps_every_character(answers) -> None:
    answers["/api/v2/jobs"] = [job(HUGE_ID)]
    assert CliRunner().invoke(cli.app, ["job", "list"]).exit_code == 0
    [row] = rows(shown())
    assert row["id"] == HUGE_ID and row["state"] == "WAITING" and row["retries"] == "0"
    assert max(map(len, shown().splitlines())) <= 80


def test_node_list_keeps_long_names_whole(answers) -> None:
    name = "gpu-worker-rack-17-slot-4.cluster.example.internal"
    answers["/api/v2/nodes"] = [node(name), node("hostname-dan")]
    assert CliRunner().invoke(cli.app, ["node", "list"]).exit_code == 0
    assert "…" not in shown() and max(map(len, shown().splitlines())) <= 80
    assert [(r["name"], r["healthy"], r["simulated GPUs"]) for r in rows(shown())] == [
        (name, "True", "yes"), ("hostname-dan", "True", "yes")]
    # no room beside the table: who holds a cordon on each node is listed under it, whole
    assert shown().split("cordoned:\n", 1)[1].splitlines() == [f"{name}: no", "hostname-dan: no"]


def test_node_list_names_the_sources_of_each_node_s_cordons(answers, monkeypatch) -> None:
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=160))
    answers["/api/v2/nodes"] = [node("hostname-carol"), node("hostname-dan", ("admin", "disk"), ("drill:stress", "x"))]
    assert CliRunner().invoke(cli.app, ["node", "list"]).exit_code == 0
    assert [(r["name"], r["cordoned"]) for r in rows(shown())] == [
        ("hostname-carol", "no"), ("hostname-dan", "admin, drill:stress")]


def test_node_get_lists_each_cordon_with_its_reason(answers) -> None:
    why = "stress drill failed: matmul-below-baseline: 4.0 GFLOP/s is below 50% of the SKU baseline [40.0]"
    answers["/api/v2/nodes/hostname-dan"] = node("hostname-dan", ("admin", "disk check"), ("drill:stress", why))
    assert CliRunner().invoke(cli.app, ["node", "get", "hostname-dan"]).exit_code == 0
    assert "…" not in shown() and max(map(len, shown().splitlines())) <= 80
    node_row, cordons = shown().split("\n\n", 1)
    assert [(r["name"], r["schedulable"]) for r in rows(node_row)] == [("hostname-dan", "False")]
    firsts = [line.split()[:4] for line in cordons.splitlines() if line.startswith(("admin", "drill:"))]
    assert firsts == [["admin", "2026-11-28", "05:00", "root"], ["drill:stress", "2026-11-28", "05:00", "root"]]
    assert "disk check" in cordons and why in " ".join(cordons.split())  # the reason whole, wrapped at words


def test_job_submit_prints_the_id_on_one_line(answers, tmp_path) -> None:
    answers["/api/v2/jobs"] = job(HUGE_ID)
    result = CliRunner().invoke(cli.app, ["job", "submit", str(LAB6 / "job-config-0.yaml")])
    assert result.exit_code == 0 and result.output == HUGE_ID + "\n"


@pytest.fixture
def status() -> dict:
    s = healthy_scheduler(LAB6 / "hived-config-two-vcs.yaml").status(None)
    s["reservations"] = {"bob~job-config-2": {"priority": 100, "victims": ["alice~job-config-1"],
                                              "cells": ["hostname-dan/0"]}}
    return s


def test_cluster_status_prints_a_table_by_default(answers, status: dict) -> None:
    answers["/api/v2/cluster/status"] = status
    result = CliRunner().invoke(cli.app, ["cluster", "status"])
    assert result.exit_code == 0, result.output
    table = shown()
    assert result.output == ""  # nothing went to stdout as JSON
    title, vcs = table.split("\n", 1)
    assert title == "Virtual clusters (leaf cells)" and "…" not in vcs.split("Reservations")[0]
    by_vc = {r["virtual cluster"]: r for r in rows(vcs.split("Reservations")[0])}
    assert set(by_vc) == {"default", "vc1"} and by_vc["vc1"]["quota"] == "1" and by_vc["vc1"]["opportunistic"] == "0"
    assert "bob~job-config-2" in table and "alice~job-config-1" in table and "hostname-dan/0" in table


def test_cluster_status_json(answers, status: dict) -> None:
    answers["/api/v2/cluster/status"] = status
    result = CliRunner().invoke(cli.app, ["cluster", "status", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == status and shown() == ""


def a_task(index: int, **changes) -> dict:
    return {"taskRole": "worker", "index": index, "state": "RUNNING", "node": "hostname-carol", "gpus": [index],
            "simulatedGpus": True, "exitCode": None, **changes}


def test_job_get_at_80_columns_keeps_every_value_on_its_line(answers) -> None:
    """The job's own row is a table like ``job list``'s: its retries are ``user 1, platform 2``, never a
    dict cut over two lines; the id, the states and the nodes are whole; nothing runs past 80."""
    answers[f"/api/v2/jobs/{LONG_ID}"] = job(
        LONG_ID, state="RUNNING", retries=3, retryDetails={"user": 1, "platform": 2},
        tasks=[a_task(0), a_task(1, state="FAILED", node="hostname-dan", exitCode=137, simulatedGpus=False)])
    result = CliRunner().invoke(cli.app, ["job", "get", LONG_ID])
    assert result.exit_code == 0, result.output
    text = shown()
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    assert "{" not in text and "'" not in text  # no Python dict printed
    [head] = rows(text)
    assert (head["id"], head["state"], head["vc"], head["priority"], head["retries"]) == (
        LONG_ID, "RUNNING", "default", "prod", "user 1, platform 2")
    tasks = rows(text.split("\n\n")[-1])
    assert [(t["task"], t["state"], t["node"], t["gpus"], t["exit code"]) for t in tasks] == [
        ("worker/0", "RUNNING", "hostname-carol (simulated GPUs)", "0", "-"),
        ("worker/1", "FAILED", "hostname-dan", "1", "137")]
    assert " ".join(text.split("waiting reason:", 1)[1].split()).startswith(f"{LONG_ID}: {REASON}")
