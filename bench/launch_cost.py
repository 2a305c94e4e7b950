"""CPU a task launch costs the process runtime, in-process: the agent's launch path without HTTP.

Launches ``--tasks`` isolated ``echo hi`` tasks at ``--rate`` a second through
:class:`apiary.runtime.ProcessBackend` (every run's records, a task uid lease, the spawn), lists
their states every fifth launch and forgets the exited runs, as the agent does, then prints this
process's user and system CPU per launch (its children, the tasks, not counted). Needs root (the
tasks switch uids). Not part of run.py: bench/README.md ("The file system under the agent") used
it to compare the lease code before and after a change (run the old code with
``PYTHONPATH=<worktree>/platform``) and file systems (``--dir``).

    sudo .venv/bin/python bench/launch_cost.py --tasks 600 --rate 30 [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from apiary.runtime import ProcessBackend, TaskLaunch


def measure(tasks: int, rate: float, parent: str | None) -> dict[str, float]:
    """Launch ``tasks`` tasks at ``rate``/s under a new directory in ``parent``; returns
    ``{"user_ms", "sys_ms"}`` a launch and ``"wall_s"``. Raises RuntimeError when not every task
    exited within 30 s of the last launch."""
    root = Path(tempfile.mkdtemp(prefix="apiary-launch-cost-", dir=parent))
    try:
        backend = ProcessBackend(root / "state", allow_unisolated=False, task_uids="2000050000-2000059999",
                                 scratch_root=root / "scratch")
        done = 0

        def reap() -> int:
            n = 0
            for st in backend.list():
                if st.state == "exited":
                    backend.forget(st.run_id)
                    n += 1
            return n

        t0, c0 = time.monotonic(), os.times()
        for i in range(tasks):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            backend.launch(TaskLaunch(run_id=f"bench~j{i}.a0.r.0.t0", job_id=f"bench~j{i}", user="bench",
                                      job_name=f"j{i}", task_role="r", index=0, commands=["echo hi"], gpus=[]))
            if i % 5 == 0:
                done += reap()
        deadline = time.monotonic() + 30
        while done < tasks and time.monotonic() < deadline:
            done += reap()
            time.sleep(0.05)
        c1 = os.times()
        if done < tasks:
            raise RuntimeError(f"only {done} of {tasks} tasks exited")
        return {"user_ms": 1000 * (c1.user - c0.user) / tasks, "sys_ms": 1000 * (c1.system - c0.system) / tasks,
                "wall_s": time.monotonic() - t0}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=600)
    ap.add_argument("--rate", type=float, default=30.0, help="launches a second")
    ap.add_argument("--dir", help="where the run records and leases go (default: the system's temp dir)")
    args = ap.parse_args()
    r = measure(args.tasks, args.rate, args.dir)
    print(f"tasks={args.tasks} user_ms={r['user_ms']:.2f} sys_ms={r['sys_ms']:.2f} wall_s={r['wall_s']:.1f}")


if __name__ == "__main__":
    main()
