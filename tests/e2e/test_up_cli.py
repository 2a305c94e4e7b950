"""The CLI contract end to end: ``apiary up`` in a subprocess, a real mnist job through
``apiary job submit / wait / get --json / logs / list / stop``, and Ctrl-C stopping it cleanly."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.support.builders import LAB6
from tests.support.polling import until

from apiary.embedded import REPO_ROOT
from apiary.tracking.prefect_server import free_port

pytestmark = pytest.mark.e2e
APIARY = [sys.executable, "-m", "apiary"]


@pytest.fixture
def up(tmp_path: Path):
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "APIARY_HOME": str(home), "PREFECT_HOME": str(tmp_path / "ph"), "DO_NOT_TRACK": "1"}
    env.pop("APIARY_API_URL", None)
    proc = subprocess.Popen(
        [*APIARY, "up", "--no-prefect", "--port", str(port), "--cluster", str(LAB6 / "hived-config-two-vcs.yaml")],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )

    def cli(*args: str, check: bool = True, token: str | None = None, stdin: str | None = None,
            home_dir: Path | None = None, api_url: str | None = None) -> subprocess.CompletedProcess:
        """``apiary ARGS`` as the home's admin (the token apiary up wrote), or with ``token``, or
        from another home talking to ``api_url``."""
        run_env = {**env, **({"APIARY_TOKEN": token} if token else {}),
                   **({"APIARY_HOME": str(home_dir)} if home_dir else {}),
                   **({"APIARY_API_URL": api_url} if api_url else {})}
        r = subprocess.run([*APIARY, *args], env=run_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                           input=stdin)
        if check:
            assert r.returncode == 0, f"apiary {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    until(lambda: (home / "run" / "api_url").exists(), 60, "apiary up")
    until(lambda: sum(n["ready"] for n in json.loads(cli("node", "list", "--json").stdout)) == 2, 60, "nodes")
    proc.port = port
    yield proc, cli
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)


def user_token(cli, name: str, *groups: str) -> str:
    """The admin creates ``name`` (in ``groups``, default the 'default' group) and a token for them."""
    cli("user", "create", name, *[a for g in groups for a in ("--group", g)])
    return cli("token", "create", "--user", name, "--description", "e2e").stdout.strip()


def test_mnist_job_through_the_cli(up):
    proc, cli = up
    alice = user_token(cli, "alice")
    job_id = cli("job", "submit", str(LAB6 / "job-config-0.yaml"), token=alice).stdout.strip()
    assert job_id == "alice~job-config-0"
    assert cli("job", "wait", job_id, "--timeout", "120").returncode == 0
    job = json.loads(cli("job", "get", job_id, "--json").stdout)
    for field in ("id", "name", "user", "virtualCluster", "priorityClass", "state", "retries", "retryDetails",
                  "submissionTime", "launchTime", "completionTime", "exitCode", "waitingReason", "tasks"):
        assert field in job
    assert job["state"] == "SUCCEEDED" and job["exitCode"] == 0 and job["virtualCluster"] == "vc1"
    assert job["tasks"] == [job["tasks"][0]] and job["tasks"][0]["node"] == "hostname-dan"
    assert job["tasks"][0]["gpus"] == [0] and job["tasks"][0]["exitCode"] == 0
    assert job["tasks"][0]["simulatedGpus"] is True
    logs = cli("job", "logs", job_id, "--task", "train/0").stdout
    assert "epoch 1/1 loss=" in logs and "CUDA_VISIBLE_DEVICES: 0" in logs
    nodes = json.loads(cli("node", "list", "--json").stdout)
    assert all(n["simulatedGpus"] is True for n in nodes)
    assert [j["id"] for j in json.loads(cli("job", "list", "--json").stdout)] == [job_id]


def test_stop_and_wait_exit_codes(up):
    proc, cli = up
    bob = user_token(cli, "bob")
    job_id = cli("job", "submit", str(LAB6 / "job-config-1.yaml"), token=bob).stdout.strip()
    cli("job", "stop", job_id, token=bob)
    r = cli("job", "wait", job_id, "--timeout", "60", check=False)
    assert r.returncode == 1 and "STOPPED" in r.stdout
    bad = cli("job", "submit", str(LAB6 / "hived-config-one-vc.yaml"), check=False)
    assert bad.returncode == 1 and ("taskRoles" in bad.stderr or "protocolVersion" in bad.stderr)


def test_ctrl_c_stops_everything(up):
    proc, cli = up
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(30)
    assert proc.returncode is not None
    # The children run in their own sessions; find them by the port they were given.
    out = subprocess.run(["pgrep", "-f", f"apiary .*{proc.port}"], capture_output=True, text=True)
    assert out.stdout.split() == []


def test_killing_the_supervisor_takes_its_children_along(up):
    proc, cli = up
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # The children run in their own sessions but ask the kernel for SIGTERM when their parent dies.
    until(lambda: subprocess.run(["pgrep", "-f", f"apiary .*{proc.port}"], capture_output=True).returncode == 1,
          30, "children to exit")


def test_up_with_an_oversubscribed_vc_names_the_field_and_starts_nothing(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((LAB6 / "hived-config-two-vcs.yaml").read_text().replace("cellNumber: 1", "cellNumber: 3"))
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "APIARY_HOME": str(home), "PREFECT_HOME": str(tmp_path / "ph"), "DO_NOT_TRACK": "1"}
    proc = subprocess.Popen(
        [*APIARY, "up", "--no-prefect", "--port", str(port), "--cluster", str(bad)],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 1, out + err
    err = " ".join(err.split())
    assert "error (400): virtualClusters.default.virtualCells[0]: VC default does not fit" in err
    assert "(500)" not in err and not (home / "logs").exists()  # no child ever started
    assert subprocess.run(["pgrep", "-f", f"apiary .*{port}"], capture_output=True).returncode == 1


def test_users_groups_grants_tokens_and_login_from_the_cli(up, tmp_path: Path):
    """The admin (the token apiary up wrote to home/token) sets up a team with one VC; its member
    logs in from another home and may submit only there; a revoked token stops at once."""
    proc, cli = up
    me = json.loads(cli("whoami", "--json").stdout)
    assert me["name"] == "admin" and me["admin"] is True
    cli("group", "create", "team-a", "--vc", "default")
    carol = user_token(cli, "carol", "team-a")
    team = next(g for g in json.loads(cli("group", "list", "--json").stdout) if g["name"] == "team-a")
    assert team["members"] == ["carol"] and team["virtualClusters"] == ["default"]
    as_carol = {"home_dir": tmp_path / "carol-home", "api_url": f"http://127.0.0.1:{proc.port}"}
    assert "Logged in as user carol" in " ".join(cli("login", stdin=carol + "\n", **as_carol).stdout.split())
    token_file = tmp_path / "carol-home" / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.read_text().strip() == carol
    bad = cli("job", "submit", str(LAB6 / "job-config-0.yaml"), check=False, **as_carol)  # VC vc1
    assert bad.returncode == 1
    assert "User carol has no access to virtual cluster vc1." in " ".join(bad.stderr.split())
    assert cli("job", "submit", str(LAB6 / "job-config-5.yaml"), **as_carol).stdout.strip() == "carol~job-config-5"
    (mine,) = json.loads(cli("token", "list", "--json", **as_carol).stdout)
    assert "token" not in mine and mine["subject"] == "carol"
    cli("token", "revoke", mine["id"], **as_carol)
    r = cli("whoami", check=False, **as_carol)
    assert r.returncode == 1 and "401" in r.stderr


def test_a_second_up_on_a_live_home_exits_1_naming_the_running_platform(up, tmp_path: Path):
    """One platform per APIARY_HOME: the second ``apiary up`` (on another port) names the first one's
    pid and URL and exits 1; the first one keeps its nodes and its tasks."""
    proc, cli = up
    env = {**os.environ, "APIARY_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "ph2"),
           "DO_NOT_TRACK": "1"}
    env.pop("APIARY_API_URL", None)
    second = subprocess.run([*APIARY, "up", "--no-prefect", "--port", str(free_port())], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    said = " ".join((second.stdout + second.stderr).split())
    assert second.returncode == 1, said
    assert f"is in use by the running platform (pid {proc.pid}, API http://127.0.0.1:{proc.port})" in said
    assert proc.poll() is None
    assert sum(n["ready"] for n in json.loads(cli("node", "list", "--json").stdout)) == 2


# ------------------------------------------------------------------------------ real GPUs through NVML
ONE_NODE = """\
physicalCluster:
  skuTypes:
    GPU-H: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    GPU-H-NODE: {childCellType: GPU-H, childCellNumber: 1, isNodeLevel: true}
    GPU-H-POOL: {childCellType: GPU-H-NODE, childCellNumber: 1}
  physicalCells:
  - cellType: GPU-H-POOL
    cellChildren:
    - cellAddress: gpu-box
