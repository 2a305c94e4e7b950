"""Per-task resource use, measured on real subprocesses (process groups like the process runtime's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from tests.monitoring.helpers import parse, scrape, value

from apiary.monitoring.tasks import TaskCollector, group_members, platform_pids

LABELS = dict(job="alice~train", user="alice", virtual_cluster="vc1", task_role="worker", Hostname="node-t")


@pytest.fixture
def spawn():
    procs = []

    def start(cmd: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, start_new_session=True)  # group leader, as the process runtime's wrapper
        procs.append(p)
        return p

    yield start
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def task(index: int, pid: int, gpus: list[int]) -> dict:
    return {**{k: v for k, v in LABELS.items() if k != "Hostname"}, "index": index, "pid": pid, "gpus": gpus}


def wait_members(pgid: int, n: int) -> list[int]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        members = group_members([pgid])[pgid]
        if len(members) >= n:
            return members
        time.sleep(0.02)
    raise AssertionError(f"group {pgid} never had {n} members")


def test_sleep_task(spawn):
    # a wrapper shell with a child in its group, like ``bash wrapper.sh`` running the task's commands
    p = spawn(["sh", "-c", "sleep 30 & sleep 30; wait"])
    members = wait_members(p.pid, 3)
    tasks = [task(0, p.pid, [1])]
    collector = TaskCollector("node-t", lambda: tasks, gpu_util=lambda: {0: 10.0, 1: 87.0})
    scrape(collector)
    time.sleep(0.2)
    s = parse(scrape(collector))
    assert value(s, "apiary_task_memory_bytes", index="0", **LABELS) > 1024 * 1024  # RSS of 3 processes
    assert 0 <= value(s, "apiary_task_cpu_ratio", index="0", **LABELS) < 0.5
    assert value(s, "apiary_task_gpu_utilization_ratio", index="0", gpu="1", **LABELS) == pytest.approx(0.87)
    assert [x.labels["gpu"] for x in s["apiary_task_gpu_utilization_ratio"]] == ["1"]
    assert set(members) <= platform_pids(lambda: tasks)()


def test_busy_task_cpu(spawn):
    p = spawn([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 10: pass"])
    wait_members(p.pid, 1)
    tasks = [task(3, p.pid, [])]
    collector = TaskCollector("node-t", lambda: tasks)
    scrape(collector)
    time.sleep(0.5)
    s = parse(scrape(collector))
    assert value(s, "apiary_task_cpu_ratio", index="3", **LABELS) > 0.2  # ~1.0 on an idle machine
    assert "apiary_task_gpu_utilization_ratio" not in s


def test_exited_task_reports_zero(spawn):
    p = spawn(["true"])
    p.wait()
    s = parse(scrape(TaskCollector("node-t", lambda: [task(0, p.pid, [])])))
    assert value(s, "apiary_task_memory_bytes", index="0", **LABELS) == 0
    assert value(s, "apiary_task_cpu_ratio", index="0", **LABELS) == 0


def test_no_tasks():
    s = parse(scrape(TaskCollector("node-t", lambda: [])))
    assert "apiary_task_cpu_ratio" not in s


def test_gpu_process_in_a_new_session_is_still_the_tasks(spawn):
    from apiary.monitoring.gpu import GpuCollector, GpuSample

    p = spawn(["sh", "-c", "setsid sleep 30 & wait"])
    deadline = time.monotonic() + 5
    child = None
    while child is None and time.monotonic() < deadline:
        kids = [c for c in psutil.Process(p.pid).children() if c.name() == "sleep"]
        child = kids[0].pid if kids and os.getpgid(kids[0].pid) != p.pid else None
        time.sleep(0.02)
    assert child is not None and child not in group_members([p.pid])[p.pid]

    class Source:
        kind = "nvml"

        def status(self):
            return True, "", "x"

        def samples(self):
            return [GpuSample(index=0, uuid="GPU-x", name="X", device="nvidia0", process_pids=(child, os.getppid()))]

    tasks = [task(0, p.pid, [0])]
    s = parse(scrape(GpuCollector(Source(), "node-t", task_pids=platform_pids(lambda: tasks))))
    assert value(s, "apiary_gpu_foreign_processes", Hostname="node-t", gpu="0") == 1  # only the pytest parent
