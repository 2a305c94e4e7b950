"""Hardware-validation micro-benchmarks for Apiary's stress drill (platform/apiary/drills/stress.py).

Usage (from the repository root, as the drill's job runs it)::

    python3 examples/stress/bench.py [--matmul-n 256] [--mem-mib 32] [--trials 20]
        [--gpu-backend auto|torch|cupy|simulated|none] [--gemm-n 8192] [--gpu-mem-mib 1024]
        [--pcie-mib 256] [--seed 0]

On the CPU, with NumPy (always):

* ``matmul_gflops``: float64 matrix multiplication throughput (2 n^3 FLOP per product);
* ``mem_bandwidth_gbps``: memory bandwidth of an array copy (bytes read + written per second);

each the best of ``--trials`` timed trials (the best trial is the least disturbed by other work
on the machine), on one BLAS thread.

On each GPU the task sees (``backend``), when a GPU library is importable in the job's image
(PyTorch, else CuPy) and sees a CUDA device, flattened into the metrics as ``gpu<i>_<figure>``:

* ``gemm_bf16_tflops`` / ``gemm_fp32_tflops``: dense ``--gemm-n`` square matrix products, TFLOP/s
  (2 n^3 FLOP each; fp32 without TF32). CuPy has no bfloat16: it reports ``gemm_fp16_tflops``
  instead (NVIDIA's datasheets give FP16 and BF16 tensor throughput as one figure);
* ``hbm_bandwidth_gbps``: a ``--gpu-mem-mib`` device-to-device copy, GB/s counting the bytes read
  and the bytes written (comparable with the datasheet's memory bandwidth);
* ``h2d_gbps`` / ``d2h_gbps``: ``--pcie-mib`` copies between pinned host memory and the device,
  GB/s of bytes moved (one direction each);

each the best of ``--trials`` trials after ``GPU_WARMUP`` warm-up runs, timed by the library's
own CUDA events (``torch.cuda.Event`` / ``cupy.cuda.Event``) and synchronised on the end event.
``<i>`` is the node's GPU index (from ``NVIDIA_VISIBLE_DEVICES`` or ``CUDA_VISIBLE_DEVICES``, else
the CUDA ordinal: :func:`visible_gpus`), as in the fault API and the NVML readings. The GPU
libraries are imported only for this, lazily: without them the script needs the standard library
and NumPy only, and says which backend ran (``backend``: ``torch``, ``cupy``, ``simulated``, or
``cpu`` when no GPU figures were measured, with the reason in ``note``).

Simulated GPUs (``APIARY_SIMULATED_GPUS=1``, set by the platform for tasks on nodes whose GPUs
are simulated, and ``CUDA_VISIBLE_DEVICES`` listing them): no kernel runs; each GPU reports the
figures of the :data:`SIMULATED_SKUS` model with a small jitter seeded by (``--seed``, GPU,
figure), divided by that GPU's slowdown factor (``APIARY_SIMULATED_SLOWDOWN_GPUS``, ``"<gpu>:<factor>,
..."``, set by the node agent for GPUs with an injected ``degraded`` fault). So a degraded GPU's
figures fall and its healthy neighbours' do not.

Simulated slowdown of the CPU figures: when ``APIARY_SIMULATED_SLOWDOWN`` is a factor F > 1 (the
node agent sets it for tasks on a GPU with an injected ``degraded`` fault: the largest factor of
the task's GPUs), every CPU trial is stretched to F times its duration by sleeping, so the CPU
throughputs are divided by F. These are simulations, for testing the drill's diagnosis on
simulated clusters; the output names the factors.

Output: the last line of stdout is one JSON object, ``{"apiary_bench": 1, "ok": true, "backend":
..., "metrics": {...}, "gpus": [{"index", "ordinal", "name", "slowdown"}], ...}`` (``device`` is
where the CPU figures ran: always ``cpu``); on an error ``{"apiary_bench": 1, "ok": false, "error":
"..."}`` and exit code 1. A GPU that cannot run its benchmark is such an error: the node fails.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import math
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SLOWDOWN_ENV = "APIARY_SIMULATED_SLOWDOWN"
#: ``"<gpu>:<factor>,..."``: the slowdown factor of each degraded GPU of the task (node indices).
SLOWDOWN_GPUS_ENV = "APIARY_SIMULATED_SLOWDOWN_GPUS"
#: ``1`` when the node's GPUs are simulated (apiary.runtime.env.build_task_env).
SIMULATED_GPUS_ENV = "APIARY_SIMULATED_GPUS"
#: The minimum duration of one trial; the work is repeated until a trial lasts this long. Short:
#: on a busy machine a short trial is more likely to run without losing the CPU to another process.
TRIAL_S = 0.01
#: The same for a GPU trial: long enough that a kernel launch's few microseconds do not count.
GPU_TRIAL_S = 0.02
#: Untimed runs before a GPU benchmark is timed: the first calls pay for cuBLAS's algorithm
#: choice, lazy module loading and the allocator's first allocation.
GPU_WARMUP = 2
GPU_BACKENDS = ("auto", "torch", "cupy", "simulated", "none")
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: The simulated GPU: a CLEARLY LABELLED MODEL, not a measurement. Each figure is a peak from
#: NVIDIA's H200 Tensor Core GPU datasheet (H200 SXM, 2024) times an assumed efficiency (the
#: fraction of peak a healthy GPU reaches in these benchmarks; an assumption of this model):
#:
#: * gemm_bf16_tflops: BF16 tensor 1,979 TFLOPS "with sparsity", so 989.5 dense, x 0.75;
#: * gemm_fp32_tflops: FP32 67 TFLOPS, x 0.75 (rounded);
#: * hbm_bandwidth_gbps: HBM3e 4.8 TB/s, x 0.85;
#: * h2d_gbps / d2h_gbps: PCIe Gen5 128 GB/s for both directions, 64 GB/s each way, x 0.85.
#:
#: The stress drill's rules (platform/apiary/drills/rules.yaml, ``references.simulated``) use the
#: same figures as the simulated group's reference; a test keeps the two equal.
SIMULATED_SKUS: dict[str, dict[str, float]] = {
    "H200": {"gemm_bf16_tflops": 742.0, "gemm_fp32_tflops": 50.0, "hbm_bandwidth_gbps": 4080.0,
             "h2d_gbps": 54.4, "d2h_gbps": 54.4},
}
SIMULATED_SKU = "H200"
#: The simulated figures vary by up to +-2 % (uniform, seeded): measured figures are never equal,
#: and the drill's variance rules must not fire on such noise.
SIMULATED_JITTER = 0.02

Clock = Callable[[], float]
Sleep = Callable[[float], None]
#: ``timer(work, repeats)``: seconds that ``repeats`` calls of ``work`` took on the device.
Timer = Callable[[Callable[[], Any], int], float]
Environ = Mapping[str, str]


def slowdown_factor(environ: Environ) -> tuple[float, str]:
    """(factor, note): ``APIARY_SIMULATED_SLOWDOWN`` as a factor >= 1; 1.0 when unset or unreadable."""
    raw = environ.get(SLOWDOWN_ENV)
    if raw is None:
        return 1.0, ""
    factor = _factor(raw)
    if factor is None:
        why = "is not a factor >= 1" if _is_number(raw) else "is not a number"
        return 1.0, f"{SLOWDOWN_ENV}={raw!r} {why}: ignored"
    if factor == 1.0:
        return 1.0, ""
    return factor, f"simulated slowdown x{factor:g} applied ({SLOWDOWN_ENV})"


def _is_number(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _factor(raw: str) -> float | None:
    """``raw`` as a finite factor >= 1, else None."""
    try:
        factor = float(raw)
    except ValueError:
        return None
    return factor if math.isfinite(factor) and factor >= 1.0 else None


def gpu_slowdowns(environ: Environ, gpus: list[int]) -> dict[int, float]:
    """The simulated slowdown factor (>= 1) of each of ``gpus``, from ``APIARY_SIMULATED_SLOWDOWN_GPUS``
    (``"1:2.5,3:4"``; a GPU not listed: 1.0; an unreadable entry is ignored). Without that variable
    (an agent older than it), every GPU gets the task's ``APIARY_SIMULATED_SLOWDOWN``."""
    raw = environ.get(SLOWDOWN_GPUS_ENV)
    if raw is None:
        task_factor, _ = slowdown_factor(environ)
        return {g: task_factor for g in gpus}
    given: dict[int, float] = {}
    for entry in raw.split(","):
        gpu, _, value = entry.strip().partition(":")
        factor = _factor(value)
        if gpu.strip().isdigit() and factor is not None:
            given[int(gpu)] = factor
    return {g: given.get(g, 1.0) for g in gpus}


