"""The Prefect UI as a portal, in a real browser (headless Debian chromium through Selenium).

On a platform started as `apiary up` starts it (control plane, agents, Prefect server, bridge and
served deployments on loopback): fill the apiary-job / submit Custom run form field by field (no
JSON mode), submit, see the job in `apiary job list`, watch its run reach Completed in the UI,
then press Cancel on the run of a long CLI-submitted job and see Apiary report STOPPED.

Every wait polls the state it waits for (the page, the API) with a deadline sized for a loaded
2-core machine (:data:`LOADED_S`: Prefect's UI and server share it with the platform and other
work), and fails naming what it last saw.

Each step saves a screenshot (PNG + HTML) on failure under ``test-artifacts/portal/`` (or
``$APIARY_TEST_ARTIFACTS``). With ``APIARY_UPDATE_DOCS=1`` the filled form's screenshot is also
written to ``docs/prefect-submit-form.png`` (the README's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.browser import (
    cancel_flow_run,
    chrome_driver,
    field_errors,
    list_items,
    log_in,
    open_custom_run,
    open_flow_run,
    screenshot,
    screenshot_on_failure,
    select_options,
    select_value,
    set_number,
    set_run_name,
    set_string_list,
    set_text,
    state_badge,
    submit_custom_run,
    toast_messages,
    wait_for,
)
from tests.support.builders import LAB6, job_text
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prefect]

ARTIFACTS = Path(os.environ.get("APIARY_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts") / "portal"
#: The deadline of a wait for the UI or the platform on a loaded 2-core machine (load 5-9: a
#: submission the UI creates in 2 s on a quiet machine took over 30 s there).
LOADED_S = 120.0


def submit_and_wait(driver) -> str:
    """Submit the custom-run form and wait, up to :data:`LOADED_S`, until the UI has created the
    run (it leaves the form) or refused it; on a timeout, fail with the page, the form's messages
    and the toasts last seen."""
    try:
        return submit_custom_run(driver, timeout_s=LOADED_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last saw: url={driver.current_url} fields={field_errors(driver)} "
                             f"toasts={toast_messages(driver)}") from exc


def wait_for_badge(driver, want: str, timeout_s: float = LOADED_S) -> None:
    """Wait until the flow run page's state badge reads ``want``; on a timeout, fail naming the
    badge last seen (the page refreshes it by polling, a few seconds behind the API)."""
    seen: list[str] = []

    def reads(_) -> bool:
        seen.append(state_badge(driver))
        return seen[-1] == want

    try:
        wait_for(driver, reads, timeout_s, f"the run's badge to read {want}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the badge last read {seen[-1] if seen else 'nothing'!r}") from exc


def until_seen(probe, accept, timeout_s: float, what: str):
    """``probe()``'s first value that ``accept`` takes, polled every second up to ``timeout_s``;
    AssertionError naming ``what`` and the value last seen."""
    seen: list = []

    def attempt():
        seen[:] = [probe()]
        return seen[0] if accept(seen[0]) else None

    try:
        return until(attempt, timeout_s, what, poll_s=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last saw {seen[0] if seen else 'nothing'!r}") from exc


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    home = tmp_path_factory.mktemp("apiary")
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=True, workdir=str(REPO_ROOT))
    p.start()
    try:
        c = Tenants(p.client())
        until(lambda: nodes_ready(c, 2), LOADED_S, "node agents")
        yield p, c
    finally:
        p.stop()


@pytest.fixture
def driver():
    d = chrome_driver()
    try:
        yield d
    finally:
        d.quit()


def _deployment_id(api_url: str, auth_string: str | None, name: str) -> str:
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def q():
        async with PrefectClient(api=api_url, auth_string=auth_string) as client:
            return str((await client.read_deployment_by_name(name)).id)

    def attempt():
        try:
            return asyncio.run(q())
        except Exception:  # not served yet
            return None

    return until(attempt, LOADED_S, f"deployment {name}", poll_s=0.5)


def _cli_job_list(api_url: str, token: str) -> list[dict]:
    env = {**os.environ, "APIARY_API_URL": api_url, "APIARY_TOKEN": token}
    out = subprocess.run([sys.executable, "-m", "apiary", "job", "list", "--json"], env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def test_submit_from_the_form_watch_it_complete_and_cancel_a_long_job_from_the_ui(platform, driver):
    p, c = platform
    ui = p.ui_url
    deployment = _deployment_id(p.prefect_server.api_url, p.prefect_auth_string, "apiary-job/submit")
    c.create_user("grace")  # the form submits for users that exist
    grace = c.create_token("grace", description="browser test", expires_in_s=3600)["token"]

    with screenshot_on_failure(driver, ARTIFACTS, "0-login"):
        log_in(driver, ui, p.prefect_auth_string)  # apiary up protects the UI (the form trusts its user)
    with screenshot_on_failure(driver, ARTIFACTS, "1-form"):
        form = open_custom_run(driver, ui, deployment, via_menu=True, timeout_s=LOADED_S)
        set_run_name(driver, "browser-hello")
        set_text(driver, form, "Job name", "browser-hello")
        set_text(driver, form, "User", "grace")
        assert select_options(driver, form, "Virtual cluster") == ["default", "vc1"]  # the cluster's VCs
        select_value(driver, form, "Virtual cluster", "vc1")
        select_value(driver, form, "Priority class", "prod")
        [role] = list_items(driver, form, "Task roles")  # the form opens with one train role
        set_number(driver, role, "GPUs per instance", 1)
        set_string_list(driver, role, "Commands", ["python3 -c \"print('hello from the browser')\""])
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", form)  # the top of the form
        shot = screenshot(driver, ARTIFACTS, "prefect-submit-form", full_page=False)
        if os.environ.get("APIARY_UPDATE_DOCS") == "1":
            shutil.copyfile(shot, REPO_ROOT / "docs" / "prefect-submit-form.png")
        submit_and_wait(driver)

    with screenshot_on_failure(driver, ARTIFACTS, "2-job-listed"):
        job = until_seen(lambda: next((j for j in _cli_job_list(p.api_url, grace) if j["id"] == "grace~browser-hello"),
                                      None),
                         bool, LOADED_S, "the form's job in `apiary job list`")
        assert (job["virtualCluster"], job["priorityClass"]) == ("vc1", "prod")
        run_id = until_seen(lambda: c.get(job["id"])["flowRunId"], bool, LOADED_S, "the job's flow run")

    with screenshot_on_failure(driver, ARTIFACTS, "3-run-completed"):
        open_flow_run(driver, ui, run_id, timeout_s=LOADED_S)
        wait_for_badge(driver, "Completed", 2 * LOADED_S)
        assert c.get(job["id"])["state"] == "SUCCEEDED"

    long_id = c.submit(job_text(2, 600, name="browser-long"), user="grace")["id"]
    with screenshot_on_failure(driver, ARTIFACTS, "4-cancel"):
        until_seen(lambda: c.get(long_id)["state"], lambda state: state == "RUNNING", LOADED_S, "the long job running")
        long_run = until_seen(lambda: c.get(long_id)["flowRunId"], bool, LOADED_S, "the long job's flow run")
        open_flow_run(driver, ui, long_run, timeout_s=LOADED_S)
        wait_for_badge(driver, "Running")
        cancel_flow_run(driver, timeout_s=LOADED_S)
        assert c.wait(long_id, timeout=LOADED_S)["state"] == "STOPPED"
        wait_for_badge(driver, "Cancelled")
