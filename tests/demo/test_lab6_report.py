"""``apiary demo lab6`` prints each scenario's result once: a table on a terminal, plain lines in a
log or a pipe, and a count of passed scenarios."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from apiary.demo.lab6 import SCENARIO_COUNT, Outcome, report

RESULTS = [
    Outcome("1 VC safety", True, "ran one at a time on hostname-dan"),
    Outcome("2 priority and preemption", False, "timed out after 180 s waiting for job-config-1 preempted"),
]


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log"])
def test_each_result_is_printed_once(terminal: bool) -> None:
    console = Console(file=io.StringIO(), force_terminal=terminal, width=200, color_system=None)
    report(console, RESULTS)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    for r in RESULTS:
        assert out.count(r.scenario) == 1, out
        assert out.count(r.observed) == 1, out
    assert out.count("PASS") == 1 and out.count("FAIL") == 1
    assert f"1 of {SCENARIO_COUNT} scenarios passed." in out


def test_log_lines_are_whole_and_greppable() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=40)
    report(console, RESULTS)
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[:2] == [f"PASS {RESULTS[0].scenario}: {RESULTS[0].observed}",
                         f"FAIL {RESULTS[1].scenario}: {RESULTS[1].observed}"]


def test_run_demo_says_the_prefect_ui_ends_with_it_and_reports_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from apiary.demo import lab6

    class FakePrefect:
        ui_url, api_url = "http://127.0.0.1:4999", "http://127.0.0.1:4999/api"

        def stop(self) -> None:
            pass

    class FakePlatform:
        api_url = "http://127.0.0.1:8999"
        registry = None  # the process runtime: no registry

        def __init__(self, **kw: object) -> None:
            pass

        def client(self) -> None:
            return None

        def __enter__(self) -> FakePlatform:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(lab6, "start_prefect_server", lambda home: FakePrefect())
    monkeypatch.setattr(lab6, "Embedded", FakePlatform)
    monkeypatch.setattr(lab6, "run_scenarios", lambda admin, scenarios, sleep_s: [
        Outcome(name, True, f"observed {name}") for name, _ in scenarios])
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    assert lab6.run_demo(console, prefect=True) is True
    out = " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]
    assert "Prefect UI: http://127.0.0.1:4999" in out
    assert "It stops when the demo ends; for a UI that stays, run a platform with apiary up." in out
    for name, _ in lab6.SCENARIOS_TWO_VCS + lab6.SCENARIOS_ONE_VC:
        assert out.count(f"observed {name}") == 1
    assert f"{SCENARIO_COUNT} of {SCENARIO_COUNT} scenarios passed." in out