def visible_gpus(environ: Environ) -> list[int] | None:
    """The node GPU indices of the task's GPUs, in CUDA ordinal order: ``NVIDIA_VISIBLE_DEVICES``
    (Apiary's backends set it to the node indices, also where a container renumbers its GPUs from
    0), else ``CUDA_VISIBLE_DEVICES``; ``[]`` when the variable hides all GPUs (``""``, ``void``);
    None when neither lists integers (unset, ``all``, UUIDs): then the CUDA ordinals name them."""
    for var in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        raw = environ.get(var)
        if raw is None:
            continue
        entries = [e.strip() for e in raw.split(",") if e.strip() and e.strip() not in ("void", "none")]
        if all(e.isdigit() for e in entries):
            return [int(e) for e in entries]
    return None


def best_rate(work: Callable[[], None], units: float, *, trials: int, factor: float = 1.0,
              clock: Clock = time.perf_counter, sleep: Sleep = time.sleep, trial_s: float = TRIAL_S) -> float:
    """The best of ``trials`` rates ``units * repeats / duration`` of ``work``: each trial repeats
    ``work`` until it lasts ``trial_s`` (calibrated on the first call) and, with a slowdown
    ``factor`` > 1, sleeps ``(factor - 1)`` times its duration before it is timed as over."""
    t0 = clock()
    work()
    first = max(clock() - t0, 1e-9)
    repeats = max(1, math.ceil(trial_s / first))
    best = 0.0
    for _ in range(trials):
        t0 = clock()
        for _ in range(repeats):
            work()
        elapsed = clock() - t0
        if factor > 1.0:
            sleep(elapsed * (factor - 1.0))
        elapsed = max(clock() - t0, 1e-9)
        best = max(best, units * repeats / elapsed)
    return best


