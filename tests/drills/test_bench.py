"""examples/stress/bench.py: the stress drill's micro-benchmark (its output is the drill's input).

The CPU benchmarks with a fake clock, the GPU benchmarks' code on fake PyTorch and CuPy devices
(tests/drills/fake_gpulibs.py), the simulated GPUs. On a real GPU: tests/drills/test_bench_gpu.py.
"""

from __future__ import annotations

import json

import pytest
from tests.drills.benchmod import bench
from tests.drills.fake_gpulibs import FakeCupy, FakeDevice, FakeTorch, importer
from tests.monitoring.fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound

from apiary.drills.diagnosis import load_rules
from apiary.drills.stress import parse_bench_output
from apiary.runtime import agent
from apiary.runtime.env import build_task_env


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
    out = bench.run(args, {bench.SLOWDOWN_ENV: "4"}, nvml=_NoNvml(), import_module=importer(),
                    clock=fc.clock, sleep=fc.sleep)
    assert out["ok"] and out["device"] == "cpu" and out["backend"] == "cpu" and out["simulatedSlowdown"] == 4.0
    assert set(out["metrics"]) == {"matmul_gflops", "mem_bandwidth_gbps"} and out["gpus"] == []
    assert "no GPU present" in out["note"] and "on the CPU with NumPy" in out["note"]
    assert "torch: ImportError" in out["note"] and "cupy: ImportError" in out["note"]  # which GPU library, why not
    assert "simulated slowdown x4" in out["note"] and out["nvml"]["available"] is False
    assert parse_bench_output("warming up\n" + json.dumps(out) + "\n") == json.loads(json.dumps(out))


