"""Probes: the steady state of the platform and what a method checks.

Each returns a value when what it checks holds and raises :class:`~apiary.chaos.SteadyStateViolation`
(naming what it saw) when it does not; experiments give them ``"tolerance": true``. The steady state
of every shipped experiment, checked before and after its method:

1. :func:`api_healthy`: ``/healthz`` answers 200, for this home's cluster id;
2. :func:`probe_job_within_slo`: a ``sleep 1`` job goes from submission to SUCCEEDED within the SLO;
3. :func:`consistency_holds`: ``GET /api/v2/cluster/consistency`` (the store against the
   scheduler's memory) finds nothing;
4. :func:`no_accepted_job_lost`: every job this run got accepted (202) is still listed;
5. :func:`no_task_ran_twice`: no task run (job, attempt, task role, index) has two
   ``task.started`` events.

Every wait polls with a deadline.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from apiary.chaos import SteadyStateViolation
from apiary.chaos.target import Target, accepted_jobs, job_text, record_accepted, unique_name
from apiary.client import ApiaryClient, http_verify
from apiary.errors import ApiaryError, UnavailableError
from apiary.lifecycle.exitspec import classify_exit, exit_spec

logger = logging.getLogger(__name__)

T = TypeVar("T")
Configuration = Mapping[str, Any] | None
FINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def poll(pred: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.25) -> T:
    """``pred()``'s first truthy value; SteadyStateViolation after ``timeout_s`` without one. An
    unreachable API counts as "not yet"."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            value = pred()
            if value:
                return value
        except (UnavailableError, httpx.HTTPError) as e:
            last = e
        if time.monotonic() >= deadline:
            why = f" (last error: {last})" if last else ""
            raise SteadyStateViolation(f"timed out after {timeout_s:.0f} s waiting for {what}{why}")
        time.sleep(every_s)


# ------------------------------------------------------------------------------ the steady state
def api_healthy(timeout_s: float = 30.0, configuration: Configuration = None) -> bool:
    """``/healthz`` answers 200 within ``timeout_s`` (a restarting control plane gets that long), as
    the cluster recorded in ``home/cluster-id`` when the home is known."""
    t = Target.of(configuration)
    expected = None
    if t.home is not None and (t.home / "cluster-id").exists():
        expected = (t.home / "cluster-id").read_text().strip()
    with closing(t.client(timeout=5.0)) as c:
        health = poll(c.health, timeout_s, f"GET {t.api_url}/healthz")
    if expected and health.get("clusterId") != expected:
        raise SteadyStateViolation(f"{t.api_url} answers as cluster {health.get('clusterId')}, not {expected}")
    return True


def probe_job_within_slo(slo_s: float | None = None, vc: str | None = None, command: str = "sleep 1",
                         configuration: Configuration = None) -> bool:
    """Submit a tiny job (``command``, one GPU, priority prod, VC ``vc`` or the configured probe VC)
    and wait until it SUCCEEDED (the seconds it took are logged). Raises if it failed or took longer
    than ``slo_s`` (default: the configured SLO); a job still running then is stopped."""
    t = Target.of(configuration)
    slo = float(slo_s) if slo_s is not None else t.probe_slo_s
    name = unique_name("chaos-probe")
    t0 = time.monotonic()
    with closing(t.client()) as c:
        try:
            job_id = c.submit(job_text(name, vc or t.probe_vc, [command]))["id"]
        except ApiaryError as e:
            raise SteadyStateViolation(f"probe job refused: {e}") from e
        record_accepted(job_id)
        try:
            job = poll(lambda: _final(c, job_id), slo, f"probe job {job_id} to finish within its SLO")
        except SteadyStateViolation:
            state = _state(c, job_id)
            _stop_quietly(c, job_id)
            raise SteadyStateViolation(f"probe job {job_id} still {state} after its SLO of {slo:.0f} s") from None
    took = time.monotonic() - t0
    if job["state"] != "SUCCEEDED":
        raise SteadyStateViolation(f"probe job {job_id} ended {job['state']} (exit code {job.get('exitCode')} "
                                   f"{job.get('exitPhrase')})")
    logger.info("probe job=%s succeeded in %.1f s (SLO %.0f s)", job_id, took, slo)
    return True


