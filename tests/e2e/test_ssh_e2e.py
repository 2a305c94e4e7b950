"""OpenPAI's ssh runtime plugin through the platform, on the process runtime (root: each task's sshd
runs as its own uid in its own mount namespace).

* a 2-instance gang with ``jobssh`` and ``sshbarrier`` on two nodes: instance 0 runs
  ``ssh worker-1 ...`` and the answer comes from instance 1 (its PAI task index, host IP and uid);
* ``apiary user ssh-key add`` then ``apiary job ssh ID -- cat /proc/1/cmdline`` (BatchMode) reaches a
  running task; another user's key is refused; ``--print-config`` gives a VS Code Remote-SSH block;
* a barrier whose peer never lets the job's key in ends the attempt with 249
  (PAIRuntimeSSHBarrierTimeout), a permanent failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.support.builders import minimal_job
from tests.support.polling import done, until

from apiary.client import ApiaryClient
from apiary.control.jobssh import key_pair
from apiary.lifecycle.exitspec import EXIT_SSH_BARRIER_TIMEOUT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="the ssh plugin runs each task's sshd as its own uid: needs root"),
    pytest.mark.skipif(not (os.access("/usr/sbin/sshd", os.X_OK) and shutil.which("ssh")),
                       reason="needs OpenSSH's server and client (apt: openssh-server openssh-client)"),
]

PLUGIN = "com.microsoft.pai.runtimeplugin"
#: Seconds a waiting task polls for its marker file before it gives up (bounded, never a test sleep).
WAIT_S = 300


def _job(name: str, roles: dict[str, tuple[int, list[str]]], plugins: list[dict]) -> str:
    data = minimal_job(name)
    base = data["taskRoles"].pop("train")
    for role, (instances, commands) in roles.items():
        data["taskRoles"][role] = {**base, "instances": instances, "commands": commands}
    data["extras"] = {PLUGIN: plugins}
    return yaml.safe_dump(data)


def _wait_for(marker: str) -> str:
    """A command that waits (at most WAIT_S) until ``~/<marker>`` exists, then succeeds."""
    return f"for i in $(seq {WAIT_S * 4}); do [ -f ~/{marker} ] && exit 0; sleep 0.25; done; exit 1"


def _user(c: ApiaryClient, name: str) -> tuple[ApiaryClient, str]:
    if name not in {u["name"] for u in c.users()}:
        c.create_user(name)
    token = c.create_token(name, description="ssh e2e", expires_in_s=3600)["token"]
    return c.as_token(token), token


def _cli(args: list[str], *, url: str, token: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "APIARY_API_URL": url, "APIARY_TOKEN": token, "APIARY_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "apiary", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture
def jobs_stopped_at_end():
    """Jobs a test started, stopped at its end whatever happened (their sshds go with their tasks)."""
    started: list[tuple[ApiaryClient, str]] = []
    yield started
    for client, job in started:
        try:
            if client.get(job)["state"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                client.stop(job)
                client.wait(job, timeout=60, poll_s=0.2)
        except Exception:  # noqa: BLE001 - teardown: the platform's own stop ends what is left
            pass


def test_jobssh_and_barrier_let_instance_0_reach_instance_1_on_another_node(platform_factory, jobs_stopped_at_end):
    p, c = platform_factory("hived-config-one-vc.yaml")
    alice, _ = _user(c, "alice")
    remote = ("ssh worker-1 'echo REMOTE index=$PAI_TASK_INDEX ip=$PAI_CONTAINER_HOST_IP "
              "role=$PAI_CURRENT_TASK_ROLE_NAME uid=$(id -u); touch ~/.done'")
    commands = [f'if [ "$PAI_TASK_INDEX" = 0 ]; then echo LOCAL uid=$(id -u); {remote}; '
                f"else {_wait_for('.done')}; fi"]
    text = _job("sshgang", {"worker": (2, commands)}, [{"plugin": "ssh", "parameters": {
        "jobssh": True, "sshbarrier": True, "sshbarrierTimeout": 2}}])
    job = alice.submit(text)["id"]
    jobs_stopped_at_end.append((alice, job))
    final = done(c, job)
    out0 = c.logs(job, "worker", 0)
    assert final["state"] == "SUCCEEDED", (final, out0, c.logs(job, "worker", 0, stream="stderr"),
                                           c.logs(job, "worker", 1, stream="stderr"))
    nodes = {t["index"]: t["node"] for t in final["tasks"]}
    assert nodes[0] != nodes[1], final["tasks"]  # two nodes
    line = next(x for x in out0.splitlines() if x.startswith("REMOTE"))
    words = dict(w.split("=", 1) for w in line.split()[1:])
    local_uid = next(x for x in out0.splitlines() if x.startswith("LOCAL")).split("=")[1]
    assert words["index"] == "1" and words["role"] == "worker", out0  # instance 1 answered, with its env
    assert words["uid"] != local_uid and words["uid"] != "0", out0
    assert "every instance answers" in out0


def test_apiary_job_ssh_reaches_a_running_task_with_the_user_s_key_only(platform_factory, jobs_stopped_at_end,
                                                                        tmp_path: Path):
    p, c = platform_factory("hived-config-one-vc.yaml")
    url = c.api_url
    alice, alice_token = _user(c, "alice")
    _, bob_token = _user(c, "bob")
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    for who in ("alice", "bob"):
        private, public = key_pair(f"{who}@e2e")
        (keys / who).write_text(private)
        os.chmod(keys / who, 0o600)
        (keys / f"{who}.pub").write_text(public + "\n")
    home = tmp_path / "cli-home"
    added = _cli(["user", "ssh-key", "add", str(keys / "alice.pub")], url=url, token=alice_token, home=home)
    assert added.returncode == 0 and "added SSH key alice" in added.stdout, added
    listed = _cli(["user", "ssh-key", "list", "--json"], url=url, token=alice_token, home=home)
    assert [k["title"] for k in yaml.safe_load(listed.stdout)] == ["alice"], listed

    text = _job("sshone", {"train": (1, [_wait_for(".stop")])}, [{"plugin": "ssh"}])
    job = alice.submit(text)["id"]
    jobs_stopped_at_end.append((alice, job))
    info = until(lambda: next((i for i in [alice.job_ssh(job)] if i["tasks"] and i["tasks"][0]["running"]), None),
                 120, "a running task")
    assert info["login"] == "alice" and info["hostPublicKey"].startswith("ssh-ed25519 ")

    def ssh(key: str, *command: str, token: str = alice_token) -> subprocess.CompletedProcess:
        return _cli(["job", "ssh", job, "--key", str(keys / key), "--", *command], url=url, token=token, home=home)

    # The task's sshd may take a moment after RUNNING to listen: poll until it answers.
    ran = until(lambda: (lambda r: r if r.returncode == 0 else None)(ssh("alice", "cat", "/proc/1/cmdline")),
                60, "apiary job ssh answering")
    assert ran.stdout, ran
    env = ssh("alice", "sh", "-c", "'echo job=$APIARY_JOB_ID uid=$(id -u) user=$(id -un)'")
    assert f"job={job}" in env.stdout and "uid=0" not in env.stdout and "user=alice" in env.stdout, env
    refused = ssh("bob", "true")  # bob's key is on nobody's account: refused (BatchMode fails at once)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused
    assert _cli(["job", "ssh", job, "--key", str(keys / "bob"), "--", "true"], url=url, token=bob_token,
                home=home).returncode != 0  # and bob may not even read the job's SSH info
    config = _cli(["job", "ssh", job, "--print-config", "--key", str(keys / "alice")], url=url, token=alice_token,
                  home=home)
    assert "Host apiary-alice-sshone-train-0" in config.stdout and "StrictHostKeyChecking yes" in config.stdout

    assert ssh("alice", "touch", ".stop").returncode == 0  # the task ends on its own
    assert done(c, job)["state"] == "SUCCEEDED"


def test_a_barrier_that_times_out_fails_the_attempt_with_249(platform_factory, jobs_stopped_at_end):
    p, c = platform_factory("hived-config-one-vc.yaml")
    alice, _ = _user(c, "alice")
    # Role "b" runs an sshd without jobssh, so the job's key is not let in there and "a"'s barrier
    # never passes (OpenPAI's repro: a barrier relies on a task role without job ssh).
    text = _job("sshbarrier", {"a": (1, ["echo past-the-barrier"]), "b": (1, [_wait_for(".never")])}, [
        {"plugin": "ssh", "taskroles": ["a"], "parameters": {"jobssh": True, "sshbarrier": True,
                                                             "sshbarrierTimeout": 0.05}},
        {"plugin": "ssh", "taskroles": ["b"], "parameters": {}}])
    job = alice.submit(text)["id"]
    jobs_stopped_at_end.append((alice, job))
    final = done(c, job)
    a = next(t for t in final["tasks"] if t["taskRole"] == "a")
    assert final["state"] == "FAILED" and a["exitCode"] == EXIT_SSH_BARRIER_TIMEOUT, final
    assert final["exitCode"] == EXIT_SSH_BARRIER_TIMEOUT, final
    assert "past-the-barrier" not in c.logs(job, "a")
    assert "ssh barrier timed out" in c.logs(job, "a", stream="stderr")