def matmul_gflops(n: int, trials: int, factor: float = 1.0, **timing: Any) -> float:
    """float64 ``n x n`` matrix product throughput, GFLOP/s (2 n^3 FLOP per product)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    out = np.empty((n, n))
    return best_rate(lambda: np.matmul(a, b, out=out), 2.0 * n**3 / 1e9, trials=trials, factor=factor, **timing)


def mem_bandwidth_gbps(mib: int, trials: int, factor: float = 1.0, **timing: Any) -> float:
    """Copy bandwidth of a ``mib`` MiB array, GB/s counting the bytes read and the bytes written."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    return best_rate(lambda: np.copyto(dst, src), 2.0 * src.nbytes / 1e9, trials=trials, factor=factor, **timing)


def gpu_best_rate(timer: Timer, work: Callable[[], Any], units: float, *, trials: int, warmup: int = GPU_WARMUP,
                  trial_s: float = GPU_TRIAL_S) -> float:
    """The best of ``trials`` rates ``units * repeats / seconds`` of ``work`` on a GPU, after
    ``warmup`` untimed calls; ``repeats`` makes a trial last at least ``trial_s`` (calibrated on
    one timed call). ``timer`` times on the device (CUDA events), so the host's launch latency and
    clock do not count."""
    for _ in range(warmup):
        work()
    first = max(timer(work, 1), 1e-9)
    repeats = max(1, math.ceil(trial_s / first))
    best = 0.0
    for _ in range(trials):
        best = max(best, units * repeats / max(timer(work, repeats), 1e-9))
    return best