def consistency_holds(configuration: Configuration = None) -> bool:
    """The control plane's own check (``GET /api/v2/cluster/consistency``, admins only): every
    unreleased placement in the store is the scheduler's allocation and back, node health agrees."""
    t = Target.of(configuration)
    r = _admin_get(t, "/api/v2/cluster/consistency")
    if not r["consistent"]:
        raise SteadyStateViolation("store and scheduler disagree: " + "; ".join(r["problems"]))
    return True


def no_accepted_job_lost(configuration: Configuration = None) -> bool:
    """Every job the platform accepted during this run (probe jobs and jobs the method submitted) is
    still listed by ``GET /api/v2/jobs``."""
    t = Target.of(configuration)
    jobs = accepted_jobs()
    if not jobs:
        return True
    with closing(t.client()) as c:
        listed: set[str] = set()
        for user in sorted({j.split("~", 1)[0] for j in jobs}):
            listed |= {j["id"] for j in c.list(username=user)}
    lost = [j for j in jobs if j not in listed]
    if lost:
        raise SteadyStateViolation(f"{len(lost)} accepted job(s) lost: {', '.join(lost)}")
    logger.info("no accepted job lost: %d checked", len(jobs))
    return True


def no_task_ran_twice(scope: str = "submitted", configuration: Configuration = None) -> bool:
    """No task run started twice: in ``/api/v2/events`` no (job, attempt, task role, index) has two
    ``task.started`` events. ``scope``: ``submitted`` (the jobs this run got accepted) or ``all``
    (every job on the platform; a job with ``taskRetryCount`` restarts an instance within an
    attempt, which this check cannot tell from a double start)."""
    if scope not in ("submitted", "all"):
        raise SteadyStateViolation(f"scope must be 'submitted' or 'all', not {scope!r}")
    t = Target.of(configuration)
    with closing(t.client()) as c:
        if scope == "all":
            events = _all_events(c)
        else:
            events = [e for j in accepted_jobs() for e in _all_events(c, j)]
    started: dict[tuple, int] = {}
    for e in events:
        if e["type"] != "task.started":
            continue
        d = e["data"]
        key = (e["jobId"], d.get("attempt"), d.get("taskRole"), d.get("index"))
        started[key] = started.get(key, 0) + 1
    twice = [f"{k[0]} attempt {k[1]} {k[2]}/{k[3]} ({n} starts)" for k, n in sorted(started.items()) if n > 1]
    if twice:
        raise SteadyStateViolation("task run(s) started twice: " + "; ".join(twice))
    logger.info("no task ran twice: %d task runs checked", len(started))
    return True


# ------------------------------------------------------------------------------ method checks
def nodes_ready(nodes: list[str] | None = None, timeout_s: float = 60.0, configuration: Configuration = None) -> list:
    """The ``nodes`` (default: every node) report ready within ``timeout_s``."""
    t = Target.of(configuration)
    with closing(t.client()) as c:
        def ready() -> list[str] | None:
            got = {n["name"]: n["ready"] for n in c.nodes()}
            want = nodes or sorted(got)
            return want if all(got.get(n) for n in want) else None
        return poll(ready, timeout_s, f"nodes {nodes or 'all'} ready")


def nodes_lost(nodes: list[str] | None = None, timeout_s: float = 90.0, configuration: Configuration = None) -> list:
    """The control plane declares the ``nodes`` (default: every node) lost (not ready) within
    ``timeout_s``: its ``APIARY_NODE_LOST_AFTER_S`` (30 s by default) and a scheduling tick."""
    t = Target.of(configuration)
    with closing(t.client()) as c:
        def lost() -> list[str] | None:
            got = {n["name"]: n["ready"] for n in c.nodes()}
            want = nodes or sorted(got)
            return want if all(not got.get(n) for n in want) else None
        return poll(lost, timeout_s, f"nodes {nodes or 'all'} declared lost")


def job_running(name: str, user: str | None = None, timeout_s: float = 60.0,
                configuration: Configuration = None) -> dict:
    """Job ``name`` (submitted by this run) has a RUNNING task within ``timeout_s``: the fault that
    follows meets work in flight. Returns where it runs."""
    t = Target.of(configuration)
    job_id = _accepted_id(name, user)
    with closing(t.client()) as c:
        def running() -> dict | None:
            job = c.get(job_id)
            if job["state"] in FINAL:
                raise SteadyStateViolation(f"job {job_id} ended {job['state']} before it was seen running")
            return job if any(x["state"] == "RUNNING" for x in job["tasks"]) else None
        job = poll(running, timeout_s, f"job {job_id} running")
    return {"job": job_id, "nodes": sorted({x["node"] for x in job["tasks"] if x["node"]})}


