"""Job traces: the Philly job list and Apiary's generic CSV.

**Philly** (``timestamp,duration,num_gpus,gpu_time,cluster``): ``timestamp`` is the submission time
(``YYYY-MM-DD HH:MM:SS``), ``duration`` the run time in seconds, ``num_gpus`` the GPUs, ``cluster``
the virtual cluster.  Every job is ``prod`` priority (100) and gang scheduled.

**Generic CSV** (header required; unknown columns ignored)::

    submit_s,duration_s,gpus,vc,priority,gang,name
    0,3600,8,research,prod,true,train-1

``submit_s`` simulated seconds, ``duration_s`` run time, ``gpus`` count (>= 1), ``vc`` virtual cluster;
optional ``priority`` (crit/prod/test/oppo or an int in -1..1000, default prod), ``gang``
(true/false, default true), ``name`` (default ``job-<row>``).

Jobs are sorted by submission time (stable: file order breaks ties) and their times shifted so the
first submission is at 0.

**Task split**: a job of ``n`` GPUs becomes one task role ``train`` of ``instances`` tasks:
``n <= 8`` -> one task of ``n`` GPUs; ``n > 8`` -> ``ceil(n / 8)`` tasks of 8 GPUs (so a 12-GPU job
holds 2 x 8 = 16 GPUs, as it would on 8-GPU machines).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from apiary.errors import ValidationError
from apiary.scheduler.types import PRIORITY_CLASSES

TASK_GPUS = 8


@dataclass(frozen=True)
class TraceJob:
    name: str
    submit: float
    duration: float
    gpus: int
    vc: str
    priority: int = 100
    gang: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        """(tasks, GPUs per task) by the task split rule."""
        return task_split(self.gpus)

    @property
    def gpu_time(self) -> float:
        return self.duration * self.gpus


def task_split(gpus: int) -> tuple[int, int]:
    if gpus <= TASK_GPUS:
        return 1, gpus
    return math.ceil(gpus / TASK_GPUS), TASK_GPUS


def _priority(value: str, where: str) -> int:
    v = (value or "").strip()
    if not v:
        return PRIORITY_CLASSES["prod"]
    if v in PRIORITY_CLASSES:
        return PRIORITY_CLASSES[v]
    try:
        p = int(v)
    except ValueError:
        raise ValidationError(where, f"priority {v!r} is not crit/prod/test/oppo or an integer") from None
    if p != -1 and not 0 <= p <= 1000:
        raise ValidationError(where, f"priority {p} is neither -1 nor in 0..1000")
    return p


def _bool(value: str, where: str) -> bool:
    v = (value or "").strip().lower()
    if v in ("", "1", "true", "yes", "y"):
        return True
    if v in ("0", "false", "no", "n"):
        return False
    raise ValidationError(where, f"not a boolean: {value!r}")


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceJob]:
    """Load a Philly or generic CSV trace (told apart by the header), first ``limit`` rows of the file
    (before sorting) when given."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise ValidationError("trace", f"{path} is empty") from None
        rows: list[list[str]] = []
        for row in reader:
            if limit is not None and len(rows) >= limit:
                break
            if row and "".join(row).strip():
                rows.append(row)
    if {"timestamp", "duration", "num_gpus", "cluster"} <= set(header):
        jobs = _philly(header, rows, path)
    elif {"submit_s", "duration_s", "gpus", "vc"} <= set(header):
        jobs = _generic(header, rows, path)
    else:
        raise ValidationError(
            "trace", f"{path}: unknown header {header}; expected Philly (timestamp,duration,num_gpus,gpu_time,cluster)"
            " or generic (submit_s,duration_s,gpus,vc[,priority,gang,name])"
        )
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].submit, i))
    t0 = jobs[order[0]].submit if jobs else 0.0
    return [
        TraceJob(j.name, j.submit - t0, j.duration, j.gpus, j.vc, j.priority, j.gang) for j in (jobs[i] for i in order)
    ]


def _philly(header: list[str], rows: list[list[str]], path) -> list[TraceJob]:
    ix = {h: i for i, h in enumerate(header)}
    out = []
    cache: dict[str, float] = {}
    for n, row in enumerate(rows, start=2):
        try:
            stamp = row[ix["timestamp"]].strip()
            t = cache.get(stamp)
            if t is None:
                t = cache[stamp] = datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()
            gpus = int(float(row[ix["num_gpus"]]))
            duration = float(row[ix["duration"]])
        except (ValueError, IndexError):
            raise ValidationError("trace", f"{path} line {n}: bad row {row}") from None
        if gpus < 1:
            raise ValidationError("trace", f"{path} line {n}: num_gpus must be >= 1")
        out.append(TraceJob(f"job-{n - 1}", t, max(duration, 0.0), gpus, row[ix["cluster"]].strip()))
    return out


def _generic(header: list[str], rows: list[list[str]], path) -> list[TraceJob]:
    ix = {h: i for i, h in enumerate(header)}

    def col(row, name, default=""):
        i = ix.get(name)
        return row[i] if i is not None and i < len(row) else default

    out = []
    for n, row in enumerate(rows, start=2):
        where = f"{path} line {n}"
        try:
            submit = float(col(row, "submit_s"))
            duration = float(col(row, "duration_s"))
            gpus = int(float(col(row, "gpus")))
        except ValueError:
            raise ValidationError("trace", f"{where}: bad number in {row}") from None
        if gpus < 1 or duration < 0:
            raise ValidationError("trace", f"{where}: gpus must be >= 1 and duration_s >= 0")
        vc = col(row, "vc").strip()
        if not vc:
            raise ValidationError("trace", f"{where}: vc is empty")
        name = col(row, "name").strip() or f"job-{n - 1}"
        out.append(TraceJob(name, submit, duration, gpus, vc, _priority(col(row, "priority"), where),
                            _bool(col(row, "gang"), where)))
    return out


def trace_stats(jobs: list[TraceJob]) -> tuple[dict[str, float], dict[str, int]]:
    """Per VC: GPU time (GPU-seconds) and the largest job (GPUs)."""
    gt: dict[str, float] = {}
    big: dict[str, int] = {}
    for j in jobs:
        gt[j.vc] = gt.get(j.vc, 0.0) + j.gpu_time
        big[j.vc] = max(big.get(j.vc, 0), j.gpus)
    return gt, big