class TorchGpus:
    """The CUDA devices PyTorch sees. ``torch``: the imported module."""

    backend = "torch"

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def count(self) -> int:
        return int(self.torch.cuda.device_count()) if self.torch.cuda.is_available() else 0

    def name(self, ordinal: int) -> str:
        return str(self.torch.cuda.get_device_name(ordinal))

    def timer(self, work: Callable[[], Any], repeats: int) -> float:
        """Seconds on the current device's current stream, between two CUDA events."""
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            work()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3  # elapsed_time is in milliseconds

    def measure(self, ordinal: int, args: argparse.Namespace) -> dict[str, float]:
        """The GPU figures of device ``ordinal`` (see the module doc); raises on a CUDA error."""
        torch = self.torch
        # FP32 means FP32: PyTorch may run float32 matmuls as TF32 (an env var or a library default
        # can turn it on), which would report tensor-core throughput as fp32.
        torch.set_float32_matmul_precision("highest")
        with torch.cuda.device(ordinal):
            dev = torch.device("cuda", ordinal)
            out = {"gemm_bf16_tflops": self._gemm(dev, torch.bfloat16, args),
                   "gemm_fp32_tflops": self._gemm(dev, torch.float32, args)}
            out.update(self._copies(dev, args))
            torch.cuda.empty_cache()  # this GPU's buffers (freed on return) back to the driver
        return out

    def _copies(self, dev: Any, args: argparse.Namespace) -> dict[str, float]:
        torch = self.torch
        nbytes = args.gpu_mem_mib * 2**20
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        out = {"hbm_bandwidth_gbps": gpu_best_rate(self.timer, lambda: dst.copy_(src), 2.0 * nbytes / 1e9,
                                                   trials=args.trials)}
        nbytes = args.pcie_mib * 2**20
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # pinned: DMA at the link's rate
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        out["h2d_gbps"] = gpu_best_rate(self.timer, lambda: buf.copy_(host, non_blocking=True), nbytes / 1e9,
                                        trials=args.trials)
        out["d2h_gbps"] = gpu_best_rate(self.timer, lambda: host.copy_(buf, non_blocking=True), nbytes / 1e9,
                                        trials=args.trials)
        return out

    def _gemm(self, dev: Any, dtype: Any, args: argparse.Namespace) -> float:
        n = args.gemm_n
        a = self.torch.randn(n, n, device=dev, dtype=dtype)
        b = self.torch.randn(n, n, device=dev, dtype=dtype)
        c = self.torch.empty_like(a)
        return gpu_best_rate(self.timer, lambda: self.torch.matmul(a, b, out=c), 2.0 * n**3 / 1e12,
                             trials=args.trials)


