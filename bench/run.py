"""Apiary's benchmark runner (``make bench``).

Runs the lifecycle benchmarks (bench/lifecycle.py) on the embedded platform, writes their
numbers to the ``lifecycle`` section of ``bench/results.json`` (other top-level sections, written
by other benchmarks, are kept), prints measured vs target (bench/thresholds.yaml) and exits 1 if
a target is missed, 2 if a benchmark could not run. See bench/README.md.

    .venv/bin/python bench/run.py                               # everything, full size
    .venv/bin/python bench/run.py --quick                       # smoke size (20 samples, 100 jobs)
    .venv/bin/python bench/run.py --only lifecycle.start_latency --out /tmp/results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import psutil
import yaml

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for p in (str(REPO_ROOT / "platform"), str(BENCH_DIR)):
    if p not in sys.path:
        sys.path.insert(0, p)

import lifecycle  # noqa: E402  (bench/lifecycle.py, found through BENCH_DIR on sys.path)

BENCHMARKS = ("lifecycle.start_latency", "lifecycle.concurrent")


def machine() -> str:
    mem = psutil.virtual_memory().total / 2**30
    return (
        f"nproc={os.cpu_count()} mem={mem:.1f}GiB {platform.system()} {platform.release()} "
        f"{platform.machine()} python={platform.python_version()}"
    )


def raise_nofile() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard limit (1,000 tasks = ~3,000 processes, pipes,
    log files and sockets); inherited by the platform's children."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def method(section: dict) -> str:
    """One sentence per metric present in ``section``, saying exactly what was measured."""
    out = []
    if "start_latency_p50_s" in section:
        with_prefect = "with" if section.get("start_latency_prefect", True) else "without"
        out.append(
            f"start_latency_p50_s/p99_s: over {section.get('start_latency_samples')} 1-GPU 'sleep 0.2' jobs submitted "
            f"one at a time through the REST API to an idle embedded platform ({with_prefect} Prefect: server, "
            "bridge, serve) on a generated 16-node x 8-GPU simulated cluster (one VC, GPU -> node -> pool cells), "
            "each after the previous job's task had started (2 warm-up jobs not counted), latency = the task's "
            "startTime (agent clock at spawning the task process) minus the job's submissionTime (control-plane "
            "clock at acceptance), median and 99th percentile (linear interpolation)."
        )
    if "concurrent_1000_rss_mb" in section:
        out.append(
            f"concurrent_1000_rss_mb: peak, over samples every 0.2 s from the first submission until the Prefect "
            f"bridge caught up, of the summed RSS of the control-plane, prefect-bridge, prefect-serve and Prefect "
            f"server process trees plus the agent process alone (its descendants are the task processes and are "
            f"excluded; the supervisor/benchmark process is excluded) while {section.get('concurrent_jobs')} 1-GPU "
            "'sleep 60' jobs, submitted by 8 threads through the REST API, ran on a 128-node x 8-GPU simulated "
            "cluster with prefect=True."
        )
        out.append(
            "concurrent_peak_running: the largest number of tasks in state RUNNING seen in GET /api/v2/jobs?state="
            "RUNNING, polled every 1 s during that run."
        )
        out.append(
            "flow_runs_created: flow runs of flow 'apiary-job' counted in the platform's Prefect server with "
            "PrefectClient.count_flow_runs after every job ended, polled until each job had a final flow run or "
            "300 s passed."
        )
    return " ".join(out)


def check(section: dict, targets: dict) -> list[tuple[str, float, str, bool]]:
    rows = []
    for key, rule in (targets or {}).items():
        if key not in section:
            continue
        v = float(section[key])
        if "max" in rule:
            rows.append((key, v, f"<= {rule['max']}", v <= float(rule["max"])))
        if "below" in rule:
            rows.append((key, v, f"< {rule['below']}", v < float(rule["below"])))
        if "min" in rule:
            rows.append((key, v, f">= {rule['min']}", v >= float(rule["min"])))
    return rows


def write_results(out: Path, section: dict, replace: bool) -> dict:
    """Merge ``section`` into ``out``'s ``lifecycle``: replaced wholesale on a full run, updated
    key by key on an ``--only`` run; other top-level sections are kept as they are."""
    data: dict = {}
    if out.exists():
        try:
            data = json.loads(out.read_text())
            if not isinstance(data, dict):
                data = {}
        except ValueError:
            data = {}
    merged = dict(section) if replace else {**(data.get("lifecycle") or {}), **section}
    merged["method"] = method(merged)
    data["lifecycle"] = merged
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, out)
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
    ap.add_argument("--quick", action="store_true", help="smoke size: 20 latency samples, 100 concurrent jobs")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "results.json", help="results file (merged)")
    ap.add_argument("--thresholds", type=Path, default=BENCH_DIR / "thresholds.yaml")
    ap.add_argument(
        "--no-prefect-latency",
        action="store_true",
        help="measure start latency with prefect=False (default: the real platform, prefect=True)",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for noisy in ("httpx", "httpcore", "prefect"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    which = args.only or list(BENCHMARKS)
    nofile = raise_nofile()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {machine()}  RLIMIT_NOFILE={nofile}  loadavg={load}", flush=True)

    section: dict = {}
    errors: list[str] = []
    if "lifecycle.start_latency" in which:
        try:
            r = lifecycle.measure_start_latency(20 if args.quick else 100, prefect=not args.no_prefect_latency)
            section.update(r.to_dict())
            section["start_latency_prefect"] = r.prefect
            obs = sorted(r.observed)
            print(
                f"start_latency: n={len(r.samples)} p50={section['start_latency_p50_s']:.3f}s "
                f"p99={section['start_latency_p99_s']:.3f}s max={max(r.samples):.3f}s "
                f"(client-observed submit->startTime seen: p50={lifecycle.percentile(obs, 50):.3f}s "
                f"p99={lifecycle.percentile(obs, 99):.3f}s; prefect={r.prefect})",
                flush=True,
            )
        except Exception:
            errors.append("lifecycle.start_latency")
            traceback.print_exc()
    if "lifecycle.concurrent" in which:
        try:
            jobs = 100 if args.quick else 1000
            r = lifecycle.measure_concurrent(jobs, nodes=16 if args.quick else 128, sleep_s=5 if args.quick else 60)
            section.update(r.to_dict())
            parts = ", ".join(f"{k}={v:.0f}" for k, v in sorted(r.peak_parts.items()))
            print(
                f"concurrent: jobs={r.jobs} submitted in {r.submit_s:.1f}s (errors {r.submit_errors}), "
                f"peak running={r.peak_running}, all final after {r.all_final_s:.1f}s {r.states}, "
                f"peak RSS={r.peak_rss_mb:.0f} MB [{parts}] over {r.rss_samples} samples, "
                f"flow runs={r.flow_runs} (final {r.flow_runs_final}, caught up at {r.bridge_caught_up_s}), "
                f"child restarts={r.restarts}",
                flush=True,
            )
        except Exception:
            errors.append("lifecycle.concurrent")
            traceback.print_exc()

    if section:
        section["quick"] = bool(args.quick)
        section["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        section["machine"] = machine()
        write_results(args.out, section, replace=args.only is None)
        print(f"wrote {args.out}", flush=True)

    targets = (yaml.safe_load(args.thresholds.read_text()) or {}).get("lifecycle", {})
    failed = False
    print(f"\n{'metric':<28}{'measured':>12}  {'target':<10} result")
    for key, v, rule, ok in check(section, targets):
        failed |= not ok
        print(f"{key:<28}{v:>12.3f}  {rule:<10} {'PASS' if ok else 'FAIL'}")
    if args.quick:
        print("(--quick: smaller runs, the numbers are indicative only)")
    if errors:
        print(f"ERROR: benchmark(s) did not complete: {', '.join(errors)}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    print(f"done in {time.monotonic() - t0:.0f} s, exit {code}", flush=True)
    sys.exit(code)
