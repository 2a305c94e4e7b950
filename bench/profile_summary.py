"""Where a platform process spends its CPU: a summary of py-spy's raw (collapsed) stacks by step.

``py-spy record --gil --nonblocking -f raw -p PID -o FILE`` samples the thread holding the GIL
(Python's CPU time, not time waiting on sockets or locks). This groups the samples by the first
rule of :data:`RULES` whose pattern matches a frame of the stack, per process kind, and prints the
share of each step. Samples whose leaf is a wait (``select``, a lock, a queue) are left out. Time
spent outside the GIL (the kernel's fork/exec, PostgreSQL's own process) is not in these files: the
bench's per-process CPU seconds (``ui_lag_cpu``, ``ui_lag_steady``) count it.

    python bench/profile_summary.py control-plane FILE [FILE...]

A profiling aid, not part of run.py (py-spy is not a dependency: ``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import collections
import re

#: (step, pattern over one frame "function (file:line)") in priority order, per process kind.
RULES: dict[str, list[tuple[str, str]]] = {
    "control-plane": [
        ("node reports (task start/exit, heartbeats)", r"NodeService\.node_report|HeartbeatFastPath"),
        ("scheduling cycle (admission, placement commit)", r"SchedulingLoop\._run|SchedulingCycle\."),
        ("submissions (parse, validate, group commit)", r"JobService\.submit|SubmitFastPath"),
        ("assignment polls (agents' long polls)", r"Assignments\.(answer|assignments)"),
        ("bridge: output query", r"LogService\.read_logs|logs_query"),
        ("bridge: event feed", r"routers/events\.py|EventService|read_events"),
        ("bridge: flow run ids", r"flow_runs|FlowRun"),
        ("HTTP server and middleware", r"uvicorn|starlette|fastapi"),
    ],
    "agent": [
        ("launching tasks (records, uid lease, spawn)", r"ProcessBackend\.launch"),
        ("reading run states (list, status)", r"ProcessBackend\.(list|status)"),
        ("reports to the control plane (HTTP)", r"NodeAgent\._report"),
        ("assignment watch (HTTP long poll, reconcile)", r"NodeAgent\._watch"),
        ("log shipping", r"_ship_logs|new_output"),
        ("metrics exporter", r"monitoring/"),
    ],
    "bridge": [
        ("reading Apiary's events", r"source\.py|JobEventSource"),
        ("recording a batch (recorder, ledger)", r"recorder\.py|ledger\.py"),
        ("flow runs (create / set state)", r"FlowRunWriter|flowruns\.py"),
        ("task run events, logs, artifacts", r"task_runs|_flush_artifacts|create_logs|logs\(\)"),
    ],
    "server": [
        ("POST /flow_runs/ and set_state", r"prefect/server/api/flow_runs\.py"),
        ("POST /artifacts/", r"prefect/server/api/artifacts\.py"),
        ("POST /logs/", r"prefect/server/api/logs\.py"),
        ("POST /events (ingest)", r"prefect/server/api/events\.py"),
        ("event persister", r"event_persister"),
        ("task run recorder", r"task_run_recorder"),
        ("triggers (automations)", r"events/triggers|events/actions"),
        ("other services", r"prefect/server/services/"),
        ("HTTP server and middleware", r"uvicorn|starlette|fastapi"),
        ("SQL (SQLAlchemy/asyncpg, caller lost across greenlets)", r"sqlalchemy|asyncpg"),
    ],
}
WAITS = ("Connection.wait", "EpollSelector.select", "Condition.wait", "Event.wait", "Queue.get", "(sleep")


def summarize(kind: str, paths: list[str]) -> list[tuple[str, float]]:
    """``(step, share of the busy samples)`` for ``kind`` over the raw files, largest first.
    Raises KeyError for an unknown kind."""
    rules = [(name, re.compile(p)) for name, p in RULES[kind]]
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip()
                if not line:
                    continue
                stack, n = line.rsplit(" ", 1)
                frames = stack.split(";")
                if any(w in frames[-1] for w in WAITS):
                    continue
                total += int(n)
                step = next((name for name, rx in rules if any(rx.search(fr) for fr in frames)), "other")
                counts[step] += int(n)
    return [(k, v / total) for k, v in counts.most_common()] if total else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(RULES))
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for step, share in summarize(args.kind, args.files):
        print(f"{share * 100:5.1f}%  {step}")


if __name__ == "__main__":
    main()
