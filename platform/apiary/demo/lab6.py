"""``apiary demo lab6``: the AI-System Lab 6 scenarios on a fresh embedded platform.

The job files are Lab 6's own (``examples/lab6/job-config-*.yaml``, copied unmodified from
``shared/reference/lab6``). The one documented override: ``sleep 5m`` in their commands becomes
``sleep <--sleep>`` seconds so the demo takes minutes, not half an hour. Jobs built here for the
scenarios that Lab 6 describes without a file (a test job in VC default, the 4-GPU gang and the
4-instance incremental job) are derived from Lab 6 files and printed in the observation.

Scenarios 1-3 run on ``hived-config-two-vcs.yaml`` (VC default = hostname-carol, VC vc1 =
hostname-dan), 4-5 on ``hived-config-one-vc.yaml`` (both nodes in VC default); every node has one
simulated GPU. Each scenario reports PASS or FAIL with what it observed, once (:func:`report`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from apiary.client import ApiaryClient, Tenants
from apiary.embedded import REPO_ROOT, Embedded
from apiary.errors import ApiaryError
from apiary.tracking.prefect_server import start_prefect_server

LAB6 = REPO_ROOT / "examples" / "lab6"
TIMEOUT_S = 180.0


@dataclass
class Outcome:
    scenario: str
    passed: bool
    observed: str


class ScenarioFailed(AssertionError):
    pass


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ScenarioFailed(message)


def job_text(n: int, sleep_s: int | None = None, **changes: Any) -> str:
    """Lab 6's job-config-N.yaml, with ``sleep 5m`` -> ``sleep <sleep_s>`` when ``sleep_s`` is given;
    ``changes`` (field paths with dots, e.g. ``**{"taskRoles.train.instances": 4}``) build the
    derived jobs of the scenarios that Lab 6 describes without a file."""
    text = (LAB6 / f"job-config-{n}.yaml").read_text()
    if sleep_s is not None:
        text = text.replace("sleep 5m", f"sleep {sleep_s}")
    if not changes:
        return text
    doc = yaml.safe_load(text)
    for dotted, value in changes.items():
        node = doc
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return yaml.safe_dump(doc, sort_keys=False)


def ts(value: str | None) -> float:
    """Unix seconds of an API timestamp; ScenarioFailed when the task has none (never started or
    never finished)."""
    if not value:
        raise ScenarioFailed("a task has no start or completion time")
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def until(pred: Callable[[], object], timeout: float = TIMEOUT_S, what: str = "condition", poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise ScenarioFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def task_running(c: Tenants, job_id: str, count: int = 1) -> dict | None:
    job = c.get(job_id)
    return job if sum(t["state"] == "RUNNING" for t in job["tasks"]) >= count else None


def nodes_ready(c: Tenants, n: int) -> bool:
    return sum(bool(x["ready"]) for x in c.nodes()) >= n


def done(c: Tenants, job_id: str) -> dict:
    return c.wait(job_id, timeout=TIMEOUT_S, poll_s=0.2)


# ---------------------------------------------------------------------- scenarios
def vc_safety(c: Tenants, sleep_s: int) -> str:
    ids = [c.submit(job_text(0, sleep_s), user=u)["id"] for u in ("alice", "bob", "carol")]
    waiting = until(lambda: next((j for j in (c.get(i) for i in ids) if j["state"] == "WAITING" and
                                  j["waitingReason"]), None), what="a waiting job with a reason")
    jobs = [done(c, i) for i in ids]
    check(all(j["state"] == "SUCCEEDED" for j in jobs), f"states {[j['state'] for j in jobs]}")
    nodes = {t["node"] for j in jobs for t in j["tasks"]}
    check(nodes == {"hostname-dan"}, f"vc1 jobs ran on {nodes}, expected only hostname-dan")
    spans = sorted((ts(j["tasks"][0]["startTime"]), ts(j["tasks"][0]["completionTime"])) for j in jobs)
    overlaps = sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1])
    check(overlaps == 0, f"{overlaps} runs overlapped on the single vc1 GPU")
    return (f"3 x job-config-0 (prod, vc1) ran one at a time on hostname-dan, never on idle hostname-carol; "
            f"a queued one waited: \"{waiting['waitingReason']}\"")


def priority_preemption(c: Tenants, sleep_s: int) -> str:
    low = c.submit(job_text(1, sleep_s), user="alice")["id"]
    until(lambda: task_running(c, low), what="job-config-1 running")
    t_submit = time.time()
    high = c.submit(job_text(2, sleep_s), user="bob")["id"]
    preempted = until(lambda: (j := c.get(low))["retryDetails"]["platform"] >= 1 and j, what="job-config-1 preempted")
    t_preempted = time.time() - t_submit
    until(lambda: task_running(c, high), what="job-config-2 running")
    j_high, j_low = done(c, high), done(c, low)
    check(j_high["state"] == "SUCCEEDED" and j_low["state"] == "SUCCEEDED",
          f"states high={j_high['state']} low={j_low['state']}")
    check(j_low["retryDetails"] == {"user": 0, "platform": 1}, f"job-config-1 retryDetails {j_low['retryDetails']}")
    check(ts(j_low["tasks"][0]["startTime"]) >= ts(j_high["tasks"][0]["completionTime"]) - 0.5,
          "job-config-1 restarted before job-config-2 finished")
    return (f"job-config-1 (test) preempted {t_preempted:.1f} s after job-config-2 (prod) arrived, waited "
            f"(\"{preempted['waitingReason']}\"), re-ran after it; both SUCCEEDED, job-config-1 retryDetails "
            f"{j_low['retryDetails']}")


def opportunistic(c: Tenants, sleep_s: int) -> str:
    prod = c.submit(job_text(3, sleep_s), user="alice")["id"]
    until(lambda: task_running(c, prod), what="job-config-3 running")
    t0 = time.time()
    oppo = c.submit(job_text(4, sleep_s), user="bob")["id"]
    j = until(lambda: task_running(c, oppo), what="job-config-4 (oppo) running")
    started_in = time.time() - t0
    check(j["tasks"][0]["node"] == "hostname-carol", f"oppo job ran on {j['tasks'][0]['node']}, not idle carol")
    test_job = c.submit(job_text(5, sleep_s, name="test-in-default", **{"extras.hivedScheduler.jobPriorityClass":
                                                                        "test"}), user="carol")["id"]
    until(lambda: c.get(oppo)["retryDetails"]["platform"] >= 1, what="job-config-4 preempted")
    j_test = until(lambda: task_running(c, test_job), what="the test job running")
    check(j_test["tasks"][0]["node"] == "hostname-carol", "test job not on hostname-carol")
    j_oppo = done(c, oppo)
    check(j_oppo["state"] == "SUCCEEDED", f"job-config-4 {j_oppo['state']}")
    check(done(c, prod)["state"] == "SUCCEEDED" and done(c, test_job)["state"] == "SUCCEEDED", "others failed")
    return (f"job-config-4 (oppo, vc1) started {started_in:.1f} s after submission on idle hostname-carol (VC "
            f"default); a test job in VC default preempted it; it resumed on {j_oppo['tasks'][0]['node']} when a "
            f"cell freed and SUCCEEDED (retryDetails {j_oppo['retryDetails']})")


def gang(c: Tenants, sleep_s: int) -> str:
    holder = c.submit(job_text(5, sleep_s), user="alice")["id"]
    until(lambda: task_running(c, holder), what="job-config-5 running")
    g = c.submit(job_text(6, sleep_s), user="alice")["id"]
    j = until(lambda: (x := c.get(g))["waitingReason"] and x, what="job-config-6 waiting reason")
    while True:
        # Read the gang first, then the holder: a placement seen while the holder is still RUNNING
        # afterwards is a real violation; the other order races with the holder finishing in between.
        j = c.get(g)
        if c.get(holder)["state"] != "RUNNING":
            break
        check(all(t["node"] is None for t in j["tasks"]), f"gang partially placed: {j['tasks']}")
        time.sleep(0.2)
    j = done(c, g)
    check(j["state"] == "SUCCEEDED", f"job-config-6 {j['state']}")
    check(all(t["startTime"] for t in j["tasks"]), f"not both instances started: {j['tasks']}")
    starts = [ts(t["startTime"]) for t in j["tasks"]]
    spread = max(starts) - min(starts)
    check(spread < 2.0, f"instances started {spread:.1f} s apart")
    return (f"job-config-6 (gang of 2) waited with both instances unplaced while job-config-5 held a node; "
            f"then both started together ({spread:.2f} s apart) and it SUCCEEDED")


def incremental(c: Tenants, sleep_s: int) -> str:
    holder = c.submit(job_text(5, 60), user="bob")["id"]
    until(lambda: task_running(c, holder), what="job-config-5 running")
    inc = c.submit(job_text(7, sleep_s), user="bob")["id"]
    j = until(lambda: task_running(c, inc), what="job-config-7 instance running")
    waiting = [t for t in j["tasks"] if t["state"] == "WAITING"]
    check(len(waiting) == 1, f"expected one instance waiting, got {[t['state'] for t in j['tasks']]}")
    c.stop(holder)  # the user frees the other node
    j = until(lambda: (x := c.get(inc))["tasks"][waiting[0]["index"]]["startTime"] and x,
              what="second instance started")
    starts = sorted(ts(t["startTime"]) for t in j["tasks"])
    check(done(c, inc)["state"] == "SUCCEEDED", "job-config-7 did not succeed")
    # Quota rejection of a gang job bigger than the VC.
    try:
        c.submit(job_text(6, sleep_s, name="gang-4-gpus", **{"taskRoles.train.instances": 4}), user="bob")
        check(False, "a gang job asking for 4 GPUs in the 2-GPU VC was accepted")
    except ApiaryError as e:
        check(e.status_code == 400 and "Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default." in e.message,
              f"wrong rejection: {e.status_code} {e.message}")
        rejection = e.message
    four = c.submit(job_text(7, sleep_s, name="incremental-4", **{
        "taskRoles.train.instances": 4, "taskRoles.train.completion.minSucceededInstances": -1,
        "taskRoles.train.commands": [f"sleep {sleep_s}"]}), user="bob")["id"]
    j4 = done(c, four)
    check(j4["state"] == "SUCCEEDED", f"incremental-4 {j4['state']}")
    spans = [(ts(t["startTime"]), ts(t["completionTime"])) for t in j4["tasks"]]
    peak = max(sum(1 for s, e in spans if s <= at < e) for at, _ in spans)
    check(peak == 2, f"incremental-4 ran {peak} instances at once, expected 2")
    return (f"job-config-7 (gangAllocation: false) started one instance at once, the other "
            f"{starts[1] - starts[0]:.1f} s later when a node freed; gang 4-GPU job rejected: \"{rejection}\"; "
            f"non-gang 4-instance job accepted and ran {peak} at a time")


SCENARIOS_TWO_VCS = [
    ("1 VC safety", vc_safety),
    ("2 priority and preemption", priority_preemption),
    ("3 opportunistic", opportunistic),
]
SCENARIOS_ONE_VC = [("4 gang", gang), ("5 incremental", incremental)]
SCENARIO_COUNT = len(SCENARIOS_TWO_VCS) + len(SCENARIOS_ONE_VC)


def run_scenarios(admin: ApiaryClient, scenarios, sleep_s: int) -> list[Outcome]:
    """Run ``scenarios`` with ``admin`` (the platform's first admin) creating Lab 6's users."""
    client = Tenants(admin)
    until(lambda: nodes_ready(client, 2), 60, "both node agents")
    out = []
    for name, fn in scenarios:
        try:
            out.append(Outcome(name, True, fn(client, sleep_s)))
        except (ScenarioFailed, ApiaryError, TimeoutError) as e:
            out.append(Outcome(name, False, str(e)))
    return out


def run_demo(console: Console, *, prefect: bool = True, sleep_s: int = 4, keep: bool = False,
             runtime: str = "process") -> bool:
    """Run all five scenarios, print their results (:func:`report`); True only if all passed.
    ``runtime="docker"``: every task is a container; each platform's registry gets the mnist
    image (Lab 6's ``openpai/pai.example.pytorch`` through the image map) before its scenarios."""
    home = Path(tempfile.mkdtemp(prefix="apiary-demo-"))
    results: list[Outcome] = []
    server = start_prefect_server(home / "prefect") if prefect else None
    try:
        if server:
            console.print(f"Prefect UI: {server.ui_url} (flow 'apiary-job': one flow run per job). It stops when "
                          "the demo ends; for a UI that stays, run a platform with apiary up.")
        for cluster, scenarios in (("hived-config-two-vcs.yaml", SCENARIOS_TWO_VCS),
                                   ("hived-config-one-vc.yaml", SCENARIOS_ONE_VC)):
            platform = Embedded(home=home / cluster.removesuffix(".yaml"), cluster=LAB6 / cluster,
                                prefect=prefect, prefect_api_url=server.api_url if server else None,
                                workdir=str(REPO_ROOT), runtime=runtime)
            with platform:
                console.print(f"[dim]{cluster}: API {platform.api_url}[/dim]")
                if platform.registry is not None:
                    from apiary.images.build import build_example
                    from apiary.images.daemons import docker_client

                    image = build_example(docker_client(), "mnist", platform.registry.address)
                    console.print(f"[dim]{cluster}: pushed {image}[/dim]")
                results += run_scenarios(platform.client(), scenarios, sleep_s)
    finally:
        if server:
            server.stop()
        if keep:
            console.print(f"state kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    report(console, results)
    return len(results) == SCENARIO_COUNT and all(r.passed for r in results)


def report(console: Console, results: list[Outcome]) -> None:
    """Print each scenario's result once: a table on a terminal, one plain line per scenario
    (``PASS <scenario>: <observed>``) where the output goes to a log or a pipe (CI)."""
    if console.is_terminal:
        table = Table("scenario", "result", "observed", title="AI-System Lab 6 on Apiary", show_lines=True)
        for r in results:
            table.add_row(r.scenario, "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]", r.observed)
        console.print(table)
    else:
        for r in results:
            console.print(f"{'PASS' if r.passed else 'FAIL'} {r.scenario}: {r.observed}", markup=False,
                          highlight=False, soft_wrap=True)
    console.print(f"{sum(r.passed for r in results)} of {SCENARIO_COUNT} scenarios passed.", highlight=False)
