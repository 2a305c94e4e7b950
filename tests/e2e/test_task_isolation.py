"""A job on the default (process) runtime runs as a non-root uid and can read no file of the
platform: nothing under APIARY_HOME (the admin's token, the machine credentials, the store, the
other runs' records) and not the environment of the agent or the control plane."""

from __future__ import annotations

import os
import shlex

import pytest
from tests.support.builders import job_text
from tests.support.polling import done

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(os.geteuid() != 0, reason="the process runtime isolates tasks when the agent is root")
def test_a_job_runs_as_a_non_root_uid_and_reads_nothing_under_apiary_home(platform_factory):
    p, c = platform_factory()
    # One job first, so the agents' run records of a job exist among the files tried.
    first = c.submit(job_text(1, **{"taskRoles.train.commands": ["echo warm-up"]}), user="bob")["id"]
    assert done(c, first)["state"] == "SUCCEEDED"
    files = sorted(str(f) for f in p.home.rglob("*") if f.is_file())
    assert {str(p.home / "token"), str(p.home / "apiary.db")} <= set(files)
    assert any("/credentials/" in f for f in files) and any(f.endswith("launch.json") for f in files)
    pids = [child.proc.pid for child in p.children.values() if child.proc is not None]
    targets = files + [f"/proc/{pid}/environ" for pid in pids]
    commands = [
        "echo uid=$(id -u)",
        "tried=0; for f in " + " ".join(shlex.quote(t) for t in targets) + "; do "
        'tried=$((tried+1)); if head -c 1 "$f" >/dev/null 2>&1; then echo "READ $f"; fi; done; '
        "echo tried=$tried",
        f"if ls {shlex.quote(str(p.home))} >/dev/null 2>&1; then echo LISTED-home; fi",
    ]
    job = c.submit(job_text(1, **{"taskRoles.train.commands": commands}), user="alice")["id"]
    assert done(c, job)["state"] == "SUCCEEDED"
    out = c.logs(job, "train")
    words = dict(w.split("=", 1) for w in out.split() if w.startswith(("uid=", "tried=")))
    assert words.get("tried") == str(len(targets)), out  # every file was tried
    assert words["uid"] != "0", out
    assert [line for line in out.splitlines() if line.startswith(("READ", "LISTED"))] == [], out
