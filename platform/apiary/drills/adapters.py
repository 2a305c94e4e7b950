"""The two runners the chaos and load drills call, behind one small function each.

The runners belong to other packages: :func:`apiary.chaos.runner.run_experiment` (chaostoolkit in
a subprocess, judged from its journal) and :func:`apiary.load.runner.run_load` (Locust in a
subprocess, judged by a gate file). These adapters are the only place that knows their
signatures. A runner that is not installed fails the drill loudly (PlatformError naming the
module), never silently.

**Abort.** Neither runner takes an abort signal: each runs its tool as a child process and waits.
When the guard aborts, :func:`interrupt` sends SIGTERM to that child (found among this process's
children by a path only this run uses: the journal, the output folder), as the runners do on their
own timeouts: chaostoolkit then plays the experiment's rollbacks (the runner always passes
``--rollback-strategy always``), Locust stops and writes its statistics; the runner returns a
verdict as usual, which says it was interrupted.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from apiary.errors import PlatformError
from apiary.spec.safeyaml import load as safe_load_yaml

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Experiments the chaos drill runs: tagged with one of these in the chaostoolkit file.
DRILL_TAGS = ("drill", "ci")
#: An experiment tagged so may stop or disturb users' guaranteed jobs: only with allow_disruptive.
DISRUPTIVE_TAG = "disrupts-guaranteed-jobs"
#: Left out of the scheduled drill unless named: they need root and a setup of their own (a network
#: namespace, a tmpfs under the platform home), which a live platform does not have.
SKIP_TAGS = ("root",)


@dataclass
class ExperimentResult:
    name: str
    passed: bool
    reasons: list[str] = field(default_factory=list)
    journal: str | None = None
    path: str = ""


@dataclass
class LoadResult:
    """``report``: the load runner's markdown report (plots embedded)."""

    passed: bool
    summary: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    report: str | None = None
    out_dir: str | None = None


def _runner(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise PlatformError(f"{module} is not installed ({e}); the drill cannot run") from e


def interrupt(marker: str) -> list[int]:
    """SIGTERM to this process's descendants whose command line contains ``marker``: to the
    process group of a session leader (chaostoolkit runs in its own session), to the process
    alone otherwise (Locust's ``timeout`` wrapper shares ours). Returns the pids signalled."""
    hit = []
    for child in psutil.Process().children(recursive=True):
        try:
            if marker not in " ".join(child.cmdline()):
                continue
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGTERM)
            else:
                child.terminate()
            hit.append(child.pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue  # it ended meanwhile
    return hit


def _abortable(call: Callable[[], T], abort: threading.Event | None, marker: str, what: str) -> T:
    """``call()``, interrupting its child process (:func:`interrupt` with ``marker``) if ``abort``
    is set before it returns."""
    if abort is None:
        return call()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if abort.wait(0.5):
                if not done.is_set():
                    logger.warning("drill abort: interrupting %s pids=%s", what, interrupt(marker))
                return

    watcher = threading.Thread(target=watch, name=f"abort-{what}", daemon=True)
    watcher.start()
    try:
        return call()
    finally:
        done.set()


def experiment_tags(path: Path) -> set[str]:
    """The ``tags`` of a chaostoolkit experiment (JSON or YAML)."""
    try:
        doc = safe_load_yaml(path.read_text(), field=str(path))  # JSON is YAML
    except Exception:  # unreadable: not a drill experiment (the chaos tests check the files)
        return set()
    tags = doc.get("tags") if isinstance(doc, dict) else None
    return {str(t) for t in tags} if isinstance(tags, list) else set()


def chaos_experiments(directory: Path, tags: tuple[str, ...] = DRILL_TAGS, *, allow_disruptive: bool = False,
                      names: list[str] | None = None, skip_tags: tuple[str, ...] = ()) -> list[Path]:
    """The experiment files in ``directory`` tagged with one of ``tags``, or named in ``names``
    (file names or stems; then no tag is needed). Left out: experiments tagged
    :data:`DISRUPTIVE_TAG` unless ``allow_disruptive``, and those tagged with one of ``skip_tags``
    (unless named)."""
    files = sorted(p for p in directory.glob("*") if p.suffix in (".json", ".yaml", ".yml"))
    picked = []
    for p in files:
        t = experiment_tags(p)
        if names is not None:
            if p.name not in names and p.stem not in names:
                continue
        elif not t & set(tags) or t & set(skip_tags):
            continue
        if DISRUPTIVE_TAG in t and not allow_disruptive:
            continue
        picked.append(p)
    return picked


def run_chaos_experiment(path: Path, *, api_url: str, token: str | None, home: Path, journal_dir: Path,
                         timeout_s: float, abort: threading.Event | None = None) -> ExperimentResult:
    """One experiment through ``apiary.chaos.runner.run_experiment`` -> its Verdict."""
    runner = _runner("apiary.chaos.runner")
    journal = journal_dir / f"{path.name.split('.')[0]}.journal.json"  # the runner's name for it
    verdict = _abortable(lambda: runner.run_experiment(path, api_url=api_url, token=token, home=home,
                                                       journal_dir=journal_dir, timeout_s=timeout_s),
                         abort, str(journal), f"chaos {path.stem}")
    return ExperimentResult(name=str(verdict.name), passed=bool(verdict.passed),
                            reasons=[str(r) for r in verdict.reasons],
                            journal=str(verdict.journal) if verdict.journal else None, path=str(path))


def run_load(*, api_url: str, token: str | None, profile: str, duration_s: float | None, out_dir: Path,
             abort: threading.Event | None = None) -> LoadResult:
    """One load run through ``apiary.load.runner.run_load``: its gates, the jobs check and the
    per-endpoint numbers as the summary; its markdown report (plots embedded) for an artifact.
    The engineers' jobs are opportunistic (``oppo``): a drill on a live cluster never takes
    capacity from a guaranteed job."""
    runner = _runner("apiary.load.runner")
    from apiary.load.report import markdown

    if not token:
        raise PlatformError("the load drill needs an admin token (APIARY_DRILL_TOKEN or APIARY_HOME/token)")
    out_dir.mkdir(parents=True, exist_ok=True)
    res = _abortable(lambda: runner.run_load(api_url, token, profile=profile, duration_s=duration_s,
                                             out_dir=out_dir, job={"priority": "oppo"}),
                     abort, str(out_dir), f"load {profile}")
    agg = res.endpoint("Aggregated")
    summary: dict[str, Any] = {
        "users": res.users, "durationS": res.duration_s, "agents": res.agents,
        "jobsAccepted": res.jobs.accepted, "jobsLost": len(res.jobs.lost),
        "gatesFailed": sum(not r.passed for r in res.rows), "gates": len(res.rows),
    }
    if agg is not None:
        summary.update({"requests": agg.requests, "failures": agg.failures, "p50Ms": agg.p50_ms,
                        "p99Ms": agg.p99_ms, "rps": round(agg.rps, 2)})
    reasons = [f"{r.endpoint} {r.metric}: {r.measured} (threshold {r.threshold}) {r.note}".strip()
               for r in res.rows if not r.passed]
    return LoadResult(passed=bool(res.passed), summary=summary, reasons=reasons, report=markdown(res),
                      out_dir=str(res.out_dir))
