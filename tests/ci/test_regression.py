"""The regression stage judges the change against its base commit measured in the same run
(apiary.ci.paired, apiary.ci.stages.regression): a busy machine slows both and passes, a change
twice as slow fails whatever the load."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apiary.ci import paired, stages
from apiary.ci.config import CiConfig
from apiary.ci.pipeline import CiContext, Commit, StageFailed

#: The quick benchmark on a quiet machine (2026-11-26): 8,814 placements/s, p99 0.52 ms.
QUIET = {"placements_per_s": 8814.0, "p99_ms": 0.52}


def results(slowdown: float) -> dict[str, Any]:
    """A bench/run.py results document of a run ``slowdown`` times slower than :data:`QUIET`."""
    return {"scheduler": {"quick": True, "nodes_200": {"placements_per_s": QUIET["placements_per_s"] / slowdown,
                                                       "p99_ms": QUIET["p99_ms"] * slowdown}}}


def machine(loads: list[float]):
    """A fake benchmark per side on a machine whose load follows ``loads`` call after call (each
    call, base or change, takes the next): ``bench(code_slowdown)`` measures code that is
    ``code_slowdown`` times slower than the base."""
    load = itertools.cycle(loads)
    order: list[str] = []

    def bench(name: str, code_slowdown: float):
        def run() -> dict[str, Any]:
            order.append(name)
            return results(code_slowdown * next(load))
        return run

    return bench, order


def test_a_busy_machine_slows_both_sides_and_the_change_passes() -> None:
    # load 5-9 on 2 cores: every run 4-9x slower than on a quiet machine (p99 2-4.7 ms, the
    # absolute 2.0 ms target missed), but the change is the base's code
    bench, _ = machine([4.0, 9.0, 6.5, 8.8, 5.0, 7.2, 9.0, 4.4])
    base, change = paired.measure_interleaved(bench("base", 1.0), bench("change", 1.0))
    verdict = paired.judge(base, change)
    assert verdict.ok, verdict.summary()
    assert all(c.change > 2.0 for c in verdict.comparisons if c.metric.path.endswith("p99_ms"))
    assert [c.metric.path for c in verdict.comparisons] == [m.path for m in paired.METRICS]


def test_a_change_twice_as_slow_fails_on_a_quiet_machine_and_on_a_busy_one() -> None:
    for loads in ([1.0], [4.0, 9.0, 6.5, 8.8, 5.0, 7.2, 9.0, 4.4]):
        bench, _ = machine(loads)
        verdict = paired.judge(*paired.measure_interleaved(bench("base", 1.0), bench("change", 2.0)))
        assert not verdict.ok, loads
        assert {c.metric.path.split(".")[-1] for c in verdict.comparisons if not c.ok} == {"placements_per_s",
                                                                                           "p99_ms"}
        assert "worse" in verdict.summary() and "tolerance 1.5x" in verdict.summary()


def test_a_faster_change_passes_and_a_load_rising_during_the_stage_weighs_on_both_alike() -> None:
    bench, order = machine([1.0 + i for i in range(14)])  # the load climbs from 1 to 14 during the stage
    verdict = paired.judge(*paired.measure_interleaved(bench("base", 1.0), bench("change", 1.0)))
    assert verdict.ok, verdict.summary()
    assert order[:6] == ["base", "change", "change", "base", "base", "change"]  # ABBA
    bench, _ = machine([3.0])
    assert paired.judge(*paired.measure_interleaved(bench("base", 1.0), bench("change", 0.5))).ok


def test_metrics_missing_on_a_side_are_skipped_and_bad_arguments_refused() -> None:
    old_base = {"scheduler": {"nodes_200": {"placements_per_s": 8000.0}}}  # an older bench: no p99
    verdict = paired.judge([old_base], [results(1.0)])
    assert verdict.ok and verdict.skipped == ("scheduler.nodes_200.p99_ms",)
    assert paired.judge([{}], [{}]).comparisons == ()
    with pytest.raises(ValueError, match="tolerance"):
        paired.judge([], [], tolerance=0.5)
    with pytest.raises(ValueError, match="rounds"):
        paired.measure_interleaved(dict, dict, rounds=0)


# -- the stage, on a throwaway repository with a fake bench/run.py --------------------------------

FAKE_BENCH = '''\
import json, os, sys
from pathlib import Path
here = Path(__file__).parent
speed = float((here / "speed.txt").read_text())      # this checkout's code: times slower than the base
load = float(os.environ.get("FAKE_BENCH_LOAD", "1"))  # the machine
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.write_text(json.dumps({"scheduler": {"nodes_200": {
    "placements_per_s": 8814.0 / (speed * load), "p99_ms": 0.52 * speed * load}}}))
'''


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@x", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def checkout_with_change(tmp_path: Path, change_speed: str, with_base: bool = True) -> CiContext:
    """A workspace whose HEAD has ``bench/speed.txt`` = ``change_speed`` and whose first parent
    (the base) has 1."""
    ws = tmp_path / "work" / "ws"
    (ws / "bench").mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=ws)
    (ws / "bench" / "run.py").write_text(FAKE_BENCH)
    if with_base:
        (ws / "bench" / "speed.txt").write_text("1")
        git("add", "-A", cwd=ws)
        git("commit", "-q", "-m", "base", cwd=ws)
    (ws / "bench" / "speed.txt").write_text(change_speed)
    git("add", "-A", cwd=ws)
    git("commit", "-q", "--allow-empty", "-m", "change", cwd=ws)
    sha = git("rev-parse", "HEAD", cwd=ws)
    art = tmp_path / "art"
    art.mkdir()
    return CiContext(commit=Commit("acme/tiny", str(ws), sha, "main", kind="deploy"),
                     config=CiConfig(workdir=tmp_path / "work", artifacts=art, venv=Path(sys.prefix)),
                     workspace=ws, artifacts=art)


def test_the_stage_passes_an_unchanged_scheduler_on_a_busy_machine(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_BENCH_LOAD", "9")  # p99 4.7 ms each side: over the old 2.0 ms target
    c = checkout_with_change(tmp_path, "1")
    summary = stages.regression(c)
    assert summary.startswith("no regression against base"), summary
    got = json.loads((c.artifacts / "bench-paired.json").read_text())
    assert got["ok"] and got["change"] == c.commit.sha
    assert len(list(c.artifacts.glob("bench-base-*.json"))) == len(list(c.artifacts.glob("bench-change-*.json")))
    assert not (tmp_path / "work" / "ws-base").exists()  # the base's worktree is removed


def test_the_stage_fails_a_change_twice_as_slow_naming_the_metrics(tmp_path: Path) -> None:
    c = checkout_with_change(tmp_path, "2")
    with pytest.raises(StageFailed) as exc:
        stages.regression(c)
    assert exc.value.summary.startswith("benchmark regression against base")
    assert "p99_ms" in exc.value.summary and "2.00x worse" in exc.value.summary


def test_the_stage_passes_saying_so_when_there_is_no_base(tmp_path: Path) -> None:
    c = checkout_with_change(tmp_path, "5", with_base=False)
    assert stages.regression(c) == "no base commit to compare with: the benchmark was not judged"
