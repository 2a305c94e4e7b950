"""The CLI's tables at 80 columns: ids and node names are never cut, and ``cluster status`` prints a
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


def node(name: str) -> dict:
    return {"name": name, "gpus": 8, "gpusUsed": 2, "simulatedGpus": True, "healthy": True, "cordoned": False,
            "skuType": "GPU-C"}


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


def test_job_list_keeps_a_long_id_whole_at_80_columns(answers) -> None:
    answers["/api/v2/jobs"] = [job(LONG_ID), job("bob~x", state="SUCCEEDED", waitingReason=None)]
    result = CliRunner().invoke(cli.app, ["job", "list"])
    assert result.exit_code == 0, result.output
    table = shown()
    assert max(map(len, table.splitlines())) <= 80  # nothing cropped: the other columns gave way
    assert LONG_ID in first_column(table) and "bob~x" in first_column(table)


def test_job_list_folds_an_id_wider_than_the_terminal_and_keeps_every_character(answers) -> None:
    answers["/api/v2/jobs"] = [job(HUGE_ID)]
    assert CliRunner().invoke(cli.app, ["job", "list"]).exit_code == 0
    assert "".join(first_column(shown())) == HUGE_ID


def test_node_list_keeps_long_names_whole(answers) -> None:
    name = "gpu-worker-rack-17-slot-4.cluster.example.internal"
    answers["/api/v2/nodes"] = [node(name), node("hostname-dan")]
    assert CliRunner().invoke(cli.app, ["node", "list"]).exit_code == 0
    assert name in first_column(shown())


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
    assert "Virtual clusters (leaf cells)" in table and "quota" in table and "reserved" in table
    assert {"default", "vc1"} <= set(first_column(table.split("Reservations")[0]))
    assert "bob~job-config-2" in table and "alice~job-config-1" in table and "hostname-dan/0" in table


def test_cluster_status_json(answers, status: dict) -> None:
    answers["/api/v2/cluster/status"] = status
    result = CliRunner().invoke(cli.app, ["cluster", "status", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == status and shown() == ""
