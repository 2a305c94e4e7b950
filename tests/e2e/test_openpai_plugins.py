"""An OpenPAI job that uses the teamwise_storage and ssh runtime plugins as OpenPAI documents them
(examples/openpai/teamwise-storage-ssh.yaml) runs on Apiary unmodified: submitted from the file
with ``apiary job submit``, its two instances on two nodes read the share and reach each other by
``taskrole-<index>``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from tests.support.polling import done

from apiary.embedded import REPO_ROOT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="binding storage and each task's sshd need root"),
    pytest.mark.skipif(not (os.access("/usr/sbin/sshd", os.X_OK) and shutil.which("ssh")),
                       reason="needs OpenSSH's server and client (apt: openssh-server openssh-client)"),
]

EXAMPLE = REPO_ROOT / "examples" / "openpai" / "teamwise-storage-ssh.yaml"


def test_openpais_plugins_as_documented_run_unmodified(platform_factory, tmp_path) -> None:
    p, c = platform_factory("hived-config-one-vc.yaml")
    share = tmp_path / "share"
    share.mkdir()
    os.chmod(share, 0o1777)  # tasks of changing uids write their markers
    (share / "hello.txt").write_text("hello from the team share\n")
    os.chmod(share / "hello.txt", 0o644)  # whatever umask an earlier test left: tasks run as other uids
    admin = c.admin
    admin.put_storage_server("share-server", "local", {"rootPath": str(share)})
    admin.put_storage_config("PAI_SHARE", [{"mountPoint": "/mnt/share", "server": "share-server"}])
    admin.set_storage_grant("default", "PAI_SHARE")
    admin.create_user("alice")
    token = admin.create_token("alice", expires_in_s=3600)["token"]
    env = {**os.environ, "APIARY_HOME": str(p.home), "APIARY_TOKEN": token}
    env.pop("APIARY_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "apiary", "job", "submit", str(EXAMPLE)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = done(c, out.stdout.strip())
    log0 = c.logs(job["id"], "taskrole", 0)
    assert job["state"] == "SUCCEEDED", (job, log0, c.logs(job["id"], "taskrole", 0, stream="stderr"),
                                         c.logs(job["id"], "taskrole", 1, stream="stderr"))
    assert len({t["node"] for t in job["tasks"]}) == 2
    assert "reached instance 1 of taskrole" in log0
    assert log0.count("hello from the team share") == 2  # its own mount, and instance 1's over ssh
    assert "hello from the team share" in c.logs(job["id"], "taskrole", 1)
    assert (share / "done-0").exists()
