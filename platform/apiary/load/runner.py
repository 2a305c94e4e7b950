"""Run a load profile against a platform and judge it by its gate file.

:func:`run_load` is the whole thing (``apiary load run`` and the chaos drills call it):

1. **Prepare** the target with the admin token: one user per simulated engineer (``load-eng-NNN``,
   group ``default``: every VC; created once, kept), a personal token for each, with ``agents`` an
   agent token for every node whose real agent reports (``ready``), and the JSON tokens file the
   locustfiles read
   (``loadtests/apiary_users.py`` documents it). Tokens expire an hour after the run at the latest
   and are revoked at the end in any case.
2. **Run** Locust as a subprocess (it monkey-patches the standard library with gevent: never
   imported here), headless, under ``timeout -k 10``, with ``--json-file``, ``--csv`` and
   ``--csv-full-history`` into the output folder.
3. **Check jobs**: every id the locustfile recorded as accepted (202) must be listed by
   ``GET /api/v2/jobs?username=<its user>`` afterwards.
4. **Evaluate** the gate file (:mod:`apiary.load.gates`) and, unless asked not to, render the
   plots (:mod:`apiary.load.plots`).

The result (:class:`LoadResult`) holds the gate rows, the verdict and the paths of Locust's raw
output. Nothing here needs Prefect; :mod:`apiary.load.report` turns a result into Prefect artifacts.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apiary.client import ApiaryClient
from apiary.errors import ApiaryError, PlatformError, ValidationError
from apiary.load.gates import (
    EndpointStats,
    FailureStat,
    GateRow,
    JobCheck,
    evaluate,
    failures_from_csv,
    load_gates,
    passed,
    stats_from_csv,
    stats_from_json,
)
from apiary.load.profiles import get_profile

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
#: The locustfiles (one per profile) and the gate files (gates/<profile>.yaml).
LOADTESTS_DIR = REPO_ROOT / "loadtests"
ENGINEER_PREFIX = "load-eng-"
#: Seconds the run may take beyond the profile's duration (spawning, Locust's start and shutdown)
#: before ``timeout`` sends SIGTERM (Locust then still writes its statistics); SIGKILL 10 s later.
GRACE_S = 90.0


@dataclass
class Prepared:
    """What :func:`prepare` made on the target (the token ids are revoked by :func:`cleanup`)."""

    tokens_file: Path
    accepted_file: Path
    run_id: str
    virtual_cluster: str
    engineers: list[str]
    nodes: list[str]
    token_ids: list[str] = field(default_factory=list)


@dataclass
class LoadResult:
    """One load run, judged. ``rows`` are the gate checks (measured vs threshold, PASS/FAIL);
    ``endpoints`` Locust's per-endpoint numbers (with the ``Aggregated`` row)."""

    profile: str
    target: str
    users: int
    """Simulated people at the peak (engineers + operators)."""
    duration_s: float
    agents: int
    """Nodes with a simulated agent (two Locust users each: heartbeat and long poll)."""
    virtual_cluster: str
    gates_file: Path
    rows: list[GateRow]
    endpoints: list[EndpointStats]
    jobs: JobCheck
    locust_exit_code: int
    timed_out: bool
    out_dir: Path
    stats_json: Path
    stats_csv: Path
    history_csv: Path
    locust_log: Path
    failures: list[FailureStat] = field(default_factory=list)
    """Locust's distinct errors (``locust_failures.csv``), most frequent first."""
    plots: list[Path] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return passed(self.rows)

    def endpoint(self, key: str) -> EndpointStats | None:
        """The numbers of ``"<METHOD> <name>"`` (or ``"Aggregated"``), None if it had no request."""
        return next((e for e in self.endpoints if e.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile, "target": self.target, "users": self.users, "duration_s": self.duration_s,
            "agents": self.agents, "virtual_cluster": self.virtual_cluster, "passed": self.passed,
            "gates_file": str(self.gates_file), "rows": [r.to_dict() for r in self.rows],
            "endpoints": [e.to_dict() for e in self.endpoints],
            "jobs": {"accepted": self.jobs.accepted, "listed": self.jobs.listed, "lost": list(self.jobs.lost)},
            "failures": [{"endpoint": f.endpoint, "error": f.error, "occurrences": f.occurrences}
                         for f in self.failures],
            "locust_exit_code": self.locust_exit_code, "timed_out": self.timed_out, "wall_s": round(self.wall_s, 1),
            "out_dir": str(self.out_dir), "stats_json": str(self.stats_json), "stats_csv": str(self.stats_csv),
            "history_csv": str(self.history_csv), "locust_log": str(self.locust_log),
            "plots": [str(p) for p in self.plots],
        }


def locustfile(profile: str, loadtests_dir: Path = LOADTESTS_DIR) -> Path:
    get_profile(profile)  # ValueError for an unknown one
    path = loadtests_dir / f"{profile}.py"
    if not path.exists():
        raise PlatformError(f"no locustfile for profile {profile} at {path}")
    return path


def default_gates(profile: str, loadtests_dir: Path = LOADTESTS_DIR) -> Path:
    return loadtests_dir / "gates" / f"{profile}.yaml"


def pick_virtual_cluster(status: dict) -> str:
    """The VC with the largest quota (``default`` wins a tie, then the first by name)."""
    vcs = status.get("virtualClusters") or {}
    if not vcs:
        raise PlatformError("the target's cluster has no virtual cluster to submit to")
    return max(sorted(vcs), key=lambda n: (vcs[n].get("quota", 0), n == "default"))


def prepare(admin: ApiaryClient, admin_token: str, out_dir: Path, *, people: int, agents: bool = False,
            virtual_cluster: str | None = None, expires_in_s: float = 3600.0, job: dict | None = None) -> Prepared:
    """Create the run's users and tokens on the target (see the module doc) and write the tokens
    file into ``out_dir`` (mode 0600). ``job``: the job's ``gpus``, ``command``, ``image``,
    ``priority`` (defaults 1, ``sleep 1``, ``python:3.11-slim``, the platform's). On failure the
    tokens made so far are revoked before the error propagates."""
    out_dir.mkdir(parents=True, exist_ok=True)
    status = admin.cluster_status()
    vc = virtual_cluster or pick_virtual_cluster(status)
    if vc not in (status.get("virtualClusters") or {}):
        raise ValidationError("virtualCluster", f"the target has no virtual cluster {vc!r}")
    run_id = f"{int(time.time()):x}{secrets.token_hex(2)}"
    prep = Prepared(tokens_file=out_dir / "tokens.json", accepted_file=out_dir / "accepted.txt", run_id=run_id,
                    virtual_cluster=vc, engineers=[], nodes=[])
    description = f"apiary load run {run_id}"
    try:
        existing = {u["name"] for u in admin.users()}
        engineers = []
        for i in range(max(1, people)):
            name = f"{ENGINEER_PREFIX}{i:03d}"
            if name not in existing:
                admin.create_user(name)
            new = admin.create_token(name, description=description, expires_in_s=expires_in_s)
            prep.token_ids.append(new["id"])
            engineers.append({"user": name, "token": new["token"]})
            prep.engineers.append(name)
        nodes = []
        if agents:
            for n in admin.nodes():
                if not n.get("ready"):
                    logger.info("load: node=%s has no reporting agent: no simulated agent for it", n["name"])
                    continue
                new = admin.create_token(n["name"], kind="agent", description=description, expires_in_s=expires_in_s)
                prep.token_ids.append(new["id"])
                nodes.append({"node": n["name"], "token": new["token"], "gpus": n.get("gpus", 0),
                              "simulatedGpus": n.get("simulatedGpus"), "address": n.get("address"),
                              "metricsUrl": n.get("metricsUrl")})
                prep.nodes.append(n["name"])
    except BaseException:
        cleanup(admin, prep)
        raise
    job = job or {}
    doc = {
        "runId": run_id, "virtualCluster": vc, "gpus": int(job.get("gpus", 1)),
        "command": job.get("command", "sleep 1"), "image": job.get("image", "python:3.11-slim"),
        "priority": job.get("priority"), "acceptedFile": str(prep.accepted_file),
        "engineers": engineers, "operators": [{"user": "admin", "token": admin_token}], "agents": nodes,
    }
    prep.accepted_file.write_text("")
    fd = os.open(prep.tokens_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return prep


def cleanup(admin: ApiaryClient, prep: Prepared) -> None:
    """Revoke the run's tokens (the users stay: their jobs do) and delete the tokens file. Never raises."""
    for token_id in prep.token_ids:
        try:
            admin.revoke_token(token_id)
        except ApiaryError as e:
            logger.warning("load: could not revoke token id=%s: %s", token_id, e.message)
    prep.token_ids.clear()
    prep.tokens_file.unlink(missing_ok=True)


def check_jobs(admin: ApiaryClient, prep: Prepared) -> JobCheck:
    """Accepted ids (the locustfile's file) vs the ids ``GET /api/v2/jobs?username=`` lists."""
    text = prep.accepted_file.read_text(encoding="utf-8") if prep.accepted_file.exists() else ""
    accepted = list(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
    listed: set[str] = set()
    for user in sorted({a.split("~", 1)[0] for a in accepted}):
        listed |= {j["id"] for j in admin.list(username=user)}
    lost = tuple(a for a in accepted if a not in listed)
    return JobCheck(accepted=len(accepted), listed=len(accepted) - len(lost), lost=lost)


def run_locust(file: Path, target: str, env: dict[str, str], out_dir: Path, limit_s: float) -> tuple[int, bool]:
    """Locust headless in a subprocess under ``timeout -k 10 limit_s``; ``(exit code, timed out)``.
    Output: ``stats.json``, ``locust_stats.csv``, ``locust_stats_history.csv``, ``locust.log`` and
    ``locust.out`` (its stdout and stderr) in ``out_dir``."""
    argv = [
        "timeout", "-k", "10", str(int(limit_s)),
        sys.executable, "-m", "locust", "--headless", "-f", str(file), "--host", target,
        "--json-file", str(out_dir / "stats"), "--csv", str(out_dir / "locust"), "--csv-full-history",
        "--only-summary", "--logfile", str(out_dir / "locust.log"), "--loglevel", "INFO",
    ]
    logger.info("load: %s", " ".join(argv))
    with (out_dir / "locust.out").open("wb") as out:
        proc = subprocess.run(argv, env=env, cwd=out_dir, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    return proc.returncode, proc.returncode in (124, 137)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<none>"


def run_load(
    target: str,
    token: str,
    *,
    profile: str = "smoke",
    gates: Path | str | None = None,
    users: int | None = None,
    duration_s: float | None = None,
    out_dir: Path | str | None = None,
    agents: bool = False,
    plots: bool = True,
    virtual_cluster: str | None = None,
    job: dict | None = None,
    loadtests_dir: Path = LOADTESTS_DIR,
) -> LoadResult:
    """Run ``profile`` (smoke, ramp, steady, spike: :data:`apiary.load.profiles.PROFILES`) against the
    platform at ``target`` with the admin ``token``, judge it by ``gates`` (default
    ``loadtests/gates/<profile>.yaml``), and return the result; ``users`` (people at the peak) and
    ``duration_s`` override the profile's. ``agents=True`` adds one simulated node agent per ready
    node on top of the real ones (heartbeats with an empty run list, assignment long polls): off by
    default, because each simulated heartbeat changes the node's recorded reporter and costs a store
    write, a heavier background than the real agents' (loadtests/README.md has the numbers), and
    because it keeps a node alive whose real agent a chaos drill killed.
    ``out_dir`` (default a new temporary folder) receives Locust's output and the plots.

    Raises ValueError for an unknown profile, ValidationError for a bad gate file or VC,
    UnavailableError when the target does not answer, and PlatformError when Locust wrote no
    statistics (its output is named). A failed gate is not an error: see ``result.passed``."""
    t0 = time.monotonic()
    prof = get_profile(profile)
    file = locustfile(profile, loadtests_dir)
    gates_path = Path(gates) if gates is not None else default_gates(profile, loadtests_dir)
    gate_spec = load_gates(gates_path)  # a bad gate file fails before anything is created on the target
    people = users if users is not None else prof.users
    duration = float(duration_s if duration_s is not None else prof.duration_s)
    if people < 1 or duration <= 0:
        raise ValidationError("users" if people < 1 else "duration", "must be positive")
    if out_dir is None:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix=f"apiary-load-{profile}-"))
    else:
        out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    admin = ApiaryClient(target, token=token, timeout=60)
    try:
        prep = prepare(admin, token, out, people=people, agents=agents, virtual_cluster=virtual_cluster,
                       expires_in_s=duration + 3600, job=job)
        try:
            env = {**os.environ, "APIARY_LOAD_TOKENS_FILE": str(prep.tokens_file), "APIARY_LOAD_PROFILE": profile,
                   "APIARY_LOAD_USERS": str(people), "APIARY_LOAD_DURATION_S": f"{duration:g}",
                   "PYTHONUNBUFFERED": "1"}
            logger.info("load: profile=%s target=%s people=%d agents=%d duration_s=%g vc=%s out=%s", profile,
                        target, people, len(prep.nodes), duration, prep.virtual_cluster, out)
            code, timed_out = run_locust(file, target, env, out, duration + GRACE_S)
        finally:
            cleanup(admin, prep)
        stats_json, stats_csv = out / "stats.json", out / "locust_stats.csv"
        if stats_json.exists():
            endpoints = stats_from_json(stats_json)
        elif stats_csv.exists():
            endpoints = stats_from_csv(stats_csv)
        else:
            raise PlatformError(f"Locust wrote no statistics (exit {code}); its output ({out / 'locust.out'}) "
                                f"ends:\n{_tail(out / 'locust.out')}")
        jobs = check_jobs(admin, prep)
    finally:
        admin.close()
    rows = evaluate(gate_spec, endpoints, jobs)
    if timed_out:
        rows.append(GateRow("run", "finished", None, f"within {duration + GRACE_S:g} s", False,
                            "Locust was stopped by timeout"))
    result = LoadResult(
        profile=profile, target=target, users=people, duration_s=duration, agents=len(prep.nodes),
        virtual_cluster=prep.virtual_cluster, gates_file=gates_path, rows=rows, endpoints=endpoints, jobs=jobs,
        locust_exit_code=code, timed_out=timed_out, out_dir=out, stats_json=stats_json, stats_csv=stats_csv,
        history_csv=out / "locust_stats_history.csv", locust_log=out / "locust.log",
        failures=failures_from_csv(out / "locust_failures.csv"),
    )
    if plots and result.history_csv.exists():
        from apiary.load.plots import render

        result.plots = render(result.history_csv, out, title=f"({profile}, {people} people)")
    result.wall_s = time.monotonic() - t0
    (out / "result.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    logger.info("load: profile=%s passed=%s rows=%d failed=%d", profile, result.passed, len(rows),
                sum(not r.passed for r in rows))
    return result