class CupyGpus:
    """The CUDA devices CuPy sees. ``cupy``: the imported module."""

    backend = "cupy"

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy

    def count(self) -> int:
        try:
            return int(self.cp.cuda.runtime.getDeviceCount())
        except self.cp.cuda.runtime.CUDARuntimeError:  # no driver, or no device: CuPy raises
            return 0

    def name(self, ordinal: int) -> str:
        name = self.cp.cuda.runtime.getDeviceProperties(ordinal)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def timer(self, work: Callable[[], Any], repeats: int) -> float:
        """Seconds on the current device's current stream, between two CUDA events."""
        stream = self.cp.cuda.get_current_stream()
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record(stream)
        for _ in range(repeats):
            work()
        end.record(stream)
        end.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, end)) / 1e3  # milliseconds

    def measure(self, ordinal: int, args: argparse.Namespace) -> dict[str, float]:
        """The GPU figures of device ``ordinal`` (see the module doc: fp16, not bf16); raises on a
        CUDA error."""
        cp = self.cp
        with cp.cuda.Device(ordinal):
            stream = cp.cuda.get_current_stream()
            out = {"gemm_fp16_tflops": self._gemm(cp.float16, args), "gemm_fp32_tflops": self._gemm(cp.float32, args)}
            out.update(self._copies(stream, args))
            cp.get_default_memory_pool().free_all_blocks()  # this GPU's buffers (freed on return) back
        return out

    def _copies(self, stream: Any, args: argparse.Namespace) -> dict[str, float]:
        cp = self.cp
        nbytes = args.gpu_mem_mib * 2**20
        src = cp.empty(nbytes, dtype=cp.uint8)
        dst = cp.empty_like(src)
        out = {"hbm_bandwidth_gbps": gpu_best_rate(
            self.timer, lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), 2.0 * nbytes / 1e9,
            trials=args.trials)}
        nbytes = args.pcie_mib * 2**20
        pinned = cp.cuda.alloc_pinned_memory(nbytes)  # pinned: DMA at the link's rate
        host = ctypes.c_void_p(pinned.ptr)
        buf = cp.empty(nbytes, dtype=cp.uint8)
        out["h2d_gbps"] = gpu_best_rate(self.timer, lambda: buf.data.copy_from_host_async(host, nbytes, stream),
                                        nbytes / 1e9, trials=args.trials)
        out["d2h_gbps"] = gpu_best_rate(self.timer, lambda: buf.data.copy_to_host_async(host, nbytes, stream),
                                        nbytes / 1e9, trials=args.trials)
        return out

    def _gemm(self, dtype: Any, args: argparse.Namespace) -> float:
        cp, n = self.cp, args.gemm_n
        a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(dtype)
        b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(dtype)
        c = cp.empty_like(a)
        return gpu_best_rate(self.timer, lambda: cp.matmul(a, b, out=c), 2.0 * n**3 / 1e12, trials=args.trials)


_LIBRARIES: tuple[tuple[str, type[TorchGpus] | type[CupyGpus]], ...] = (("torch", TorchGpus), ("cupy", CupyGpus))


def gpu_library(choice: str, import_module: Callable[[str], Any] | None = None
                ) -> tuple[TorchGpus | CupyGpus | None, str]:
    """(library, "") for the first of PyTorch, CuPy (or only ``choice``) that imports and sees a
    CUDA device; (None, why) when none does. ``auto`` falls back to the CPU and says why; a library
    named by ``choice`` that cannot run raises RuntimeError (asked for, so a failure is the node's)."""
    import_module = import_module or importlib.import_module
    why: list[str] = []
    for name, cls in _LIBRARIES:
        if choice not in ("auto", name):
            continue
        try:
            lib = cls(import_module(name))
            count = lib.count()
        except Exception as e:  # ImportError, or a CUDA library that fails to load (OSError): say which
            why.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if count > 0:
            return lib, ""
        why.append(f"{name} sees no CUDA device")
    if choice != "auto":
        raise RuntimeError(f"--gpu-backend {choice}: " + "; ".join(why))
    return None, "; ".join(why)


@dataclass
class GpuBench:
    """What the GPU part of the benchmark measured: ``backend`` (``torch``, ``cupy``, ``simulated``,
    or ``cpu`` for none), one entry per GPU, the flattened ``gpu<i>_<figure>`` metrics, a note."""

    backend: str
    gpus: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    note: str = ""


def simulated_figures(index: int, factor: float = 1.0, *, seed: str = "0", sku: str = SIMULATED_SKU
                      ) -> dict[str, float]:
    """The figures of simulated GPU ``index``: the :data:`SIMULATED_SKUS` model with a jitter of up to
    +-``SIMULATED_JITTER`` seeded by (``seed``, ``index``, figure), divided by ``factor``."""
    out = {}
    for figure, healthy in SIMULATED_SKUS[sku].items():
        u = random.Random(f"{seed}:{index}:{figure}").random()  # a str seed is stable across processes
        out[figure] = healthy * (1.0 + SIMULATED_JITTER * (2.0 * u - 1.0)) / factor
    return out


