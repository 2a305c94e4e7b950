"""The /proc reader behind task uid leases agrees with the kernel's own answer (os.getresuid) and
with psutil's, and tells zombies apart."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from apiary.runtime import isolation


def test_proc_uids_reads_this_process_and_agrees_with_psutil() -> None:
    rows = {pid: (uids, zombie) for pid, uids, zombie in isolation._proc_uids()}
    assert rows[os.getpid()] == (tuple(os.getresuid()), False)
    for pid, (uids, _zombie) in list(rows.items())[:50]:
        try:
            expected = psutil.Process(pid).uids()
        except psutil.Error:
            continue  # gone since
        assert uids == (expected.real, expected.effective, expected.saved), pid


def test_a_zombie_reads_as_one() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while True:  # not reaped: it stays a zombie until wait()
        parsed = isolation._status_uids(child.pid)
        if parsed is not None and parsed[1]:
            break
        assert time.monotonic() < deadline, "the exited child never read as a zombie"
        time.sleep(0.05)
    child.wait()
    assert isolation._status_uids(child.pid) is None or not isolation._status_uids(child.pid)[1]
