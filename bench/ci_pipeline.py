"""``ci.stage_s``: the wall time of each ``platform-ci`` stage, full profile, on this machine.

One pull request's pipeline, as :func:`apiary.ci.run.ci_pipeline` runs it inside the Prefect flow
(here without Prefect: the stages are plain calls, Prefect's per-task overhead is ~0.1 s each):
checkout of this working tree's snapshot from a local bare repository, ``make lint test-fast``
(the full unit suite), Apiary's four images built from the workspace and pushed to a registry on
loopback (Docker's layer cache warm from earlier builds on the machine, as on a CI worker),
a staging platform of containers, tests/staging against it (Lab 6 job + scenarios 1-3), the
Locust smoke profile, the CI chaos experiment(s) and the quick benchmark. Target (the CI/CD
issue): a PR pipeline <= 15 minutes (bench/thresholds.yaml ``ci.total_s``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support.gitrepo: the same snapshot as the end-to-end test

from tests.support.gitrepo import snapshot  # noqa: E402


def measure_pipeline(profile: str = "full") -> dict[str, Any]:
    """Run the pipeline once; ``{"stage_s": {stage: s}, "total_s", "result", "failed_stage", "profile"}``.
    Raises RuntimeError when the pipeline did not pass (its report names the stage)."""
    from apiary.ci.config import CiConfig
    from apiary.ci.pipeline import Commit
    from apiary.ci.run import ci_pipeline
    from apiary.images.build import BASE_IMAGE, build_base
    from apiary.images.daemons import Registry, docker_client, ensure_dockerd
    from apiary.tracking.prefect_server import free_port

    root = Path(tempfile.mkdtemp(prefix="apiary-bench-ci-"))
    dockerd = ensure_dockerd(root / "dockerd.log")  # None when one was running already
    client = docker_client()
    try:
        client.images.get(BASE_IMAGE)
    except Exception:  # docker.errors.ImageNotFound: once per machine
        build_base(client)
    registry = Registry(root / "registry", free_port()).start(root / "registry.log")
    try:
        _src, bare, sha = snapshot(root)
        config = CiConfig(repo_url=str(bare), registry=registry.address, profile=profile,
                          workdir=root / "work", artifacts=root / "artifacts")
        commit = Commit(repo="bench/apiary", clone_url=str(bare), sha=sha, ref="bench", pr_number=1)
        t0 = time.monotonic()
        report = ci_pipeline(commit, config)
        total = time.monotonic() - t0
    finally:
        registry.stop()
        if dockerd is not None:  # only a dockerd this benchmark started
            dockerd.terminate()
            dockerd.wait(30)
    out = {"stage_s": {o.name: round(o.duration_s, 1) for o in report.outcomes}, "total_s": round(total, 1),
           "result": report.result, "failed_stage": report.first_failure.name if report.first_failure else None,
           "profile": profile, "artifacts": str(root / "artifacts")}
    if not report.passed:
        raise RuntimeError(f"the pipeline did not pass: {report.description()} (artifacts in {root / 'artifacts'})")
    shutil.rmtree(root, ignore_errors=True)
    out.pop("artifacts")
    return out


def method(section: dict[str, Any]) -> str:
    return ("one platform-ci run (profile " + str(section.get("profile", "full")) + ") of a snapshot of this working "
            "tree from a local bare repository, stages as plain calls (apiary.ci.run.ci_pipeline), images built "
            "with Docker's layer cache warm, registry on loopback; stage_s = each stage's wall seconds")