def simulated_benchmarks(environ: Environ, seed: str) -> GpuBench:
    """The simulated GPUs' figures: one set per GPU the task was given (:func:`visible_gpus`)."""
    gpus = visible_gpus(environ) or []
    if not gpus:
        return GpuBench("cpu", note="simulated GPUs, but none given to this task (CUDA_VISIBLE_DEVICES)")
    bench = GpuBench("simulated")
    for ordinal, (index, factor) in enumerate(gpu_slowdowns(environ, gpus).items()):
        bench.gpus.append({"index": index, "ordinal": ordinal, "name": f"simulated {SIMULATED_SKU}",
                           "slowdown": factor})
        bench.metrics.update({f"gpu{index}_{k}": v for k, v in simulated_figures(index, factor, seed=seed).items()})
    slowed = {g["index"]: g["slowdown"] for g in bench.gpus if g["slowdown"] != 1.0}
    bench.note = (f"{len(gpus)} simulated {SIMULATED_SKU} GPU(s): modelled figures, no kernel ran"
                  + "".join(f"; gpu{i} simulated slowdown x{f:g}" for i, f in sorted(slowed.items())))
    return bench


def gpu_benchmarks(args: argparse.Namespace, environ: Environ,
                   import_module: Callable[[str], Any] | None = None) -> GpuBench:
    """The GPU figures of every GPU the task sees (module doc); raises on a GPU that fails them."""
    if args.gpu_backend == "simulated" or (args.gpu_backend == "auto" and environ.get(SIMULATED_GPUS_ENV) == "1"):
        return simulated_benchmarks(environ, args.seed)
    if args.gpu_backend == "none":
        return GpuBench("cpu", note="GPU benchmarks off (--gpu-backend none)")
    lib, why = gpu_library(args.gpu_backend, import_module)
    if lib is None:
        return GpuBench("cpu", note=f"no GPU benchmark: {why or 'no GPU library'}")
    visible = visible_gpus(environ)
    bench = GpuBench(lib.backend)
    for ordinal in range(lib.count()):
        index = visible[ordinal] if visible is not None and ordinal < len(visible) else ordinal
        figures = lib.measure(ordinal, args)
        bench.gpus.append({"index": index, "ordinal": ordinal, "name": lib.name(ordinal), "slowdown": 1.0})
        bench.metrics.update({f"gpu{index}_{k}": v for k, v in figures.items()})
    bench.note = f"{len(bench.gpus)} GPU(s) measured with {lib.backend}"
    return bench


def nvml_readings(nvml: Any = None) -> dict[str, Any]:
    """``{"available": True, "driver": ..., "gpus": [{...}]}`` from NVML, or ``{"available": False,
    "reason": ...}`` (no pynvml, no driver). ``nvml`` replaces the ``pynvml`` module (tests)."""
    try:
        if nvml is None:
            import pynvml as nvml  # type: ignore[import-not-found,no-redef]
        nvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            name = nvml.nvmlDeviceGetName(h)
            gpus.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "temp_c": float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                "power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "sm_clock_mhz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                "mem_clock_mhz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)),
                "util_pct": float(util.gpu),
                "fb_used_mib": mem.used / 2**20,
                "fb_total_mib": mem.total / 2**20,
            })
        return {"available": True, "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
                "gpus": gpus}
    except Exception as e:  # a reading NVML refuses on this board: say so, keep the CPU numbers
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # shutting down a library that half-initialised
            pass