def job_succeeds(name: str, user: str | None = None, timeout_s: float = 120.0, max_attempt: int | None = None,
                 configuration: Configuration = None) -> dict:
    """Job ``name`` (submitted by this run; ``user`` to pick among several) ends SUCCEEDED within
    ``timeout_s``, in an attempt no later than ``max_attempt`` when given (0: its tasks were never
    re-run, e.g. re-adopted by a restarted agent). Returns state, attempt and retries."""
    t = Target.of(configuration)
    job_id = _accepted_id(name, user)
    with closing(t.client()) as c:
        job = poll(lambda: _final(c, job_id), timeout_s, f"job {job_id} to finish")
    if job["state"] != "SUCCEEDED":
        raise SteadyStateViolation(f"job {job_id} ended {job['state']} (exit code {job.get('exitCode')} "
                                   f"{job.get('exitPhrase')})")
    if max_attempt is not None and job["attempt"] > max_attempt:
        raise SteadyStateViolation(f"job {job_id} succeeded in attempt {job['attempt']}, later than {max_attempt} "
                                   f"(retries {job['retryDetails']})")
    return {"job": job_id, "state": job["state"], "attempt": job["attempt"], "retryDetails": job["retryDetails"]}


def job_failed_as(name: str, phrase: str, user: str | None = None, timeout_s: float = 120.0,
                  configuration: Configuration = None) -> dict:
    """Job ``name`` ends FAILED with the exit-spec entry ``phrase`` (its code and phrase on the job
    and its task), retried only as that entry's reaction allows (NEVER_RETRY: no user retry), and
    its log matches one of the entry's ``userLogRegex`` patterns. OpenPAI's patterns are checked as
    regular expressions and as literal text: the CUDA OOM one, ``cuda runtime error (2) : out of
    memory``, has unescaped parentheses, so as a regex it does not match the very message it quotes."""
    t = Target.of(configuration)
    job_id = _accepted_id(name, user)
    entry = next((e for e in exit_spec().values() if e.phrase == phrase), None)
    if entry is None:
        raise SteadyStateViolation(f"no exit-spec entry {phrase!r}")
    with closing(t.client()) as c:
        job = poll(lambda: _final(c, job_id), timeout_s, f"job {job_id} to finish")
        problems = []
        if job["state"] != "FAILED":
            problems.append(f"state {job['state']}, not FAILED")
        if job.get("exitCode") != entry.code or job.get("exitPhrase") != entry.phrase:
            problems.append(f"exit {job.get('exitCode')} {job.get('exitPhrase')}, not {entry.code} {entry.phrase}")
        task = job["tasks"][0] if job["tasks"] else {}
        if task.get("exitCode") != entry.code:
            problems.append(f"task exit code {task.get('exitCode')}, not {entry.code}")
        if entry.reaction == "NEVER_RETRY" and job["retryDetails"]["user"] != 0:
            problems.append(f"{job['retryDetails']['user']} user retries of a NEVER_RETRY exit")
        log = c.logs(job_id, task.get("taskRole"), task.get("index", 0)) if task else ""
        log += c.logs(job_id, task.get("taskRole"), task.get("index", 0), stream="stderr") if task else ""
    patterns = user_log_patterns(entry.code)
    if patterns and not any(re.search(p, log) or _literal(p) in log.lower() for p in patterns):
        problems.append(f"log matches none of {patterns}: {log[-300:]!r}")
    if problems:
        raise SteadyStateViolation(f"job {job_id}: " + "; ".join(problems))
    return {"job": job_id, "exitCode": job["exitCode"], "exitPhrase": job["exitPhrase"],
            "reaction": classify_exit(entry.code).reaction, "retryDetails": job["retryDetails"]}


