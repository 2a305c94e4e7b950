"""Apiary's benchmark runner (``make bench``).

Runs the scheduler benchmark (bench/scheduler.py: the pure HiveD algorithm on 1,000 / 5,000 /
10,000-node clusters), the Philly trace replay (bench/replay.py, through ``apiary sim trace``), the
lifecycle benchmarks (bench/lifecycle.py, on the embedded platform), the API benchmarks
(bench/api_submit.py: submissions per second and their p99 with tokens on, at an empty queue and
behind 1,000 queued jobs; the hostile-request corpus timed) and the monitoring benchmarks
(bench/monitoring.py: a node's /metrics scrape time, fault -> alert -> cordon through real
Prometheus and Alertmanager) and the Prefect mirroring benchmarks (bench/prefect_lag.py: UI lag
at 20 jobs/s, catch-up of a 1,000-job burst, on PostgreSQL) and the load benchmark
(bench/load_steady.py: the steady Locust profile, 50 people, against an embedded platform), writes
their numbers to the ``scheduler``, ``replay``, ``lifecycle``, ``api``, ``monitoring``, ``prefect``
and ``load`` sections of ``bench/results.json`` (other top-level sections are kept), prints
measured vs target (bench/thresholds.yaml) and exits 1 if a target is missed, 2 if a benchmark
could not run. See bench/README.md.

    .venv/bin/python bench/run.py                               # everything, full size
    .venv/bin/python bench/run.py --quick                       # smoke size
    .venv/bin/python bench/run.py --only scheduler              # one benchmark (repeatable)
    .venv/bin/python bench/run.py --only lifecycle.start_latency --out /tmp/results.json
    .venv/bin/python bench/run.py --only api                        # submissions/s + hostile requests
    .venv/bin/python bench/run.py --only monitoring                 # scrape time + fault -> cordon
    .venv/bin/python bench/run.py --only prefect [--prefect-sqlite] [--prefect-profile]
    .venv/bin/python bench/run.py --only load                       # steady load profile (Locust), 50 people
    .venv/bin/python bench/run.py --only ci                         # one full platform-ci pipeline, per stage
    .venv/bin/python bench/run.py --only aiops                      # failure prediction on held-out drill runs
    .venv/bin/python bench/run.py --only cluster                    # 1,000 and 5,000 hollow nodes vs one leader
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

# bench/lifecycle.py, bench/scheduler.py, bench/replay.py, bench/api_submit.py, bench/monitoring.py and
# bench/prefect_lag.py (not "prefect.py": bench/ is on sys.path and would shadow the package) are imported
# (through BENCH_DIR on sys.path) only when they run: the lifecycle module pulls in the whole
# embedded platform.

LIFECYCLE = ("lifecycle.start_latency", "lifecycle.concurrent", "lifecycle.queued")
MONITORING = ("monitoring.scrape", "monitoring.fault_to_cordon")
PREFECT = ("prefect.ui_lag", "prefect.catch_up")
API = ("api.submit", "api.hostile")
RUNTIME = ("runtime.docker_start",)
LOAD = ("load.steady",)
CI = ("ci.pipeline",)
AIOPS = ("aiops.failure_prediction",)
CLUSTER = ("cluster.hollow", "cluster.failover")
BENCHMARKS = ("scheduler", "replay", *LIFECYCLE, *API, *RUNTIME, *MONITORING, *PREFECT, *LOAD, *CI, *AIOPS, *CLUSTER)
GROUPS = {"lifecycle": LIFECYCLE, "api": API, "runtime": RUNTIME, "monitoring": MONITORING, "prefect": PREFECT,
          "load": LOAD, "ci": CI, "aiops": AIOPS, "cluster": CLUSTER}
ONLY_CHOICES = (*BENCHMARKS, *GROUPS)  # a family name = every benchmark of that family
# The UI lag runs at PREFECT_RATE (its numbers are the section's own keys) and again at each of
# PREFECT_MORE_RATES (under ``rate_<n>``).
PREFECT_RATE, PREFECT_DURATION_S, PREFECT_BURST = 50.0, 60.0, 1000
PREFECT_MORE_RATES = (20.0,)
QUICK_PREFECT_DURATION_S, QUICK_PREFECT_BURST = 10.0, 100
PREFECT_NODES, QUICK_PREFECT_NODES = 32, 16
SCRAPE_SAMPLES, QUICK_SCRAPE_SAMPLES = 500, 50
CORDON_SAMPLES, QUICK_CORDON_SAMPLES = 4, 2
CORDON_NODES = 4
API_SUBMISSIONS, API_QUEUED, API_HOSTILE_REPEATS = 500, 1000, 3
QUICK_API_SUBMISSIONS, QUICK_API_QUEUED, QUICK_API_HOSTILE_REPEATS = 40, 50, 1
SCHEDULER_NODES = (1000, 5000, 10000)
#: cluster.hollow: hollow-node fleet sizes, and the hollow-node processes for each (bench/cluster.py).
HOLLOW_NODES = (1000, 5000)
QUICK_HOLLOW_NODES = (40,)
HOLLOW_PROCESSES = {5000: 2}
#: cluster.failover: kills of the leader (bench/failover.py), and with --quick.
FAILOVER_KILLS, FAILOVER_KILLS_QUICK = 10, 2
SCHEDULER_SAMPLES = 20000
QUICK_SCHEDULER_NODES = (200,)
QUICK_SCHEDULER_SAMPLES = 1000
RULES = ("min", "max", "below", "above")


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
    """One sentence per metric present in the ``lifecycle`` section, saying exactly what was measured."""
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
    deep = next((k for k in section if k.startswith("submit_per_s_queue_") and not k.endswith("_0_50")), None)
    if deep is not None:
        out.append(
            f"submit_per_s_queue_0_50 / {deep}: on an embedded platform without Prefect, a 2-node x 1-GPU "
            "simulated cluster kept full by two 'sleep 600' jobs, 1-GPU jobs submitted one at a time by one "
            "REST client (each stays queued); rate = submissions / their summed client wall time "
            "(POST /api/v2/jobs until the 202), over the first 50 (queue 0-49 jobs) and the last 100 "
            "submissions; the p99 is over the last 100. Every submission wakes the scheduling loop."
        )
    return " ".join(out)


def scheduler_method(section: dict) -> str:
    import scheduler

    sizes = ", ".join(k.removeprefix("nodes_") for k in section if k.startswith("nodes_"))
    vcs = "/".join(f"{v * 100:.0f}" for v in scheduler.VC_SHARES.values())
    gangs = ", ".join(f"{g} ({w * 100:.0f}%)" for g, w in scheduler.GANG_SIZES.items())
    return (
        f"nodes_<N> (N = {sizes}): the pure HivedScheduler, driven in one thread of the benchmark process, on a "
        f"generated cluster of N nodes x {scheduler.GPUS_PER_NODE} GPUs, cells GPU -> PCIE-SWITCH (2 GPUs) -> "
        f"CPU-SOCKET (2 switches) -> NODE (2 sockets) -> RACK ({scheduler.NODES_PER_RACK} nodes; one physical "
        f"cell per rack), 4 VCs owning {vcs}% of the nodes (RACK.NODE cells). Stream (random.Random seed "
        f"{scheduler.SEED}): gangs of {gangs} GPUs (> 8 = 8-GPU tasks), {scheduler.OPPORTUNISTIC_SHARE * 100:.0f}% "
        "opportunistic, the rest prod or test (50/50) in a uniformly random VC; a group that gets 'wait' is "
        "dropped; on 'preempt' its victims are released and it schedules again. After each group, when "
        f"utilization > {scheduler.HIGH_WATERMARK:.0%}, random running groups are released until it is <= "
        f"{scheduler.LOW_WATERMARK:.0%}. Not measured: building the scheduler (build_s) and filling the cluster to "
        f"{scheduler.WARMUP_UTILIZATION:.0%}. Then, until 'samples' groups were placed: a sample = the "
        "perf_counter_ns time of every schedule() call for one group that ended placed plus its allocate(); "
        "p50_ms/p99_ms (linear interpolation) and max_ms over the samples; placements_per_s = samples / the summed "
        "time of every schedule() and allocate() call of the measured phase, 'wait' answers included; release() "
        "calls are timed apart (release_mean_ms) and counted in neither. The process runs the control plane's "
        "garbage-collection policy (apiary.gcpolicy: the built tree collected and frozen, every later full "
        "collection freezes its survivors); collector pauses inside a timed call are in its sample, and "
        "gc_max_pause_ms is the longest pause of the measured phase wherever it fell."
    )


def replay_method(section: dict) -> str:
    n = section.get("jobs_in_trace")
    which = f"the first {n} jobs of the" if n else "the full"
    return (
        f"philly.<policy>: {which} Philly trace (philly.csv) on the Philly machine list (philly_machines.csv), "
        "replayed by the simulator in one subprocess, `python -m apiary sim trace --policy hived --policy quota "
        "--policy fifo --json OUT`; the per-policy objects of OUT are copied as they are (wall_s is the "
        "simulator's own wall-clock time for that policy; elapsed_s is the whole subprocess)."
    )


def flatten_targets(node: object, prefix: str = "") -> dict[str, dict]:
    """thresholds.yaml as ``{dotted.path: rule}``. Nesting and dotted keys mix freely, e.g.
    ``scheduler: {nodes_5000: {placements_per_s: {min: 1000}}}`` and
    ``scheduler: {nodes_5000.placements_per_s: {min: 1000}}`` are the same target."""
    out: dict[str, dict] = {}
    if not isinstance(node, dict):
        return out
    if node and all(k in RULES for k in node):
        return {prefix: node}
    for k, v in node.items():
        out.update(flatten_targets(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def lookup(data: dict, path: str) -> object:
    cur: object = data
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def check(section: dict, targets: dict) -> list[tuple[str, float, str, bool]]:
    """Measured vs target for every target whose value is in ``section`` (nested dicts; targets
    keyed by dotted path, see :func:`flatten_targets`). Rules: ``min`` >=, ``max`` <=,
    ``below`` <, ``above`` >."""
    rows = []
    for key, rule in flatten_targets(targets or {}).items():
        raw = lookup(section, key)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            continue
        v = float(raw)
        if "min" in rule:
            rows.append((key, v, f">= {rule['min']}", v >= float(rule["min"])))
        if "above" in rule:
            rows.append((key, v, f"> {rule['above']}", v > float(rule["above"])))
        if "max" in rule:
            rows.append((key, v, f"<= {rule['max']}", v <= float(rule["max"])))
        if "below" in rule:
            rows.append((key, v, f"< {rule['below']}", v < float(rule["below"])))
    return rows


def _read(out: Path) -> dict:
    if out.exists():
        try:
            data = json.loads(out.read_text())
            if isinstance(data, dict):
                return data
        except ValueError:
            pass
    return {}


def _write(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, out)


def write_results(out: Path, section: dict, replace: bool, name: str = "lifecycle") -> dict:
    """Merge ``section`` into ``out``'s ``name`` section: replaced wholesale when ``replace``,
    updated key by key otherwise; other top-level sections are kept as they are. Adds ``method``."""
    data = _read(out)
    merged = dict(section) if replace else {**(data.get(name) or {}), **section}
    if name == "lifecycle":
        merged["method"] = method(merged)
    elif name == "scheduler":
        merged["method"] = scheduler_method(merged)
    elif name == "replay":
        merged["method"] = replay_method(merged)
    elif name == "monitoring":
        import monitoring

        merged["method"] = monitoring.method(merged)
    elif name == "api":
        import api_submit

        merged["method"] = api_submit.method(merged)
    elif name == "runtime":
        import runtime_docker

        merged["method"] = runtime_docker.method(merged)
    elif name == "load":
        import load_steady

        merged["method"] = load_steady.method(merged)
    elif name == "ci":
        import ci_pipeline

        merged["method"] = ci_pipeline.method(merged)
    elif name == "aiops":
        import aiops

        merged["method"] = aiops.method(merged)
    elif name == "cluster":
        import cluster

        # Other benchmarks write keys of this section too (cluster.failover_s): each hollow_<N>
        # object carries its own method, and the section's method gets one sentence pointing there.
        for k, v in merged.items():
            if k.startswith("hollow_") and isinstance(v, dict):
                v["method"] = cluster.method(v)
        own = cluster.SECTION_METHOD
        if own not in str(merged.get("method") or ""):
            merged["method"] = f"{merged.get('method') or ''} {own}".strip()
    elif name == "prefect":
        import prefect_lag

        if not replace and isinstance(section.get("sqlite"), dict):  # merge SQLite's keys too
            merged["sqlite"] = {**((data.get(name) or {}).get("sqlite") or {}), **section["sqlite"]}

        merged["method"] = prefect_lag.method(merged)
        if isinstance(merged.get("sqlite"), dict):
            merged["sqlite"]["method"] = prefect_lag.method({**merged["sqlite"], "database": "sqlite"})
    data[name] = merged
    _write(out, data)
    return merged


def stamp(section: dict, quick: bool) -> None:
    section["quick"] = bool(quick)
    section["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    section["machine"] = machine()


def run_scheduler(nodes: list[int], samples: int) -> dict:
    import scheduler

    section: dict = {}
    for n in nodes:
        r = scheduler.measure(n, samples)
        d = r.to_dict()
        section[f"nodes_{n}"] = d
        print(
            f"scheduler nodes={n}: {d['placements_per_s']:.0f} placements/s, p50={d['p50_ms']:.3f} ms "
            f"p99={d['p99_ms']:.3f} ms max={d['max_ms']:.1f} ms over {d['samples']} placements "
            f"({d['attempts']} attempts, {d['waits']} waits, {d['preemptions']} preemptions), utilization "
            f"{d['utilization_min']:.2f}..{d['utilization_max']:.2f}, build {d['build_s']:.2f} s, longest "
            f"collector pause {d['gc_max_pause_ms']:.1f} ms ({d['gc_full_collections']} full collections)",
            flush=True,
        )
    return section


def run_replay(quick: bool, timeout_s: float) -> dict:
    import replay

    r = replay.run_replay(quick=quick, timeout_s=timeout_s)
    section: dict = {"philly": r.policies}
    if r.jobs_in_trace is not None:
        section["jobs_in_trace"] = r.jobs_in_trace
    section["command"] = r.command
    section["elapsed_s"] = round(r.elapsed_s, 2)
    for pol, d in r.policies.items():
        q = d.get("queue_delay_s") or {}
        print(
            f"replay {pol}: jobs={d.get('jobs')} rejected={d.get('rejected')} wall={d.get('wall_s')} s "
            f"queue p50/p99={q.get('p50')}/{q.get('p99')} s utilization={d.get('gpu_utilization')} "
            f"preemptions={d.get('preemptions')} sharing_anomaly_s={d.get('sharing_anomaly_s')}",
            flush=True,
        )
    return section


def run_monitoring(which: set[str], quick: bool, errors: list[str]) -> dict:
    """The ``monitoring`` benchmarks in ``which``; a failed one is added to ``errors`` (its keys are
    then absent: never stale or made-up numbers)."""
    section: dict = {}
    if not which & set(MONITORING):
        return section
    import monitoring

    if "monitoring.scrape" in which:
        try:
            r = monitoring.measure_scrape(8, QUICK_SCRAPE_SAMPLES if quick else SCRAPE_SAMPLES)
            d = r.to_dict()
            section.update(d)
            print(
                f"scrape: {r.gpus} simulated GPUs, {r.tasks} running tasks, {r.bytes} bytes: GET /metrics "
                f"p50={d['scrape_ms_8gpu']:.2f} ms p95={d['scrape_p95_ms']:.2f} ms max={d['scrape_max_ms']:.2f} ms "
                f"over {d['scrape_samples']} scrapes; render() p50={d['render_ms_p50']:.2f} ms",
                flush=True,
            )
        except Exception:
            errors.append("monitoring.scrape")
            traceback.print_exc()
    if "monitoring.fault_to_cordon" in which:
        try:
            r = monitoring.measure_fault_to_cordon(
                QUICK_CORDON_SAMPLES if quick else CORDON_SAMPLES, nodes=CORDON_NODES
            )
            d = r.to_dict()
            section.update(d)
            by_node = ", ".join(f"{n}={v:.2f}" for n, v in d["fault_to_cordon_by_node_s"].items())
            print(
                f"fault_to_cordon: median={d['fault_to_cordon_s']:.2f} s max={d['fault_to_cordon_max_s']:.2f} s "
                f"over {d['fault_to_cordon_samples']} nodes [{by_node}]; alert firing in Prometheus after "
                f"{d.get('fault_to_firing_s')} s (median); platform up in {r.startup_s:.1f} s, all targets up at "
                f"{r.targets_up_s:.1f} s",
                flush=True,
            )
        except Exception as e:
            errors.append("monitoring.fault_to_cordon")
            if isinstance(e, monitoring.MonitoringUnavailable):
                print(f"monitoring.fault_to_cordon: {e}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
    return section


def run_runtime(which: set[str], quick: bool, errors: list[str]) -> dict:
    """``runtime.docker_start`` (bench/runtime_docker.py): 50 jobs (10 with --quick)."""
    section: dict = {}
    if "runtime.docker_start" not in which:
        return section
    import runtime_docker

    try:
        d = runtime_docker.measure_docker_start(10 if quick else 50).to_dict()
        section.update(d)
        print(f"runtime docker_start: n={d['docker_start_samples']} p50={d['docker_start_p50_s']}s "
              f"p99={d['docker_start_p99_s']}s max={d['docker_start_max_s']}s ({d['docker_start_image']})", flush=True)
    except Exception:
        errors.append("runtime.docker_start")
        traceback.print_exc()
    return section


def run_ci(which: set[str], quick: bool, errors: list[str]) -> dict:
    """``ci.stage_s`` (bench/ci_pipeline.py): one full-profile platform-ci run (reduced with --quick)."""
    section: dict = {}
    if "ci.pipeline" not in which:
        return section
    import ci_pipeline

    try:
        section.update(ci_pipeline.measure_pipeline("reduced" if quick else "full"))
        stages = ", ".join(f"{k} {v:g}" for k, v in section["stage_s"].items())
        print(f"ci pipeline ({section['profile']}): {section['total_s']:g} s total; {stages}", flush=True)
    except Exception:
        errors.append("ci.pipeline")
        traceback.print_exc()
    return section


def run_api(which: set[str], quick: bool, errors: list[str]) -> dict:
    """The ``api`` benchmarks in ``which`` (bench/api_submit.py); a failed one is added to
    ``errors`` and leaves its keys out."""
    section: dict = {}
    if not which & set(API):
        return section
    import api_submit

    if "api.submit" in which:
        try:
            r = api_submit.measure_submit(QUICK_API_SUBMISSIONS if quick else API_SUBMISSIONS,
                                          QUICK_API_QUEUED if quick else API_QUEUED)
            d = r.to_dict()
            section.update(d)
            runs = "; ".join(
                f"{name} (queue {d[f'{name}_queue_before']}): {d[f'{name}_per_s']}/s p50={d[f'{name}_p50_ms']} ms "
                f"p99={d[f'{name}_p99_ms']} ms max={d[f'{name}_max_ms']} ms, {d[f'{name}_errors']} errors, "
                f"{d[f'{name}_listed']}/{d[f'{name}_accepted']} accepted listed, control plane "
                f"{d.get(f'{name}_cpu_ms_per_submit_control-plane')} ms CPU per submission, "
                f"{d[f'{name}_cycles']} cycles"
                for name in ("empty", "queued")
            )
            print(f"api submit: {d['submit_threads']} clients x {d['empty_submissions']} submissions: {runs}",
                  flush=True)
        except Exception:
            errors.append("api.submit")
            traceback.print_exc()
    if "api.hostile" in which:
        try:
            h = api_submit.measure_hostile(QUICK_API_HOSTILE_REPEATS if quick else API_HOSTILE_REPEATS)
            d = h.to_dict()
            section.update(d)
            print(
                f"api hostile: {d['hostile_cases']} cases x {d['hostile_repeats']}: p50={d['hostile_p50_ms']} ms "
                f"p99={d['hostile_p99_ms']} ms max={d['hostile_max_ms']} ms, {d['hostile_unexpected']} answered "
                f"other than the corpus expects; slowest {d['hostile_slowest_ms']}",
                flush=True,
            )
        except Exception as e:
            errors.append("api.hostile")
            if isinstance(e, FileNotFoundError):
                print(f"api.hostile: {e}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
    return section


def run_cluster(which: set[str], quick: bool, sizes: list[int] | None, errors: list[str]) -> dict:
    """``cluster.hollow`` (bench/cluster.py): one control plane against N hollow nodes, for N in
    ``sizes`` (default 1,000 and 5,000; 40 with --quick, with shorter windows); each size's numbers
    under ``hollow_<N>``; and ``cluster.failover`` (bench/failover.py, root only: kill -9 of the
    leader replica, :data:`FAILOVER_KILLS` times) under ``failover_s``. A size or run that fails is
    added to ``errors`` and leaves its key out."""
    section: dict = {}
    import cluster

    for n in (sizes or (QUICK_HOLLOW_NODES if quick else HOLLOW_NODES)) if "cluster.hollow" in which else ():
        try:
            kw = {"idle_s": 5.0, "stream_s": 5.0, "burst_jobs": 40} if quick else {}
            d = cluster.measure_hollow(n, processes=HOLLOW_PROCESSES.get(n, 1), **kw)
            section[f"hollow_{n}"] = d
            print(
                f"cluster hollow_{n}: leader CPU idle {d['leader_cpu_idle_cores']} / stream "
                f"{d['leader_cpu_stream_cores']} cores; heartbeat p50/p99 {d['heartbeat_p50_ms']}/"
                f"{d['heartbeat_p99_ms']} ms over {d['heartbeat_samples']}; run reports p50/p99 "
                f"{d['run_report_p50_ms']}/{d['run_report_p99_ms']} ms over {d['run_report_samples']}; "
                "assignment p50/p99 "
                f"{d['assignment_p50_ms']}/{d['assignment_p99_ms']} ms over {d['assignment_samples']}; stream "
                f"{d['stream_rate_per_s']}/s p99 {d['stream_submit_p99_ms']} ms; burst {d['submit_per_s']}/s p99 "
                f"{d['submit_p99_ms']} ms; {d['jobs_succeeded']}/{d['jobs_submitted']} SUCCEEDED; ready after "
                f"{d['ready_s']} s (control plane up in {d['startup_s']} s)",
                flush=True,
            )
        except Exception:
            errors.append(f"cluster.hollow_{n}")
            traceback.print_exc()
    if "cluster.failover" in which and os.geteuid() == 0:  # hosts are network namespaces: root only
        import failover

        try:
            f = failover.run(FAILOVER_KILLS_QUICK if quick else FAILOVER_KILLS)
            section["failover_s"], section["failover_method"] = f["failover_s"], f["method"]
            print(f"cluster failover_s: p50 {f['failover_s']['p50']} p99 {f['failover_s']['p99']} max "
                  f"{f['failover_s']['max']} s over {f['failover_s']['n']} kills", flush=True)
        except Exception:
            errors.append("cluster.failover")
            traceback.print_exc()
    return section


def run_aiops(which: set[str], quick: bool, errors: list[str]) -> dict:
    """``aiops`` (bench/aiops.py): node-failure prediction on held-out drill runs (24 + 64 runs;
    8 + 8 with --quick); a failed run is added to ``errors`` and leaves its keys out."""
    section: dict = {}
    if "aiops.failure_prediction" not in which:
        return section
    import aiops

    try:
        section.update(aiops.measure(quick))
        print(
            f"aiops: precision={section['precision']} recall={section['recall']} (with precursors "
            f"{section['recall_with_precursors']}) lead_time median={section['lead_time_s']:g} s "
            f"({section['lead_time_intervals']} drill intervals) tp={section['tp']} fp={section['fp']} "
            f"fn={section['fn']} ({section['fn_sudden']} sudden) over {section['runs']} held-out runs, "
            f"{section['wall_s']} s",
            flush=True,
        )
    except Exception:
        errors.append("aiops.failure_prediction")
        traceback.print_exc()
    return section


def run_load(which: set[str], quick: bool, errors: list[str]) -> dict:
    """The ``load`` benchmark (bench/load_steady.py): the steady profile, 50 people for 90 s (10 for
    30 s with --quick); a failed run is added to ``errors`` and leaves its keys out."""
    section: dict = {}
    if "load.steady" not in which:
        return section
    import load_steady

    try:
        users, duration = ((load_steady.QUICK_USERS, load_steady.QUICK_DURATION_S) if quick
                           else (load_steady.USERS, load_steady.DURATION_S))
        # The full run's latency and throughput plots go to bench/plots (a --quick run's do not).
        d = load_steady.measure_steady(users, duration, figures=None if quick else Path(__file__).parent / "plots")
        section.update(d)
        print(
            f"load steady: {d['users']} people ({d['agents']} simulated node agents) for {d['duration_s']:g} s: "
            f"{d['requests']} requests at {d['requests_per_s']}/s, {d['failures']} failed; submissions "
            f"{d['submit_per_s']}/s p95={d['submit_p95_ms']} ms p99={d['submit_p99_ms']} ms; jobs "
            f"{d['listed']}/{d['accepted']} accepted listed ({d['lost']} lost); gates "
            f"{'PASS' if d['gates_passed'] else 'FAIL: ' + '; '.join(d['gates_failed'])}",
            flush=True,
        )
    except Exception:
        errors.append("load.steady")
        traceback.print_exc()
    return section


def run_prefect(which: set[str], quick: bool, databases: list[str], profile: bool, errors: list[str]) -> dict:
    """The ``prefect`` benchmarks in ``which`` on each of ``databases``; PostgreSQL's numbers are the
    section's own keys (the ones thresholds.yaml checks), SQLite's go under ``sqlite``. A failed
    one is added to ``errors`` and leaves its keys out."""
    section: dict = {}
    if not which & set(PREFECT):
        return section
    import prefect_lag

    nodes = QUICK_PREFECT_NODES if quick else PREFECT_NODES
    for db in databases:
        out: dict = {"database": db, "nodes": nodes, "gpus_per_node": 8}
        if "prefect.ui_lag" in which:
            for rate in (PREFECT_RATE, *PREFECT_MORE_RATES):
                try:
                    r = prefect_lag.measure_lag(
                        rate,
                        QUICK_PREFECT_DURATION_S if quick else PREFECT_DURATION_S,
                        database=db,
                        nodes=nodes,
                        trace=profile,
                    )
                    d = r.to_dict()
                    if rate == PREFECT_RATE:
                        out.update(d)
                    else:
                        out[f"rate_{rate:g}"] = d
                    by = "; ".join(
                        f"{k}: p50={v.get('p50_s')} p99={v.get('p99_s')} max={v.get('max_s')} n={v['count']} "
                        f"missing={v['missing']}"
                        for k, v in d["ui_lag_by_transition"].items()
                    )
                    print(
                        f"prefect ui_lag [{db}, {rate:g}/s]: {r.submitted} jobs at "
                        f"{d['ui_lag_achieved_rate_per_s']}/s; "
                        f"lag p50={d['ui_lag_p50_s']} s p99={d['ui_lag_p99_s']} s max={d['ui_lag_max_s']} s over "
                        f"{d['ui_lag_samples']} transitions ({d['ui_lag_missing']} never reached Prefect) [{by}]; "
                        f"Apiary final after {d['ui_lag_apiary_final_after_s']} s, Prefect after "
                        f"{d['ui_lag_prefect_final_after_s']} s; cpu {r.cpu.get('cpu_s')} over "
                        f"{r.cpu.get('wall_s')} s; "
                        f"steady window: {r.steady}",
                        flush=True,
                    )
                except Exception:
                    errors.append(f"prefect.ui_lag[{db}, {rate:g}/s]")
                    traceback.print_exc()
        if "prefect.catch_up" in which:
            try:
                r = prefect_lag.measure_catch_up(
                    QUICK_PREFECT_BURST if quick else PREFECT_BURST, database=db, nodes=nodes, trace=profile
                )
                d = r.to_dict()
                out.update(d)
                print(
                    f"prefect catch_up [{db}]: {r.submitted} jobs submitted in {r.submit_s:.1f} s, Apiary final "
                    f"after {r.apiary_final_after_s:.1f} s, every flow run terminal after {r.catch_up_s:.1f} s "
                    f"(complete={r.complete}: {r.flow_runs} flow runs, {r.terminal} terminal; "
                    f"{d['catch_up_jobs_per_s']} jobs/s); cpu {r.cpu.get('cpu_s')} over {r.cpu.get('wall_s')} s",
                    flush=True,
                )
            except Exception:
                errors.append(f"prefect.catch_up[{db}]")
                traceback.print_exc()
        if len(out) > 3:
            if db == "postgresql":
                section.update(out)
            else:
                section[db] = out
    return section


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        action="append",
        choices=ONLY_CHOICES,
        help="run only this benchmark (repeatable); a family name ('lifecycle', 'api', 'monitoring', 'prefect', "
        "'load') = every benchmark of that family",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke size: 20 latency samples, 100 concurrent jobs, scheduler on 200 nodes with 1,000 placements, "
        f"replay of the first 2,000 Philly jobs, {QUICK_SCRAPE_SAMPLES} scrapes, {QUICK_CORDON_SAMPLES} "
        f"fault -> cordon samples, Prefect lag over {QUICK_PREFECT_DURATION_S:.0f} s and a {QUICK_PREFECT_BURST}-job "
        f"burst, {QUICK_API_SUBMISSIONS} API submissions per run behind {QUICK_API_QUEUED} queued jobs, the hostile "
        "corpus once, the steady load profile with 10 people for 30 s",
    )
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "results.json", help="results file (merged)")
    ap.add_argument("--thresholds", type=Path, default=BENCH_DIR / "thresholds.yaml")
    ap.add_argument(
        "--no-prefect-latency",
        action="store_true",
        help="measure start latency with prefect=False (default: the real platform, prefect=True)",
    )
    ap.add_argument(
        "--scheduler-nodes",
        type=int,
        action="append",
        help="scheduler: cluster size(s) to measure instead of the default ones (repeatable; results merged)",
    )
    ap.add_argument("--scheduler-samples", type=int, help="scheduler: placements measured per cluster size")
    ap.add_argument(
        "--cluster-nodes",
        type=int,
        action="append",
        help="cluster: hollow-node fleet size(s) to measure instead of 1,000 and 5,000 (repeatable; merged)",
    )
    ap.add_argument("--replay-timeout", type=float, default=1200.0, help="replay: bound on the simulator run (s)")
    ap.add_argument(
        "--prefect-sqlite",
        action="store_true",
        help="prefect: also measure with SQLite (store and Prefect server) for comparison, under prefect.sqlite",
    )
    ap.add_argument(
        "--prefect-only-sqlite", action="store_true", help="prefect: measure only on SQLite (no PostgreSQL needed)"
    )
    ap.add_argument(
        "--prefect-profile",
        action="store_true",
        help="prefect: record every request the Prefect server serves (count per endpoint and job, server-side "
        "latency) into *_requests",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for noisy in ("httpx", "httpcore", "prefect"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    which = set()
    for o in args.only or BENCHMARKS:
        which.update(GROUPS.get(o, (o,)))
    nofile = raise_nofile()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {machine()}  RLIMIT_NOFILE={nofile}  loadavg={load}", flush=True)

    written: dict[str, dict] = {}
    errors: list[str] = []

    # The scheduler runs first, on a quiet machine (it measures one core).
    if "scheduler" in which:
        try:
            nodes = args.scheduler_nodes or list(QUICK_SCHEDULER_NODES if args.quick else SCHEDULER_NODES)
            samples = args.scheduler_samples or (QUICK_SCHEDULER_SAMPLES if args.quick else SCHEDULER_SAMPLES)
            sec = run_scheduler(nodes, samples)
            stamp(sec, args.quick)
            written["scheduler"] = sec
            write_results(args.out, sec, replace=args.scheduler_nodes is None, name="scheduler")
        except Exception:
            errors.append("scheduler")
            traceback.print_exc()

    if "replay" in which:
        try:
            sec = run_replay(args.quick, args.replay_timeout)
            stamp(sec, args.quick)
            written["replay"] = sec
            write_results(args.out, sec, replace=True, name="replay")
        except Exception as e:
            errors.append("replay")
            if isinstance(e, RuntimeError | FileNotFoundError):
                print(f"replay: {e}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()

    section: dict = {}
    if which & set(LIFECYCLE):
        import lifecycle

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
    if "lifecycle.queued" in which:
        try:
            r = lifecycle.measure_queued_submissions(100 if args.quick else 500)
            section.update(r.to_dict())
            print("queued submissions: " + ", ".join(f"{k}={v}" for k, v in r.to_dict().items()), flush=True)
        except Exception:
            errors.append("lifecycle.queued")
            traceback.print_exc()
    if section:
        stamp(section, args.quick)
        written["lifecycle"] = section
        # a run of both lifecycle benchmarks replaces the section; a run of one updates its keys
        write_results(args.out, section, replace=set(LIFECYCLE) <= which, name="lifecycle")
    api = run_api(which, args.quick, errors)
    if api:
        stamp(api, args.quick)
        written["api"] = api
        # a run of both api benchmarks replaces the section; a run of one updates its keys
        write_results(args.out, api, replace=set(API) <= which, name="api")
    rt = run_runtime(which, args.quick, errors)
    if rt:
        stamp(rt, args.quick)
        written["runtime"] = rt
        write_results(args.out, rt, replace=True, name="runtime")
    mon = run_monitoring(which, args.quick, errors)
    if mon:
        stamp(mon, args.quick)
        written["monitoring"] = mon
        # a run of both monitoring benchmarks replaces the section; a run of one updates its keys
        write_results(args.out, mon, replace=set(MONITORING) <= which, name="monitoring")
    dbs = ["sqlite"] if args.prefect_only_sqlite else ["postgresql", *(["sqlite"] if args.prefect_sqlite else [])]
    pre = run_prefect(which, args.quick, dbs, args.prefect_profile, errors)
    if pre:
        stamp(pre, args.quick)
        written["prefect"] = pre
        # a run of both prefect benchmarks on PostgreSQL replaces the section; others update their keys
        write_results(args.out, pre, replace=set(PREFECT) <= which and "postgresql" in dbs, name="prefect")
    cip = run_ci(which, args.quick, errors)
    if cip:
        stamp(cip, args.quick)
        written["ci"] = cip
        write_results(args.out, cip, replace=True, name="ci")
    ld = run_load(which, args.quick, errors)
    if ld:
        stamp(ld, args.quick)
        written["load"] = ld
        write_results(args.out, ld, replace=True, name="load")
    ai = run_aiops(which, args.quick, errors)
    if ai:
        stamp(ai, args.quick)
        written["aiops"] = ai
        write_results(args.out, ai, replace=True, name="aiops")
    cl = run_cluster(which, args.quick, args.cluster_nodes, errors)
    if cl:
        stamp(cl, args.quick)
        written["cluster"] = cl
        # never replaced wholesale: other benchmarks (the failover one) write keys of this section
        write_results(args.out, cl, replace=False, name="cluster")
    if written:
        print(f"wrote {', '.join(written)} to {args.out}", flush=True)

    targets = yaml.safe_load(args.thresholds.read_text()) or {}
    failed = False
    rows = [row for name, sec in written.items() for row in check({name: sec}, {name: targets.get(name) or {}})]
    if rows:
        width = max(28, *(len(r[0]) + 2 for r in rows))
        print(f"\n{'metric':<{width}}{'measured':>12}  {'target':<10} result")
        for key, v, rule, ok in rows:
            failed |= not ok
            print(f"{key:<{width}}{v:>12.3f}  {rule:<10} {'PASS' if ok else 'FAIL'}")
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
