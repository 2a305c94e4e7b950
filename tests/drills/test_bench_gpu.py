"""examples/stress/bench.py's PyTorch and CuPy paths on a real GPU (``make test-gpu``: ``-m gpu``).

Each test skips, saying why, where the library is not importable or sees no CUDA device (this
suite's .venv has neither: CUDA wheels are gigabytes; install one into the venv on a GPU machine).
The figures must be positive and plausible for a data-centre GPU of the last decade: bounds wide
enough for a T4 and a B200 alike, narrow enough to catch a wrong unit (a factor 1e3 or 1e9) or
time taken on the host instead of the device.
"""

from __future__ import annotations

import os

import pytest
from tests.drills.benchmod import bench

from apiary.drills.stress import parse_bench_output

pytestmark = pytest.mark.gpu

#: (low, high) of each figure: TFLOP/s or GB/s (module doc).
PLAUSIBLE = {
    "gemm_bf16_tflops": (5.0, 5000.0), "gemm_fp16_tflops": (5.0, 5000.0), "gemm_fp32_tflops": (1.0, 200.0),
    "hbm_bandwidth_gbps": (100.0, 20000.0), "h2d_gbps": (1.0, 300.0), "d2h_gbps": (1.0, 300.0),
}
#: Small enough for any GPU and a quick run; large enough to time (a 4096 GEMM is 137 GFLOP).
ARGS = ["--matmul-n", "16", "--mem-mib", "1", "--trials", "5", "--gemm-n", "4096", "--gpu-mem-mib", "512",
        "--pcie-mib", "128"]


def require(lib: str):
    """The imported library with a CUDA device, or skip saying what is missing."""
    mod = pytest.importorskip(lib, reason=f"{lib} is not installed in this environment")
    if lib == "torch" and not mod.cuda.is_available():
        pytest.skip(f"torch {mod.__version__} sees no CUDA device (CPU-only build, no driver, or no GPU)")
    if lib == "cupy":
        try:
            mod.cuda.runtime.getDeviceCount()
        except mod.cuda.runtime.CUDARuntimeError as e:
            pytest.skip(f"cupy sees no CUDA device: {e}")
    return mod


def real_gpu_env() -> dict[str, str]:
    """This process's environment without the simulated-GPU flag (a test run inside an Apiary task)."""
    return {k: v for k, v in os.environ.items() if k != bench.SIMULATED_GPUS_ENV}


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_every_visible_gpu_gets_positive_plausible_figures(lib: str) -> None:
    mod = require(lib)
    out = bench.gpu_benchmarks(bench.parse_args([*ARGS, "--gpu-backend", lib]), real_gpu_env())
    assert out.backend == lib and out.gpus, out.note
    half = "gemm_bf16_tflops" if lib == "torch" else "gemm_fp16_tflops"
    for g in out.gpus:
        figures = {k.split("_", 1)[1]: v for k, v in out.metrics.items() if k.startswith(f"gpu{g['index']}_")}
        assert set(figures) == {half, "gemm_fp32_tflops", "hbm_bandwidth_gbps", "h2d_gbps", "d2h_gbps"}
        for figure, value in figures.items():
            low, high = PLAUSIBLE[figure]
            assert low <= value <= high, f"gpu{g['index']} ({g['name']}) {figure}={value:.4g} outside [{low}, {high}]"
        # Tensor cores: the 16-bit GEMM outruns fp32 (without TF32): fp16 since Volta (7.0), bf16 since
        # Ampere (8.0); on an older GPU PyTorch may run bf16 without them.
        if lib == "cupy" or mod.cuda.get_device_capability(g["ordinal"]) >= (8, 0):
            assert figures[half] > figures["gemm_fp32_tflops"], (g, figures)


def test_the_benchmark_run_as_the_drill_runs_it_reports_the_gpus(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    torch = require("torch")
    monkeypatch.delenv(bench.SIMULATED_GPUS_ENV, raising=False)
    assert bench.main(ARGS) == 0
    doc = parse_bench_output(capsys.readouterr().out)
    assert doc is not None and doc["ok"] and doc["backend"] == "torch"
    assert len(doc["gpus"]) == torch.cuda.device_count()
    assert all(doc["metrics"][f"gpu{g['index']}_gemm_bf16_tflops"] > 0 for g in doc["gpus"])