def gpu_metric(node: str, metric: str, gpu: int = 0, at_least: float | None = None,
               equals: float | None = None, timeout_s: float = 30.0, configuration: Configuration = None) -> float:
    """The ``/metrics`` (dcgm-exporter names) of ``node``'s agent ("": the target's fault node)
    shows ``metric{gpu="<gpu>"}`` ``>= at_least`` or ``== equals`` within ``timeout_s`` (the agent
    applies a fault on its next long poll). Returns the value seen."""
    t = Target.of(configuration)
    node = node or t.fault_node
    with closing(t.client()) as c:
        url = next((n.get("metricsUrl") for n in c.nodes() if n["name"] == node), None)
    if not url:
        raise SteadyStateViolation(f"node {node} reports no metrics URL")
    seen: list[float] = []

    def check() -> bool:
        value = _scrape(url, metric, gpu, t.ca_cert)
        if value is None:
            return False
        seen.append(value)
        return (at_least is None or value >= at_least) and (equals is None or value == equals)

    try:
        poll(check, timeout_s, f"{metric}{{gpu={gpu}}} on {node}")
    except SteadyStateViolation:
        raise SteadyStateViolation(f"{metric}{{gpu=\"{gpu}\"}} on {node} is {seen[-1] if seen else 'absent'}, "
                                   f"wanted {'>= ' + str(at_least) if at_least is not None else '== ' + str(equals)}"
                                   ) from None
    return seen[-1]


def prefect_healthy(timeout_s: float = 60.0, configuration: Configuration = None) -> bool:
    """The platform's Prefect server (``home/run/urls.json``'s ``ui`` + ``/api/health``) answers."""
    import json

    t = Target.of(configuration)
    urls = json.loads((t.need_home() / "run" / "urls.json").read_text())
    if not urls.get("ui"):
        raise SteadyStateViolation("this platform runs no Prefect server")
    health = f"{urls['ui'].rstrip('/')}/api/health"
    poll(lambda: httpx.get(health, timeout=3.0).status_code == 200, timeout_s, f"GET {health}")
    return True


# ------------------------------------------------------------------------------ helpers
def user_log_patterns(code: int) -> list[str]:
    """The ``runtimeContainerPatterns[].userLogRegex`` of exit-spec entry ``code`` (apiary.lifecycle
    ships the spec verbatim but reads only its codes and meanings)."""
    text = resources.files("apiary.lifecycle").joinpath("k8s-job-exit-spec.yaml").read_text(encoding="utf-8")
    for raw in yaml.safe_load(text)["spec"]:
        if int(raw["code"]) == code:
            pats = (raw.get("pattern") or {}).get("runtimeContainerPatterns") or []
            return [p["userLogRegex"] for p in pats if "userLogRegex" in p]
    return []


def _literal(pattern: str) -> str:
    return re.sub(r"^\(\?[a-z]+\)", "", pattern).lower()


def _accepted_id(name: str, user: str | None) -> str:
    ids = [j for j in accepted_jobs() if j.split("~", 1)[1] == name or j.split("~", 1)[1].startswith(name + "-")]
    if user:
        ids = [j for j in ids if j.split("~", 1)[0] == user]
    if not ids:
        raise SteadyStateViolation(f"this run submitted no job named {name!r}")
    return ids[-1]


def _final(c: ApiaryClient, job_id: str) -> dict | None:
    job = c.get(job_id)
    return job if job["state"] in FINAL else None


def _state(c: ApiaryClient, job_id: str) -> str:
    try:
        return str(c.get(job_id)["state"])
    except ApiaryError as e:
        return f"unknown ({e})"


def _stop_quietly(c: ApiaryClient, job_id: str) -> None:
    try:
        c.stop(job_id)
    except ApiaryError:
        logger.warning("could not stop probe job=%s", job_id)


def _all_events(c: ApiaryClient, job_id: str | None = None) -> list[dict]:
    out: list[dict] = []
    after = 0
    while True:
        page = c.events(after=after, job_id=job_id, limit=5000)
        out += page
        if len(page) < 5000:
            return out
        after = page[-1]["seq"]


def _admin_get(t: Target, path: str) -> Any:
    try:
        r = t.request("GET", path)
    except httpx.HTTPError as e:
        raise SteadyStateViolation(f"GET {path}: {e}") from e
    if r.status_code != 200:
        raise SteadyStateViolation(f"GET {path}: {r.status_code} {r.text[:300]}")
    return r.json()


def _scrape(url: str, metric: str, gpu: int, ca_cert: Path | None = None) -> float | None:
    try:
        text = httpx.get(url, timeout=5.0, verify=http_verify(ca_cert)).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'gpu="{gpu}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None
