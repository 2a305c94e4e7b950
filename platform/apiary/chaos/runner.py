"""Run one chaostoolkit experiment against a platform and judge it: :func:`run_experiment`.

``chaos run`` runs as a subprocess (its own process: the extension keeps per-run state in module
globals, and a crash of an activity cannot take the caller down) with the platform in its
environment (``APIARY_API_URL``, ``APIARY_TOKEN``, ``APIARY_HOME``; for a many-hosts deployment
also ``APIARY_DEPLOYMENT`` and ``APIARY_CA_CERT``), rollbacks always played
(``--rollback-strategy always``), no log file and no update check. The verdict comes from the
journal alone (:func:`apiary.chaos.journal.judge`), never from the exit code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from apiary.auth.bootstrap import read_token
from apiary.chaos.journal import judge, phase_durations
from apiary.chaos.target import LEDGER_ENV, load_deployment
from apiary.errors import ValidationError

logger = logging.getLogger(__name__)

#: After the timeout, chaostoolkit gets SIGTERM and this long to play its rollbacks before SIGKILL.
GRACE_S = 60.0


@dataclass(frozen=True)
class Verdict:
    """How one experiment went.

    ``name``: the experiment file's stem (``kill-control-plane``); ``title``: its title.
    ``passed``: the journal says completed, not deviated, steady state met before and after, every
    method activity succeeded (or is tolerated), every rollback ran and succeeded. ``reasons``: one
    sentence per failed condition (empty when passed), naming the probe, activity or rollback.
    ``journal``: the journal file (None if chaostoolkit wrote none). ``log``: chaostoolkit's output.
    ``durations``: seconds per phase (``before``, ``method``, ``after``, ``rollbacks``, ``total``
    from the journal) and ``wall`` (the subprocess, start to exit). ``accepted_jobs``: the jobs the
    experiment got the platform to accept. ``exit_code``: chaostoolkit's, for the record only.
    """

    name: str
    title: str
    passed: bool
    reasons: list[str]
    journal: Path | None
    log: Path
    durations: dict[str, float] = field(default_factory=dict)
    accepted_jobs: list[str] = field(default_factory=list)
    exit_code: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["journal"] = str(self.journal) if self.journal else None
        d["log"] = str(self.log)
        return d


def chaos_executable() -> str:
    """``chaos`` next to this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "chaos"
    if beside.exists():
        return str(beside)
    found = shutil.which("chaos")
    if found is None:
        raise FileNotFoundError("chaostoolkit's `chaos` is not installed (pip install chaostoolkit)")
    return found


def run_experiment(path: str | os.PathLike, *, api_url: str | None = None, token: str | None = None,
                   home: str | os.PathLike | None = None, journal_dir: str | os.PathLike, timeout_s: float = 600.0,
                   env: dict[str, str] | None = None, deployment: str | os.PathLike | None = None,
                   ca_cert: str | os.PathLike | None = None) -> Verdict:
    """Run the experiment at ``path`` against the platform at ``api_url`` (one URL, or the
    replicas' URLs comma-separated; ``token``: an admin's; ``home``: the platform home, for the
    actions that need pids or files) and judge its journal, written to
    ``journal_dir/<name>.journal.json`` (chaostoolkit's output beside it, ``<name>.log``; the
    accepted job ids in ``<name>.accepted``). ``timeout_s`` bounds the whole run: then
    chaostoolkit is interrupted (SIGTERM; it plays the rollbacks within :data:`GRACE_S`) and the
    verdict fails with that reason. ``env``: more environment for the run.

    ``deployment``: the root of a many-hosts deployment (its ``deployment.json``), given to the
    run as ``APIARY_DEPLOYMENT``; ``api_url``, ``token`` and ``ca_cert`` default to its replicas'
    URLs, its admin token and its CA, and no ``APIARY_HOME`` is passed on unless ``home`` is
    given. ``ca_cert``: the platform CA HTTPS is verified against (``APIARY_CA_CERT``).

    Never raises for a failing experiment; raises FileNotFoundError when ``path`` or ``chaos`` is
    missing, ValidationError when neither ``api_url`` nor ``deployment`` names the platform or the
    deployment's description is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no experiment at {path}")
    extra: dict[str, str] = {}
    if deployment is not None:
        root = Path(deployment).expanduser().resolve()
        described = load_deployment(root)
        api_url = api_url or ",".join(described["apiUrls"])
        token = token or read_token(Path(described["tokenFile"]))
        ca_cert = ca_cert or described.get("caCert")
        extra["APIARY_DEPLOYMENT"] = str(root)
    if not api_url:
        raise ValidationError("apiary_url", "no platform: give api_url or a deployment")
    if ca_cert:
        extra["APIARY_CA_CERT"] = str(Path(ca_cert).expanduser().resolve())
    name = path.name.split(".")[0]
    out = Path(journal_dir)
    out.mkdir(parents=True, exist_ok=True)
    journal_path, log_path, ledger = (out / f"{name}.journal.json", out / f"{name}.log", out / f"{name}.accepted")
    for p in (journal_path, ledger):
        p.unlink(missing_ok=True)
    run_env = {**os.environ, **(env or {}), **extra, "APIARY_API_URL": api_url, LEDGER_ENV: str(ledger),
               "PYTHONUNBUFFERED": "1"}
    if deployment is not None and home is None:
        run_env.pop("APIARY_HOME", None)  # this machine's home is not the deployment's
    if token:
        run_env["APIARY_TOKEN"] = token
    if home is not None:
        run_env["APIARY_HOME"] = str(Path(home).expanduser().resolve())
    argv = [chaos_executable(), "--no-version-check", "--no-log-file",
            "--settings", str(out / "chaostoolkit-settings.yaml"),  # none: not the user's controls
            "run", "--journal-path", str(journal_path), "--rollback-strategy", "always", str(path.resolve())]
    reasons: list[str] = []
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=run_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            reasons.append(f"timed out after {timeout_s:.0f} s (interrupted; rollbacks given {GRACE_S:.0f} s)")
            code = _interrupt(proc)
    wall = round(time.monotonic() - t0, 2)
    title = name
    journal = None
    if journal_path.exists():
        try:
            journal = json.loads(journal_path.read_text())
        except ValueError as e:
            reasons.append(f"unreadable journal {journal_path}: {e}")
    if journal is None:
        reasons.append(f"chaos exited {code} without a journal (invalid experiment?): {_tail(log_path)}")
        durations = {"wall": wall}
    else:
        title = str((journal.get("experiment") or {}).get("title") or name)
        reasons += judge(journal)
        durations = {**phase_durations(journal), "wall": wall}
    accepted = ledger.read_text().split() if ledger.exists() else []
    verdict = Verdict(name=name, title=title, passed=not reasons, reasons=reasons,
                      journal=journal_path if journal is not None else None, log=log_path, durations=durations,
                      accepted_jobs=accepted, exit_code=code)
    logger.info("chaos experiment=%s passed=%s wall_s=%.1f reasons=%s", name, verdict.passed, wall, reasons)
    return verdict


def _interrupt(proc: subprocess.Popen) -> int | None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)
    except ProcessLookupError:
        return proc.poll()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _tail(path: Path, n: int = 600) -> str:
    """The end of chaostoolkit's output, on one line, without its colours."""
    try:
        text = _ANSI.sub("", path.read_text(errors="replace"))
    except OSError:
        return "(no output)"
    return " ".join(text[-n:].split())