virtualClusters:
  team:
    virtualCells:
    - {cellType: GPU-H-POOL.GPU-H-NODE, cellNumber: 1}
"""
FAKE_UUID = "GPU-5e1f0c3a-0000-4000-8000-00000000h200"

#: A stand-in ``pynvml`` module (the monitoring tests' fake NVML as a module), first on PYTHONPATH
#: of ``apiary up`` and so of its agent: one H200, or a machine without a driver.
FAKE_PYNVML = """\
from tests.monitoring.fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound

_fake = FakeNvml([FakeGpu(name="NVIDIA H200", uuid={uuid!r}, mem_total=143771 * 1024 * 1024)],
                 init_error=None if {answers} else NVMLError_LibraryNotFound())


def __getattr__(name):
    return getattr(_fake, name)
"""


@pytest.mark.parametrize("answers", [True, False], ids=["nvml-answers", "no-driver"])
def test_up_s_agent_reports_real_gpus_when_nvml_answers(tmp_path: Path, answers: bool):
    fake = tmp_path / "fake-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML.format(uuid=FAKE_UUID, answers=answers))
    cluster = tmp_path / "one-node.yaml"
    cluster.write_text(ONE_NODE)
    home, port = tmp_path / "home", free_port()
    env = {**os.environ, "APIARY_HOME": str(home), "PREFECT_HOME": str(tmp_path / "ph"), "DO_NOT_TRACK": "1",
           "PYTHONPATH": os.pathsep.join([str(fake), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("APIARY_API_URL", None)
    out = tmp_path / "up.out"
    with out.open("w") as sink:
        proc = subprocess.Popen([*APIARY, "up", "--no-prefect", "--port", str(port), "--cluster", str(cluster)],
                                env=env, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        def node() -> dict | None:
            if proc.poll() is not None:
                raise AssertionError(f"apiary up exited {proc.returncode}: {out.read_text()[-3000:]}")
            r = subprocess.run([*APIARY, "node", "list", "--json"], env=env, cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=60)
            nodes = json.loads(r.stdout) if r.returncode == 0 else []
            return nodes[0] if nodes and nodes[0]["ready"] and nodes[0]["metricsUrl"] else None

        box = until(node, 120, "node gpu-box ready")
        said = " ".join(out.read_text().split())
        metrics = httpx.get(box["metricsUrl"], timeout=10).text
        if answers:
            assert box["name"] == "gpu-box" and box["simulatedGpus"] is False
            assert "GPUs: NVML on node gpu-box (NVML sees 1 GPU (NVIDIA H200), driver 550.54.15)" in said
            assert FAKE_UUID in metrics and 'modelName="NVIDIA H200"' in metrics
            assert "Simulated" not in metrics
        else:
            assert box["simulatedGpus"] is True
            assert "GPUs: simulated (NVML does not answer: NVMLError_LibraryNotFound" in said
            assert FAKE_UUID not in metrics
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
