"""The two runners the chaos and load drills call, behind one small function each.

The runners belong to other packages (:mod:`apiary.chaos.runner`, :mod:`apiary.load.runner`);
these adapters are the only place that knows their signatures, so a change there is a change
here. A runner that is not installed fails the drill loudly (PlatformError naming the module),
never silently.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apiary.errors import PlatformError
from apiary.spec.safeyaml import load as safe_load_yaml

#: Experiments the chaos drill runs: tagged with one of these in the chaostoolkit file.
DRILL_TAGS = ("drill", "ci")
#: An experiment tagged so may stop or disturb users' guaranteed jobs: only with allow_disruptive.
DISRUPTIVE_TAG = "disrupts-guaranteed-jobs"


@dataclass
class ExperimentResult:
    name: str
    passed: bool
    reasons: list[str] = field(default_factory=list)
    journal: str | None = None
    path: str = ""


@dataclass
class LoadResult:
    passed: bool
    summary: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    report: str | None = None


def _runner(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise PlatformError(f"{module} is not installed ({e}); the drill cannot run") from e


def _with_abort(fn: Any, kwargs: dict[str, Any], abort: threading.Event | None) -> dict[str, Any]:
    """``kwargs`` plus ``abort`` when the runner takes it (then it stops early on the guard's abort)."""
    if abort is not None and "abort" in inspect.signature(fn).parameters:
        return {**kwargs, "abort": abort}
    return kwargs


def experiment_tags(path: Path) -> set[str]:
    """The ``tags`` of a chaostoolkit experiment (JSON or YAML)."""
    try:
        doc = safe_load_yaml(path.read_text(), field=str(path))  # JSON is YAML
    except Exception:  # unreadable: not a drill experiment (the chaos tests check the files)
        return set()
    tags = doc.get("tags") if isinstance(doc, dict) else None
    return {str(t) for t in tags} if isinstance(tags, list) else set()


def chaos_experiments(directory: Path, tags: tuple[str, ...] = DRILL_TAGS, *, allow_disruptive: bool = False,
                      names: list[str] | None = None) -> list[Path]:
    """The experiment files in ``directory`` tagged with one of ``tags`` (or named in ``names``:
    file names or stems), without those tagged :data:`DISRUPTIVE_TAG` unless ``allow_disruptive``."""
    files = sorted(p for p in directory.glob("*") if p.suffix in (".json", ".yaml", ".yml"))
    picked = []
    for p in files:
        t = experiment_tags(p)
        if names is not None:
            if p.name not in names and p.stem not in names:
                continue
        elif not t & set(tags):
            continue
        if DISRUPTIVE_TAG in t and not allow_disruptive:
            continue
        picked.append(p)
    return picked


def run_chaos_experiment(path: Path, *, api_url: str, token: str | None, home: Path, journal_dir: Path,
                         timeout_s: float, abort: threading.Event | None = None) -> ExperimentResult:
    """One experiment through ``apiary.chaos.runner.run_experiment`` -> its Verdict."""
    runner = _runner("apiary.chaos.runner")
    fn = runner.run_experiment
    kwargs = _with_abort(fn, {"api_url": api_url, "token": token, "home": home, "journal_dir": journal_dir,
                              "timeout_s": timeout_s}, abort)
    verdict = fn(path, **kwargs)
    return ExperimentResult(name=str(getattr(verdict, "name", path.stem)), passed=bool(verdict.passed),
                            reasons=[str(r) for r in (getattr(verdict, "reasons", None) or [])],
                            journal=str(getattr(verdict, "journal", "") or "") or None, path=str(path))


def run_load(*, api_url: str, token: str | None, home: Path, profile: str, duration_s: float | None,
             out_dir: Path, abort: threading.Event | None = None) -> LoadResult:
    """One load run through ``apiary.load.runner`` (see the module doc: adjusted to its signature)."""
    runner = _runner("apiary.load.runner")
    fn = runner.run_profile
    kwargs = _with_abort(fn, {"api_url": api_url, "token": token, "home": home, "duration_s": duration_s,
                              "out_dir": out_dir}, abort)
    res = fn(profile, **kwargs)
    return LoadResult(passed=bool(getattr(res, "passed", False)), summary=dict(getattr(res, "summary", {}) or {}),
                      reasons=[str(r) for r in (getattr(res, "reasons", None) or [])],
                      report=str(getattr(res, "report", "") or "") or None)
