"""The Prefect UI as a portal, in a real browser (headless Debian chromium through Selenium).

On a platform started as `apiary up` starts it (control plane, agents, Prefect server, bridge and
served deployments on loopback): fill the apiary-job / submit Custom run form field by field (no
JSON mode), submit, see the job in `apiary job list`, watch its run reach Completed in the UI,
then press Cancel on the run of a long CLI-submitted job and see Apiary report STOPPED.

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
    wait_for,
)
from tests.support.builders import LAB6, job_text
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prefect]

ARTIFACTS = Path(os.environ.get("APIARY_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts") / "portal"


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    home = tmp_path_factory.mktemp("apiary")
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=True, workdir=str(REPO_ROOT))
    p.start()
    try:
        c = Tenants(p.client())
        until(lambda: nodes_ready(c, 2), 60, "node agents")
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

    return until(attempt, 90, f"deployment {name}", poll_s=0.5)


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
        form = open_custom_run(driver, ui, deployment, via_menu=True)
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
        submit_custom_run(driver)

    with screenshot_on_failure(driver, ARTIFACTS, "2-job-listed"):
        job = until(lambda: next((j for j in _cli_job_list(p.api_url, grace) if j["id"] == "grace~browser-hello"),
                                 None),
                    120, "the form's job in `apiary job list`", poll_s=1)
        assert (job["virtualCluster"], job["priorityClass"]) == ("vc1", "prod")
        run_id = until(lambda: c.get(job["id"])["flowRunId"], 60, "the job's flow run")

    with screenshot_on_failure(driver, ARTIFACTS, "3-run-completed"):
        open_flow_run(driver, ui, run_id)
        wait_for(driver, lambda _: state_badge(driver) == "Completed", 240, "the run's badge to read Completed")
        assert c.get(job["id"])["state"] == "SUCCEEDED"

    long_id = c.submit(job_text(2, 600, name="browser-long"), user="grace")["id"]
    with screenshot_on_failure(driver, ARTIFACTS, "4-cancel"):
        until(lambda: c.get(long_id)["state"] == "RUNNING", 120, "the long job running")
        long_run = until(lambda: c.get(long_id)["flowRunId"], 60, "the long job's flow run")
        open_flow_run(driver, ui, long_run)
        wait_for(driver, lambda _: state_badge(driver) == "Running", 120, "the long run's badge to read Running")
        cancel_flow_run(driver)
        assert c.wait(long_id, timeout=120)["state"] == "STOPPED"
        wait_for(driver, lambda _: state_badge(driver) == "Cancelled", 120, "the long run's badge to read Cancelled")
