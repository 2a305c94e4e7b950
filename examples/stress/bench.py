"""Hardware-validation micro-benchmarks for Apiary's stress drill (platform/apiary/drills/stress.py).

Usage (from the repository root, as the drill's job runs it)::

    python3 examples/stress/bench.py [--matmul-n 256] [--mem-mib 32] [--trials 20]

Measures, with NumPy:

* ``matmul_gflops``: float64 matrix multiplication throughput (2 n^3 FLOP per product);
* ``mem_bandwidth_gbps``: memory bandwidth of an array copy (bytes read + written per second);

each as the best of ``--trials`` timed trials (the best trial is the least disturbed by other
work on the machine), on one BLAS thread. They run on the CPU: this script carries no GPU kernel
library, and says so in its output (``note``). When NVML answers (``pynvml`` and a driver), the
GPUs' readings (temperature, power, clocks, utilization, memory) come alongside, flattened into
the metrics as ``gpu<i>_<reading>``.

Simulated slowdown: when ``APIARY_SIMULATED_SLOWDOWN`` is a factor F > 1 (the node agent sets it
for tasks on a GPU with an injected ``degraded`` fault), every trial is stretched to F times its
duration by sleeping, so the measured throughputs are divided by F. This is a simulation, for
testing the drill's diagnosis on simulated clusters; the output names the factor.

Output: the last line of stdout is one JSON object, ``{"apiary_bench": 1, "ok": true, "metrics":
{...}, ...}``; on an error ``{"apiary_bench": 1, "ok": false, "error": "..."}`` and exit code 1.
Needs only NumPy (and pynvml for the readings): it runs in any image that has them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

SLOWDOWN_ENV = "APIARY_SIMULATED_SLOWDOWN"
#: The minimum duration of one trial; the work is repeated until a trial lasts this long. Short:
#: on a busy machine a short trial is more likely to run without losing the CPU to another process.
TRIAL_S = 0.01
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

Clock = Callable[[], float]
Sleep = Callable[[float], None]


def slowdown_factor(environ: dict[str, str] | os._Environ[str]) -> tuple[float, str]:
    """(factor, note): ``APIARY_SIMULATED_SLOWDOWN`` as a factor >= 1; 1.0 when unset or unreadable."""
    raw = environ.get(SLOWDOWN_ENV)
    if raw is None:
        return 1.0, ""
    try:
        factor = float(raw)
    except ValueError:
        return 1.0, f"{SLOWDOWN_ENV}={raw!r} is not a number: ignored"
    if not math.isfinite(factor) or factor < 1.0:
        return 1.0, f"{SLOWDOWN_ENV}={raw!r} is not a factor >= 1: ignored"
    if factor == 1.0:
        return 1.0, ""
    return factor, f"simulated slowdown x{factor:g} applied ({SLOWDOWN_ENV})"


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


def run(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str] = os.environ,
        nvml: Any = None, **timing: Any) -> dict[str, Any]:
    """The result object (the JSON line); raises on a failed measurement."""
    factor, slow_note = slowdown_factor(environ)
    started = time.time()
    readings = nvml_readings(nvml)
    gpus = readings.get("gpus", []) if readings["available"] else []
    metrics: dict[str, float] = {
        "matmul_gflops": matmul_gflops(args.matmul_n, args.trials, factor, **timing),
        "mem_bandwidth_gbps": mem_bandwidth_gbps(args.mem_mib, args.trials, factor, **timing),
    }
    for g in gpus:
        for key, value in g.items():
            if key not in ("index", "name"):
                metrics[f"gpu{g['index']}_{key}"] = float(value)
    if gpus:
        note = (f"{len(gpus)} GPU(s) seen by NVML (readings alongside); matmul and memory bandwidth measured "
                "on the CPU with NumPy (no GPU kernel library in this benchmark)")
    else:
        note = ("no GPU present (NVML unavailable: " + str(readings.get("reason", "no devices")) + "); "
                "matmul and memory bandwidth measured on the CPU with NumPy")
    return {
        "apiary_bench": 1, "ok": True, "host": socket.gethostname(), "device": "cpu",
        "gpusVisible": environ.get("CUDA_VISIBLE_DEVICES", ""), "note": "; ".join(filter(None, [note, slow_note])),
        "simulatedSlowdown": factor, "metrics": metrics, "nvml": readings,
        "params": {"matmulN": args.matmul_n, "memMiB": args.mem_mib, "trials": args.trials},
        "durationS": round(time.time() - started, 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matmul-n", type=int, default=256, help="matrix size n (default 256)")
    p.add_argument("--mem-mib", type=int, default=32, help="array size for the copy, MiB (default 32)")
    p.add_argument("--trials", type=int, default=20, help="timed trials per benchmark; the best counts (default 20)")
    args = p.parse_args(argv)
    if args.matmul_n < 1 or args.mem_mib < 1 or args.trials < 1:
        p.error("--matmul-n, --mem-mib and --trials must be >= 1")
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
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