def test_nvml_readings_come_alongside_as_metrics() -> None:
    args = bench.parse_args(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1"])
    fc = TickClock(work_s=0.01)
    out = bench.run(args, {}, nvml=FakeNvml([FakeGpu(), FakeGpu(minor=1)]), import_module=importer(),
                    clock=fc.clock, sleep=fc.sleep)
    assert out["nvml"]["available"] and len(out["nvml"]["gpus"]) == 2
    assert {"gpu0_temp_c", "gpu1_sm_clock_mhz", "gpu0_power_w"} <= set(out["metrics"])
    assert "2 GPU(s) seen by NVML" in out["note"]


def test_main_prints_one_json_line_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1", "--gpu-backend", "none"]) == 0
    doc = parse_bench_output(capsys.readouterr().out)
    assert doc is not None and doc["ok"] and doc["metrics"]["matmul_gflops"] > 0 and doc["backend"] == "cpu"


def test_main_prints_a_line_per_simulated_gpu(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in SIM_ENV.items():
        monkeypatch.setenv(var, value)
    assert bench.main(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1"]) == 0
    out = capsys.readouterr().out
    assert "gpu1 (simulated H200, simulated): d2h_gbps " in out and "gemm_bf16_tflops " in out
    doc = parse_bench_output(out)
    assert doc is not None and doc["backend"] == "simulated" and len(doc["gpus"]) == 3


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--trials", "0"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv", [["--trials", "0"], ["--gemm-n", "0"], ["--pcie-mib", "-1"],
                                  ["--gpu-backend", "opencl"]])
def test_bad_gpu_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
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


# ----------------------------------------------------------------------------- simulated GPUs

#: A task on simulated GPUs 0, 1 and 2 of a node whose GPU 1 has a ``degraded`` fault of 4, as the
#: node agent launches it (apiary.runtime.agent.node_task_env).
SIM_ENV = {"APIARY_SIMULATED_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0,1,2", "NVIDIA_VISIBLE_DEVICES": "0,1,2",
           bench.SLOWDOWN_ENV: "4", bench.SLOWDOWN_GPUS_ENV: "1:4"}
FIGURES = bench.SIMULATED_SKUS[bench.SIMULATED_SKU]


def sim_args(*extra: str):
    return bench.parse_args(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1", *extra])


def test_simulated_gpus_report_the_model_per_gpu_and_only_the_degraded_one_falls() -> None:
    fc = TickClock(work_s=0.01)
    out = bench.run(sim_args(), SIM_ENV, nvml=_NoNvml(), import_module=_no_gpu_library, clock=fc.clock,
                    sleep=fc.sleep)
    assert out["ok"] and out["backend"] == "simulated"
    assert [(g["index"], g["slowdown"]) for g in out["gpus"]] == [(0, 1.0), (1, 4.0), (2, 1.0)]
    m = out["metrics"]
    for gpu, factor in ((0, 1.0), (1, 4.0), (2, 1.0)):
        for figure, healthy in FIGURES.items():
            assert m[f"gpu{gpu}_{figure}"] == pytest.approx(healthy / factor, rel=bench.SIMULATED_JITTER), (gpu, figure)
    assert "gpu1 simulated slowdown x4" in out["note"] and "gpu0 simulated" not in out["note"]
    assert "no NVML readings" in out["note"]  # not "no GPU present": the GPUs are simulated


def test_the_simulated_jitter_is_small_seeded_and_not_the_same_for_every_gpu() -> None:
    a, b = bench.simulated_figures(0, seed="7"), bench.simulated_figures(1, seed="7")
    assert a == bench.simulated_figures(0, seed="7") and a != b and a != bench.simulated_figures(0, seed="8")
    assert all(abs(v / FIGURES[k] - 1) <= bench.SIMULATED_JITTER for k, v in {**a, **b}.items())
    assert bench.simulated_figures(0, 2.0, seed="7") == {k: v / 2.0 for k, v in a.items()}


def test_the_simulated_model_is_the_simulated_groups_reference_in_the_rules() -> None:
    assert load_rules().references["simulated"] == FIGURES


def test_the_benchmark_reads_the_variables_the_platform_sets() -> None:
    assert (bench.SLOWDOWN_ENV, bench.SLOWDOWN_GPUS_ENV) == (agent.SLOWDOWN_ENV, agent.SLOWDOWN_GPUS_ENV)
    env = build_task_env(job_id="a~j", user="a", job_name="j", task_roles={"t": 1}, host_ips={("t", 0): "10.0.0.1"},
                         ports=None, task_role="t", index=0, gpus=[1, 3], attempt=0, simulated_gpus=True)
    assert env[bench.SIMULATED_GPUS_ENV] == "1" and bench.visible_gpus(env) == [1, 3]


@pytest.mark.parametrize(("env", "gpus", "expected"), [
    pytest.param({}, [0, 1], {0: 1.0, 1: 1.0}, id="no fault"),
    pytest.param({bench.SLOWDOWN_GPUS_ENV: "1:2.5"}, [0, 1], {0: 1.0, 1: 2.5}, id="one degraded GPU"),
    pytest.param({bench.SLOWDOWN_GPUS_ENV: " 0:3 , 1:2"}, [0, 1], {0: 3.0, 1: 2.0}, id="two, with spaces"),
    pytest.param({bench.SLOWDOWN_GPUS_ENV: "1:0.5,x:3,2:fast,3"}, [1, 2, 3], {1: 1.0, 2: 1.0, 3: 1.0},
                 id="unreadable entries are ignored"),
    pytest.param({bench.SLOWDOWN_ENV: "3"}, [0, 1], {0: 3.0, 1: 3.0}, id="an older agent: the task factor for all"),
    pytest.param({bench.SLOWDOWN_ENV: "3", bench.SLOWDOWN_GPUS_ENV: "1:3"}, [0, 1], {0: 1.0, 1: 3.0},
                 id="the per-GPU factors win over the task's"),
])
def test_gpu_slowdowns(env: dict[str, str], gpus: list[int], expected: dict[int, float]) -> None:
    assert bench.gpu_slowdowns(env, gpus) == expected


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None), ({"CUDA_VISIBLE_DEVICES": ""}, []), ({"CUDA_VISIBLE_DEVICES": "1,3"}, [1, 3]),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5d1c,GPU-77aa"}, None),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "4,6"}, [4, 6]),  # a container renumbers from 0
    ({"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}, []),
    ({"CUDA_VISIBLE_DEVICES": "2", "NVIDIA_VISIBLE_DEVICES": "all"}, [2]),
])
def test_visible_gpus(env: dict[str, str], expected: list[int] | None) -> None:
    assert bench.visible_gpus(env) == expected


def test_simulated_gpus_without_visible_gpus_measure_the_cpu_only() -> None:
    out = bench.gpu_benchmarks(sim_args(), {"APIARY_SIMULATED_GPUS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.backend == "cpu" and out.metrics == {} and "none given to this task" in out.note


# ------------------------------------------------------------------ GPU libraries (fake devices)

def _no_gpu_library(name: str):
    raise AssertionError(f"simulated GPUs must not import {name}")


def test_gpu_best_rate_warms_up_calibrates_and_keeps_the_best_trial() -> None:
    calls, times = [], iter([0.005, 0.04, 0.03, 0.05])  # the calibration call, then three trials

    def timer(work, repeats: int) -> float:
        for _ in range(repeats):
            work()
        return next(times)

    rate = bench.gpu_best_rate(timer, lambda: calls.append(1), 2.0, trials=3, warmup=2, trial_s=0.02)
    # 2 warm-up calls + 1 calibration call; 0.005 s a call -> 4 repeats a trial; best: 8 units in 0.03 s
    assert len(calls) == 2 + 1 + 3 * 4 and rate == pytest.approx(8 / 0.03)


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_each_library_measures_every_gpu_in_the_units_of_the_doc(lib: str) -> None:
    devices = [FakeDevice(), FakeDevice(hbm_gbps=2000.0, h2d_gbps=25.0)]
    fake = FakeTorch(devices) if lib == "torch" else FakeCupy(devices)
    args = sim_args("--gemm-n", "4096", "--gpu-mem-mib", "64", "--pcie-mib", "16", "--trials", "3")
    out = bench.gpu_benchmarks(args, {"NVIDIA_VISIBLE_DEVICES": "2,5", "CUDA_VISIBLE_DEVICES": "0,1"},
                               importer(**{lib: fake}))
    half = "bf16" if lib == "torch" else "fp16"  # CuPy has no bfloat16
    assert out.backend == lib and [(g["index"], g["ordinal"], g["name"]) for g in out.gpus] == [
        (2, 0, "Fake H200"), (5, 1, "Fake H200")]
    assert out.metrics == pytest.approx({
        f"gpu2_gemm_{half}_tflops": 700.0, "gpu2_gemm_fp32_tflops": 50.0, "gpu2_hbm_bandwidth_gbps": 4000.0,
        "gpu2_h2d_gbps": 50.0, "gpu2_d2h_gbps": 40.0,
        f"gpu5_gemm_{half}_tflops": 700.0, "gpu5_gemm_fp32_tflops": 50.0, "gpu5_hbm_bandwidth_gbps": 2000.0,
        "gpu5_h2d_gbps": 25.0, "gpu5_d2h_gbps": 40.0})
    assert fake.used == [0, 1] and out.note == f"2 GPU(s) measured with {lib}"
    if lib == "torch":
        assert fake.precision == "highest"  # fp32 is not TF32


@pytest.mark.parametrize(("modules", "backend", "why"), [
    pytest.param({}, "cpu", "torch: ImportError", id="no library"),
    pytest.param({"torch": FakeTorch([])}, "cpu", "torch sees no CUDA device", id="CPU-only PyTorch"),
    pytest.param({"torch": FakeTorch([]), "cupy": FakeCupy([FakeDevice()])}, "cupy", "", id="CuPy after PyTorch"),
    pytest.param({"torch": FakeTorch([FakeDevice()]), "cupy": FakeCupy([FakeDevice()])}, "torch", "",
                 id="PyTorch first"),
    pytest.param({"cupy": FakeCupy([])}, "cpu", "cupy sees no CUDA device", id="CuPy without a device"),
])
def test_auto_picks_pytorch_then_cupy_else_the_cpu_and_says_why(modules: dict, backend: str, why: str) -> None:
    out = bench.gpu_benchmarks(sim_args("--gemm-n", "64", "--gpu-mem-mib", "1", "--pcie-mib", "1"), {},
                               importer(**modules))
    assert out.backend == backend and why in out.note


def test_a_library_asked_for_by_name_that_cannot_run_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="--gpu-backend cupy: cupy sees no CUDA device"):
        bench.gpu_benchmarks(sim_args("--gpu-backend", "cupy"), {}, importer(cupy=FakeCupy([])))


def test_a_gpu_that_fails_its_benchmark_makes_the_result_not_ok(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self, ordinal, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    real_run = bench.run
    monkeypatch.setattr(bench.TorchGpus, "measure", broken)
    monkeypatch.setattr(bench, "run", lambda args: real_run(args, {}, nvml=_NoNvml(),
                                                            import_module=importer(torch=FakeTorch([FakeDevice()]))))
    assert bench.main(["--matmul-n", "16", "--mem-mib", "1", "--trials", "1"]) == 1
    doc = parse_bench_output(capsys.readouterr().out)
    assert doc == {"apiary_bench": 1, "ok": False,
                   "error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
