"""A job template's generated run form in the Prefect UI, in a real browser (headless chromium
through Selenium), on a platform started as ``apiary up`` starts it.

The shipped mnist template is served as deployment ``apiary-template/mnist`` with a form made from
its parameters: fill it field by field (the user, and Epochs set to 1 in the Parameters object),
press Submit, and the job runs as that user with that value and SUCCEEDS, the flow run ending
Completed. Then a template published while the platform runs gets its own deployment without a
restart of the serving process.

Waits poll with deadlines sized for a loaded 2-core machine (as tests/e2e/test_portal_browser.py);
each step saves a screenshot (PNG + HTML) on failure under ``test-artifacts/template-form/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from tests.support.browser import (
    chrome_driver,
    field_errors,
    form_property,
    log_in,
    open_custom_run,
    open_flow_run,
    screenshot_on_failure,
    select_options,
    set_number,
    set_run_name,
    set_text,
    state_badge,
    submit_custom_run,
    toast_messages,
    wait_for,
)
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prefect, pytest.mark.timeout(900)]

ARTIFACTS = Path(os.environ.get("APIARY_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts") / "template-form"
#: The deadline of a wait for the UI or the platform on a loaded 2-core machine.
LOADED_S = 120.0


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    home = tmp_path_factory.mktemp("apiary")
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=True, workdir=str(REPO_ROOT),
                 env={"APIARY_TEMPLATE_WATCH_S": "2"})
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


def _deployment(api_url: str, auth_string: str | None, name: str, timeout_s: float = LOADED_S):
    """The Prefect deployment ``name`` once it exists (polled up to ``timeout_s``)."""
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def q():
        async with PrefectClient(api=api_url, auth_string=auth_string) as client:
            return await client.read_deployment_by_name(name)

    def attempt():
        try:
            return asyncio.run(q())
        except Exception:  # not served yet
            return None

    return until(attempt, timeout_s, f"deployment {name}", poll_s=0.5)


def _flow_run_state(api_url: str, auth_string: str | None, flow_run_id: str) -> str:
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def q():
        async with PrefectClient(api=api_url, auth_string=auth_string) as client:
            return (await client.read_flow_run(flow_run_id)).state.type.value

    return asyncio.run(q())


def _start_run(api_url: str, auth_string: str | None, deployment_id: str, parameters: dict) -> str:
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def q():
        async with PrefectClient(api=api_url, auth_string=auth_string) as client:
            return str((await client.create_flow_run_from_deployment(deployment_id, parameters=parameters)).id)

    return asyncio.run(q())


def _answered_503_since(log_path: Path):
    """A check of whether the Prefect server answered a request 503 since the last check (it
    logs "Encountered retryable exception in request" for each, as Apiary starts it; on SQLite a
    write that meets another's snapshot gets one, and Prefect says to retry it)."""
    seen = log_path.stat().st_size

    def check() -> bool:
        nonlocal seen
        with log_path.open("rb") as f:
            f.seek(seen)
            new = f.read()
        seen += len(new)
        return b"Encountered retryable exception in request" in new

    return check


def _tail(log_path: Path, n: int = 4000) -> str:
    return log_path.read_bytes()[-n:].decode(errors="replace")


def test_fill_the_mnist_templates_form_run_it_and_the_job_succeeds(platform, driver) -> None:
    p, c = platform
    ui, api, auth = p.ui_url, p.prefect_server.api_url, p.prefect_auth_string
    deployment = _deployment(api, auth, "apiary-template/mnist")
    assert deployment.parameters["parameters"]["epochs"] == 5  # the form opens at the template's defaults
    c.create_user("heidi")

    with screenshot_on_failure(driver, ARTIFACTS, "0-login"):
        log_in(driver, ui, auth)
    with screenshot_on_failure(driver, ARTIFACTS, "1-form"):
        form = open_custom_run(driver, ui, str(deployment.id), via_menu=True, timeout_s=LOADED_S)
        set_run_name(driver, "template-mnist-browser")
        assert select_options(driver, form, "Template") == ["mnist"]
        set_text(driver, form, "User", "heidi")
        params = form_property(driver, form, "Parameters")
        set_number(driver, params, "Epochs", 1)
        set_text(driver, params, "Register the model as", "")  # no MLflow here: nothing to register
        try:
            submit_custom_run(driver, timeout_s=LOADED_S, resubmit_if=_answered_503_since(p.prefect_server.log_path))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; fields={field_errors(driver)} toasts={toast_messages(driver)}; "
                                 f"server.log: {_tail(p.prefect_server.log_path)}") from exc

    with screenshot_on_failure(driver, ARTIFACTS, "2-job"):
        job = until(lambda: next(iter(c.list(user="heidi")), None), LOADED_S, "the form's job")
        assert job["id"].startswith("heidi~mnist-") and job["user"] == "heidi"
        run_id = until(lambda: c.get(job["id"])["flowRunId"], LOADED_S, "the job's flow run")
        final = c.wait(job["id"], timeout=3 * LOADED_S)
        assert final["state"] == "SUCCEEDED", final
        logs = c.logs(job["id"])
        assert "epoch 1/1" in logs and "final test_acc=" in logs, logs  # Epochs = 1 reached the script

    with screenshot_on_failure(driver, ARTIFACTS, "3-run-completed"):
        open_flow_run(driver, ui, run_id, timeout_s=LOADED_S)
        wait_for(driver, lambda _: state_badge(driver) == "Completed", 2 * LOADED_S,
                 "the run's badge to read Completed")
        assert _flow_run_state(api, auth, run_id) == "COMPLETED"

    # A template published now is served without restarting the serving process.
    late = yaml.safe_load((REPO_ROOT / "examples" / "marketplace" / "templates" / "stress.yaml").read_text())
    late.update(name="late-stress", summary="published while serving")
    c.admin.publish_template(late)
    added = _deployment(api, auth, "apiary-template/late-stress")
    assert added.parameters["template"] == "late-stress" and added.parameters["parameters"]["trials"] == 20
    # ... and its runs are executed by that process: one started through Prefect's API completes.
    run_id = _start_run(api, auth, str(added.id), {**added.parameters, "user": "heidi",
                                                   "parameters": {**added.parameters["parameters"], "trials": 2}})
    until(lambda: _flow_run_state(api, auth, run_id) in ("COMPLETED", "FAILED", "CRASHED"), 2 * LOADED_S,
          "the late template's run to end")
    assert _flow_run_state(api, auth, run_id) == "COMPLETED"
    [late_job] = [j for j in c.list(user="heidi") if j["id"].startswith("heidi~stress-")]
    assert late_job["state"] == "SUCCEEDED"
