"""Per-task resource use on a node: CPU, RSS and GPU utilization of each running task.

A task is the process group its wrapper leads (``pgid == pid``, see :mod:`apiary.runtime.process`):
CPU and memory are summed over the live members of that group.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import psutil
from prometheus_client.core import GaugeMetricFamily, Metric

TASK_LABELS = ("job", "user", "virtual_cluster", "task_role", "index", "Hostname")

TaskList = Callable[[], Iterable[Mapping[str, Any]]]


def _all_pids() -> list[int]:
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return psutil.pids()


def group_members(pgids: Iterable[int]) -> dict[int, list[int]]:
    """``{pgid: [pids]}`` for the given process groups, in one pass over the process table."""
    wanted = {int(p) for p in pgids if p and int(p) > 1}
    out: dict[int, list[int]] = {p: [] for p in wanted}
    if not wanted:
        return out
    for pid in _all_pids():
        try:
            pgid = os.getpgid(pid)
        except OSError:  # exited meanwhile
            continue
        if pgid in wanted:
            out[pgid].append(pid)
    return out


def platform_pids(tasks: TaskList) -> Callable[[], set[int]]:
    """A ``task_pids`` callable for :class:`~apiary.monitoring.gpu.GpuCollector`: every pid in the
    process group of a running task (one pass over the process table). Processes a task started in
    another session are recognised by the GPU collector through their ancestry."""

    def pids() -> set[int]:
        leaders = [int(t["pid"]) for t in tasks() if t.get("pid")]
        out: set[int] = set(leaders)
        for members in group_members(leaders).values():
            out.update(members)
        return out

    return pids


class TaskCollector:
    """``apiary_task_*`` families for the tasks ``tasks()`` lists (dicts with ``job``, ``user``,
    ``virtual_cluster``, ``task_role``, ``index``, ``pid`` -- the process-group leader -- and ``gpus``,
    the node-local GPU indexes).

    ``apiary_task_cpu_ratio`` is CPU-seconds per second summed over the group's processes (1.0 = one
    core busy), from per-process ``cpu_times()`` deltas between scrapes; a process seen for the first
    time counts from its start. ``gpu_util`` returns ``{gpu index: utilization %}`` (the node's GPU
    collector provides it); a task's GPU utilization is that of its GPUs, which HiveD allocates exclusively.
    """

    def __init__(
        self,
        hostname: str,
        tasks: TaskList,
        *,
        gpu_util: Callable[[], Mapping[int, float]] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.hostname = hostname
        self._tasks = tasks
        self._gpu_util = gpu_util
        self._clock = clock
        self._lock = threading.Lock()
        # pid -> (create_time, cpu seconds, wall time) at the last scrape
        self._cpu: dict[int, tuple[float, float, float]] = {}
        self._procs: dict[int, psutil.Process] = {}

    def describe(self) -> Iterable[Metric]:
        return ()

    def _proc(self, pid: int) -> psutil.Process:
        proc = self._procs.get(pid)
        if proc is None or not proc.is_running():  # is_running also catches pid reuse
            proc = psutil.Process(pid)
            self._procs[pid] = proc
        return proc

    def _usage(self, members: list[int], now: float, seen: dict[int, tuple[float, float, float]]) -> tuple[float, int]:
        cpu_rate, rss = 0.0, 0
        for pid in members:
            try:
                proc = self._proc(pid)
                with proc.oneshot():
                    created = proc.create_time()
                    t = proc.cpu_times()
                    rss += proc.memory_info().rss
            except psutil.Error:
                self._procs.pop(pid, None)
                continue
            cpu = t.user + t.system
            prev = self._cpu.get(pid)
            if prev is None or prev[0] != created:
                prev = (created, 0.0, created)
            if now > prev[2]:
                cpu_rate += max(0.0, cpu - prev[1]) / (now - prev[2])
            seen[pid] = (created, cpu, now)
        return cpu_rate, rss

    def collect(self) -> Iterator[Metric]:
        tasks = list(self._tasks())
        labels = list(TASK_LABELS)
        cpu = GaugeMetricFamily(
            "apiary_task_cpu_ratio", "CPU-seconds per second used by the task's processes (1 = one core).",
            labels=labels,
        )
        mem = GaugeMetricFamily(
            "apiary_task_memory_bytes", "Resident memory (RSS) summed over the task's processes.", labels=labels
        )
        gpu = GaugeMetricFamily(
            "apiary_task_gpu_utilization_ratio", "Utilization of a GPU allocated to the task (0-1).",
            labels=[*labels, "gpu"],
        )
        if tasks:
            util = dict(self._gpu_util()) if self._gpu_util is not None and any(t.get("gpus") for t in tasks) else {}
            with self._lock:
                groups = group_members(int(t["pid"]) for t in tasks if t.get("pid"))
                now = self._clock()
                seen: dict[int, tuple[float, float, float]] = {}
                for t in tasks:
                    values = [
                        str(t.get("job", "")), str(t.get("user", "")), str(t.get("virtual_cluster", "")),
                        str(t.get("task_role", "")), str(t.get("index", "")), self.hostname,
                    ]
                    members = groups.get(int(t["pid"]), []) if t.get("pid") else []
                    rate, rss = self._usage(members, now, seen)
                    cpu.add_metric(values, rate)
                    mem.add_metric(values, float(rss))
                    for g in t.get("gpus") or ():
                        if int(g) in util:
                            gpu.add_metric([*values, str(g)], util[int(g)] / 100.0)
                self._cpu = seen
                for pid in list(self._procs):
                    if pid not in seen:
                        del self._procs[pid]
        yield cpu
        yield mem
        yield gpu
