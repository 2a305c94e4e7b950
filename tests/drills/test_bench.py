"""examples/stress/bench.py: the stress drill's micro-benchmark (its output is the drill's input)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tests.monitoring.fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound

from apiary.drills.stress import parse_bench_output

BENCH = Path(__file__).resolve().parents[2] / "examples" / "stress" / "bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("apiary_stress_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load()


class FakeClock:
    """Each unit of work takes ``work_s``; ``sleep`` advances the clock (no real time passes)."""

    def __init__(self, work_s: float) -> None:
        self.now, self.work_s, self.slept = 0.0, work_s, 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s

    def work(self) -> None:
        self.now += self.work_s


class TickClock(FakeClock):
    """For real work (NumPy): every reading of the clock is ``work_s`` later than the last."""

    def clock(self) -> float:
        self.now += self.work_s
        return self.now


@pytest.mark.parametrize(("raw", "factor", "note"), [
    (None, 1.0, ""), ("1", 1.0, ""), ("3", 3.0, "simulated slowdown x3 applied"),
    ("2.5", 2.5, "simulated slowdown x2.5 applied"), ("0.5", 1.0, "ignored"), ("-2", 1.0, "ignored"),
    ("nan", 1.0, "ignored"), ("fast", 1.0, "is not a number: ignored"),
])
def test_slowdown_factor(raw: str | None, factor: float, note: str) -> None:
    env = {} if raw is None else {bench.SLOWDOWN_ENV: raw}
    got, said = bench.slowdown_factor(env)
    assert got == factor and note in said and bool(said) == bool(note)


@pytest.mark.parametrize("factor", [1.0, 3.0, 10.0])
def test_a_slowdown_divides_the_measured_rate_by_its_factor(factor: float) -> None:
    fc = FakeClock(work_s=0.01)
    rate = bench.best_rate(fc.work, 2.0, trials=3, factor=factor, clock=fc.clock, sleep=fc.sleep, trial_s=0.05)
    # 5 repeats of 0.01 s per trial: 10 units / 0.05 s = 200 per second, stretched by the factor.
    assert rate == pytest.approx(200.0 / factor)
    assert fc.slept == pytest.approx(3 * 0.05 * (factor - 1))


def test_the_result_line_without_nvml_says_it_measured_on_the_cpu() -> None:
    args = bench.parse_args(["--matmul-n", "32", "--mem-mib", "1", "--trials", "1"])
    fc = TickClock(work_s=0.01)
    out = bench.run(args, {bench.SLOWDOWN_ENV: "4"}, nvml=_NoNvml(), clock=fc.clock, sleep=fc.sleep)
    assert out["ok"] and out["device"] == "cpu" and out["simulatedSlowdown"] == 4.0
    assert set(out["metrics"]) == {"matmul_gflops", "mem_bandwidth_gbps"}
    assert "no GPU present" in out["note"] and "on the CPU with NumPy" in out["note"]
    assert "simulated slowdown x4" in out["note"] and out["nvml"]["available"] is False
    assert parse_bench_output("warming up\n" + json.dumps(out) + "\n") == json.loads(json.dumps(out))


def test_nvml_readings_come_alongside_as_metrics() -> None:
    args = bench.parse_args(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1"])
    fc = TickClock(work_s=0.01)
    out = bench.run(args, {}, nvml=FakeNvml([FakeGpu(), FakeGpu(minor=1)]), clock=fc.clock, sleep=fc.sleep)
    assert out["nvml"]["available"] and len(out["nvml"]["gpus"]) == 2
    assert {"gpu0_temp_c", "gpu1_sm_clock_mhz", "gpu0_power_w"} <= set(out["metrics"])
    assert "2 GPU(s) seen by NVML" in out["note"]


def test_main_prints_one_json_line_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1"]) == 0
    doc = parse_bench_output(capsys.readouterr().out)
    assert doc is not None and doc["ok"] and doc["metrics"]["matmul_gflops"] > 0


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--trials", "0"])
    assert e.value.code == 2


@pytest.mark.parametrize(("text", "ok"), [
    ("", None), ("not json\n{broken", None), ('{"other": 1}', None), ('{"apiary_bench": 1, "ok": false}', False),
])
def test_parse_bench_output(text: str, ok: bool | None) -> None:
    doc = parse_bench_output(text)
    assert (doc["ok"] if doc else None) == ok


class _NoNvml:
    def nvmlInit(self) -> None:
        raise NVMLError_LibraryNotFound()
