"""Plots and the Prefect artifacts of a load result, from recorded Locust output (no Locust, no
Prefect server: the artifact functions are replaced by recorders)."""

from __future__ import annotations

import base64
from pathlib import Path

import prefect.artifacts
import pytest

from apiary.load.gates import JobCheck, evaluate, failures_from_csv, load_gates, stats_from_json
from apiary.load.plots import render
from apiary.load.report import artifact_key, markdown, publish_artifacts, table_rows
from apiary.load.runner import LoadResult, default_gates

DATA = Path(__file__).resolve().parents[1] / "data" / "load"
PNG = b"\x89PNG\r\n\x1a\n"


def result_from(run: Path, tmp_path: Path, jobs: JobCheck, plots: list[Path] | None = None) -> LoadResult:
    gates = default_gates("smoke")
    endpoints = stats_from_json(run / "stats.json")
    return LoadResult(
        profile="smoke", target="http://127.0.0.1:1", users=5, duration_s=30.0, agents=2, virtual_cluster="default",
        gates_file=gates, rows=evaluate(load_gates(gates), endpoints, jobs), endpoints=endpoints, jobs=jobs,
        locust_exit_code=0, timed_out=False, out_dir=tmp_path, stats_json=run / "stats.json",
        stats_csv=run / "locust_stats.csv", history_csv=run / "locust_stats_history.csv",
        locust_log=tmp_path / "locust.log", plots=plots or [], failures=failures_from_csv(run / "locust_failures.csv"),
    )


def test_plots_from_the_recorded_history(tmp_path: Path) -> None:
    paths = render(DATA / "smoke-pass" / "locust_stats_history.csv", tmp_path, title="(smoke)")
    assert [p.name for p in paths] == ["latency.png", "throughput.png"]
    for p in paths:
        assert p.read_bytes().startswith(PNG) and p.stat().st_size > 10_000


def test_no_history_no_plots(tmp_path: Path) -> None:
    empty = tmp_path / "h.csv"
    empty.write_text((DATA / "smoke-pass" / "locust_stats_history.csv").read_text().splitlines()[0] + "\n")
    assert render(empty, tmp_path) == []


@pytest.mark.parametrize(("text", "key"), [("load-smoke", "load-smoke"), ("Drill: Kill Agent!", "drill-kill-agent"),
                                           ("__", "load")])
def test_artifact_key(text: str, key: str) -> None:
    assert artifact_key(text) == key


def test_markdown_embeds_the_plots_and_names_failures(tmp_path: Path) -> None:
    plots = render(DATA / "smoke-pass" / "locust_stats_history.csv", tmp_path)
    res = result_from(DATA / "smoke-429", tmp_path, JobCheck(7, 7), plots)
    md = markdown(res)
    assert md.startswith("# Load test `smoke`: FAIL")
    assert "Jobs: 7 accepted (202), 7 listed afterwards, 0 lost." in md
    assert "POST /api/v2/jobs failure_ratio" in md and "429" in md
    embedded = md.split("(data:image/png;base64,")[1].split(")")[0]
    assert base64.b64decode(embedded) == plots[0].read_bytes()
    assert "data:image" not in markdown(res, embed_plots=False)


def test_publish_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, dict]] = []
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", lambda **kw: made.append(("table", kw)) or "t1")
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact",
                        lambda **kw: made.append(("markdown", kw)) or "m1")
    res = result_from(DATA / "smoke-pass", tmp_path, JobCheck(8, 8))
    assert res.passed
    assert publish_artifacts(res, key="Drill kill-agent") == {"gates": "t1", "report": "m1"}
    (kind1, table), (kind2, md) = made
    assert (kind1, table["key"], kind2, md["key"]) == ("table", "drill-kill-agent-gates", "markdown",
                                                        "drill-kill-agent-report")
    assert table["table"] == table_rows(res) and table["description"].startswith("Load gates smoke: PASS")
    assert {"endpoint", "metric", "measured", "threshold", "result", "note"} == set(table["table"][0])
    assert md["markdown"].startswith("# Load test `smoke`: PASS")