def run(args: argparse.Namespace, environ: Environ = os.environ, nvml: Any = None,
        import_module: Callable[[str], Any] | None = None, **timing: Any) -> dict[str, Any]:
    """The result object (the JSON line); raises on a failed measurement. ``nvml`` and
    ``import_module`` replace ``pynvml`` and the GPU libraries' import (tests)."""
    factor, slow_note = slowdown_factor(environ)
    started = time.time()
    readings = nvml_readings(nvml)
    nvml_gpus = readings.get("gpus", []) if readings["available"] else []
    metrics: dict[str, float] = {
        "matmul_gflops": matmul_gflops(args.matmul_n, args.trials, factor, **timing),
        "mem_bandwidth_gbps": mem_bandwidth_gbps(args.mem_mib, args.trials, factor, **timing),
    }
    gpu = gpu_benchmarks(args, environ, import_module)
    metrics.update(gpu.metrics)
    for g in nvml_gpus:
        for key, value in g.items():
            if key not in ("index", "name"):
                metrics[f"gpu{g['index']}_{key}"] = float(value)
    nvml_why = str(readings.get("reason", "no devices"))
    if nvml_gpus:
        cpu_note = f"{len(nvml_gpus)} GPU(s) seen by NVML (readings alongside)"
    elif gpu.backend == "cpu":
        cpu_note = f"no GPU present (NVML unavailable: {nvml_why})"
    else:  # simulated GPUs have no NVML; real ones without pynvml in the image neither
        cpu_note = f"no NVML readings ({nvml_why})"
    cpu_note += "; matmul and memory bandwidth measured on the CPU with NumPy"
    return {
        "apiary_bench": 1, "ok": True, "host": socket.gethostname(), "device": "cpu", "backend": gpu.backend,
        "gpusVisible": environ.get("CUDA_VISIBLE_DEVICES", ""),
        "note": "; ".join(filter(None, [cpu_note, gpu.note, slow_note])),
        "simulatedSlowdown": factor, "metrics": metrics, "gpus": gpu.gpus, "nvml": readings,
        "params": {"matmulN": args.matmul_n, "memMiB": args.mem_mib, "trials": args.trials,
                   "gpuBackend": args.gpu_backend, "gemmN": args.gemm_n, "gpuMemMiB": args.gpu_mem_mib,
                   "pcieMiB": args.pcie_mib, "seed": args.seed},
        "durationS": round(time.time() - started, 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--matmul-n", type=int, default=256, help="CPU matrix size n (default 256)")
    p.add_argument("--mem-mib", type=int, default=32, help="CPU array size for the copy, MiB (default 32)")
    p.add_argument("--trials", type=int, default=20, help="timed trials per benchmark; the best counts (default 20)")
    p.add_argument("--gpu-backend", choices=GPU_BACKENDS, default="auto",
                   help="GPU figures from: auto (simulated GPUs, else PyTorch, else CuPy, else none), "
                        "one library (an error when it cannot run), simulated, or none (default auto)")
    p.add_argument("--gemm-n", type=int, default=8192, help="GPU GEMM matrix size n (default 8192)")
    p.add_argument("--gpu-mem-mib", type=int, default=1024,
                   help="device-to-device copy size, MiB (default 1024)")
    p.add_argument("--pcie-mib", type=int, default=256, help="host<->device copy size, MiB (default 256)")
    p.add_argument("--seed", default="0", help="seed of the simulated GPUs' jitter (default 0)")
    args = p.parse_args(argv)
    if min(args.matmul_n, args.mem_mib, args.trials, args.gemm_n, args.gpu_mem_mib, args.pcie_mib) < 1:
        p.error("--matmul-n, --mem-mib, --trials, --gemm-n, --gpu-mem-mib and --pcie-mib must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One BLAS thread, set before NumPy loads its BLAS: the numbers are per core, and comparable
    # between nodes that share a machine (a simulated cluster) or run other work.
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")
    try:
        result = run(args)
    except Exception as e:  # any failure is the node's result: report it as data, exit non-zero
        print(json.dumps({"apiary_bench": 1, "ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    m = result["metrics"]
    print(f"matmul {m['matmul_gflops']:.2f} GFLOP/s, memory {m['mem_bandwidth_gbps']:.2f} GB/s ({result['note']})")
    for g in result["gpus"]:
        figures = ", ".join(f"{k[len(prefix):]} {v:.1f}" for k, v in sorted(m.items())
                            if k.startswith(prefix := f"gpu{g['index']}_") and k[len(prefix):] in _GPU_FIGURES)
        print(f"gpu{g['index']} ({g['name']}, {result['backend']}): {figures}")
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


#: The GPU figures' names (the human-readable lines of :func:`main`; NVML readings are left out).
_GPU_FIGURES = ("gemm_bf16_tflops", "gemm_fp16_tflops", "gemm_fp32_tflops", "hbm_bandwidth_gbps", "h2d_gbps",
                "d2h_gbps")


if __name__ == "__main__":
    sys.exit(main())
