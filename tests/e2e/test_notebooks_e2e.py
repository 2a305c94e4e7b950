"""JupyterLab and TensorBoard through the proxy, end to end on the embedded platform.

alice runs examples/jupyter/jupyter.yaml with OpenPAI's tensorboard runtime plugin added: one
instance serves JupyterLab on its named port ``jupyter`` and TensorBoard on ``tensorboard``, both on
the process runtime (the agent's virtual environment has both packages: the dev extras). Through
the proxy JupyterLab's ``/api/status`` answers alice and refuses eve (another user of the same
VC); the ports themselves, asked directly on the node without the instance's secret, refuse.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import pytest
import yaml
from tests.support.polling import task_running, until

from apiary.embedded import REPO_ROOT
from apiary.spec.ports import task_ports

pytestmark = pytest.mark.e2e


def _answer(url: str, token: str, path: str) -> httpx.Response | None:
    """The proxy's answer once the task's server is up (a 502 while it starts), else None."""
    r = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30, trust_env=False)
    return None if r.status_code == 502 else r


def _job_open(api_url: str, token: str, job: str, *args: str) -> str:
    """What ``apiary job open JOB --print ARGS`` prints, as ``token``'s user."""
    env = {**os.environ, "APIARY_API_URL": api_url, "APIARY_TOKEN": token}
    out = subprocess.run([sys.executable, "-m", "apiary", "job", "open", job, "--print", *args], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_jupyterlab_and_tensorboard_answer_their_owner_through_the_proxy(platform_factory, tmp_path) -> None:
    p, c = platform_factory("hived-config-one-vc.yaml")
    doc: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples/jupyter/jupyter.yaml").read_text())
    doc["extras"] = {"com.microsoft.pai.runtimeplugin": [
        {"plugin": "tensorboard", "parameters": {"logdir": {"runs": str(tmp_path / "runs")}}}]}
    job = c.submit(yaml.safe_dump(doc), user="alice")["id"]
    until(lambda: task_running(c, job), 120, "the notebook task running")
    alice = c.create_token("alice", expires_in_s=3600)["token"]
    c.create_user("eve")
    eve = c.create_token("eve", expires_in_s=3600)["token"]
    base = f"{p.api_url}/api/v2/jobs/{job}/proxy/notebook/0"

    status = until(lambda: _answer(base, alice, "/jupyter/api/status"), 180, "JupyterLab answering")
    assert status.status_code == 200, status.text
    assert "started" in status.json()
    assert _answer(base, eve, "/jupyter/api/status").status_code == 403  # type: ignore[union-attr]
    url = _job_open(p.api_url, alice, job)
    assert url == f"{base}/jupyter/?token={alice}"
    with httpx.Client(timeout=30, trust_env=False, follow_redirects=True) as browser:  # the browser's way in
        lab = browser.get(url)
    assert lab.status_code == 200 and "JupyterLab" in lab.text and alice not in lab.text
    assert lab.history and lab.history[0].status_code == 303

    assert _job_open(p.api_url, alice, job, "--tensorboard", "--task", "notebook/0") == \
        f"{base}/tensorboard/?token={alice}"
    board = until(lambda: _answer(base, alice, "/tensorboard/data/environment"), 180, "TensorBoard answering")
    assert board.status_code == 200, board.text
    assert "data_location" in board.json()

    # The ports on the node itself (the process runtime shares its network): no secret, no answer.
    node = next(t["node"] for t in c.get(job)["tasks"])
    agent = c.as_token((p.home / "credentials" / f"agent-{node}.token").read_text().strip())
    (run,) = agent._call("GET", f"/api/v2/nodes/{node}/assignments", params={"wait": 0}).json()["assignments"]
    ports = task_ports(run["runId"], ["jupyter", "tensorboard"])
    path = base[len(p.api_url):]
    with httpx.Client(timeout=30, trust_env=False) as direct:
        assert direct.get(f"http://127.0.0.1:{ports['jupyter']}{path}/jupyter/api/contents").status_code == 403
        assert direct.get(f"http://127.0.0.1:{ports['tensorboard']}{path}/tensorboard/data/environment"
                          ).status_code == 403
