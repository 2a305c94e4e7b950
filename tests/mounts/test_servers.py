"""apiary.mounts.servers: the checks of a storage server, the mount command of each type, and
secrets kept out of answers and messages."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from apiary.errors import ValidationError
from apiary.mounts.servers import REDACTED, ServerSpec, check_server, mount_argv, redacted, scrub

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtz\n" \
      "-----END OPENSSH PRIVATE KEY-----"
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAgKRi6J3m/J7thtrHIKYZF1/ekI1eRGA0vG9JAHQkx/"


def sshfs(**data: object) -> ServerSpec:
    base = {"address": "files.example", "user": "alice", "rootPath": "/srv/team", "identity": KEY}
    return ServerSpec("team", "sshfs", {**base, **data})


@pytest.mark.parametrize(("spec", "argv"), [
    pytest.param(ServerSpec("n", "nfs", {"address": "10.0.0.5", "rootPath": "/export/team"}),
                 ["mount", "-t", "nfs", "10.0.0.5:/export/team", "TARGET"], id="nfs"),
    pytest.param(ServerSpec("n", "nfs", {"address": "nfs1", "rootPath": "/x", "options": "vers=4.1,soft,timeo=50"}),
                 ["mount", "-t", "nfs", "-o", "vers=4.1,soft,timeo=50", "nfs1:/x", "TARGET"], id="nfs-options"),
    pytest.param(ServerSpec("g", "glusterfs", {"address": "gfs1", "volume": "team"}),
                 ["mount", "-t", "glusterfs", "gfs1:/team", "TARGET"], id="glusterfs"),
    pytest.param(ServerSpec("g", "glusterfs", {"address": "gfs1", "volume": "team",
                                               "backupAddresses": ["gfs2", "gfs3"]}),
                 ["mount", "-t", "glusterfs", "-o", "backup-volfile-servers=gfs2:gfs3", "gfs1:/team", "TARGET"],
                 id="glusterfs-backups"),
])
def test_mount_argv(spec: ServerSpec, argv: list[str], tmp_path: Path) -> None:
    target = tmp_path / "t"
    assert mount_argv(spec, target, tmp_path / "private") == [a.replace("TARGET", str(target)) for a in argv]


@pytest.mark.parametrize("host_key", [HOST_KEY, None], ids=["host-key", "accept-new"])
def test_sshfs_argv_writes_private_key_files(tmp_path: Path, host_key: str | None) -> None:
    spec = sshfs(port=2222, **({"hostKey": host_key} if host_key else {}))
    argv = mount_argv(spec, tmp_path / "t", tmp_path / "private")
    assert argv[:4] == ["sshfs", "alice@files.example:/srv/team", str(tmp_path / "t"), "-p"]
    assert argv[4] == "2222" and argv[5] == "-o"
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in argv[6].split(","))
    identity, known = Path(options["IdentityFile"]), Path(options["UserKnownHostsFile"])
    assert identity.read_text() == KEY + "\n"
    for f in (identity, known):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(identity.parent.stat().st_mode) == 0o700
    assert identity.parent == tmp_path / "private" / spec.key
    if host_key:
        assert options["StrictHostKeyChecking"] == "yes"
        assert known.read_text() == f"[files.example]:2222 {HOST_KEY}\n"
    else:
        assert options["StrictHostKeyChecking"] == "accept-new"
        assert known.read_text() == ""
    assert options["BatchMode"] == "yes"
    assert {"allow_other", "reconnect", "ServerAliveInterval", "ServerAliveCountMax"} <= options.keys()
    assert KEY not in " ".join(argv)


def test_sshfs_default_port_is_22_and_known_hosts_plain(tmp_path: Path) -> None:
    argv = mount_argv(sshfs(hostKey=HOST_KEY), tmp_path / "t", tmp_path / "p")
    assert argv[argv.index("-p") + 1] == "22"
    assert (tmp_path / "p" / sshfs(hostKey=HOST_KEY).key / "known_hosts").read_text() == f"files.example {HOST_KEY}\n"


def test_local_is_never_mounted(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as e:
        mount_argv(ServerSpec("l", "local", {"rootPath": str(tmp_path)}), tmp_path / "t", tmp_path / "p")
    assert e.value.field == "type"


@pytest.mark.parametrize(("spec", "field"), [
    (ServerSpec("bad name", "local", {"rootPath": "/x"}), "name"),
    (ServerSpec("../x", "local", {"rootPath": "/x"}), "name"),
    (ServerSpec("s", "samba", {}), "type"),
    (ServerSpec("s", "local", {}), "data.rootPath"),
    (ServerSpec("s", "local", {"rootPath": "relative"}), "data.rootPath"),
    (ServerSpec("s", "local", {"rootPath": "/a/../b"}), "data.rootPath"),
    (ServerSpec("s", "local", {"rootPath": "/x", "rootpath": "/y"}), "data.rootpath"),
    (ServerSpec("s", "nfs", {"rootPath": "/x"}), "data.address"),
    (ServerSpec("s", "nfs", {"address": "-oevil", "rootPath": "/x"}), "data.address"),
    (ServerSpec("s", "nfs", {"address": "a b", "rootPath": "/x"}), "data.address"),
    (ServerSpec("s", "nfs", {"address": "h", "rootPath": "/x", "options": "vers=4 ,x"}), "data.options"),
    (ServerSpec("s", "nfs", {"address": 5, "rootPath": "/x"}), "data.address"),
    (ServerSpec("s", "glusterfs", {"address": "h"}), "data.volume"),
    (ServerSpec("s", "glusterfs", {"address": "h", "volume": "a/b"}), "data.volume"),
    (ServerSpec("s", "glusterfs", {"address": "h", "volume": "v", "backupAddresses": "h2"}), "data.backupAddresses"),
    (ServerSpec("s", "glusterfs", {"address": "h", "volume": "v", "backupAddresses": ["ok", "-x"]}),
     "data.backupAddresses[1]"),
    (sshfs(port=0), "data.port"),
    (sshfs(port=True), "data.port"),
    (sshfs(port="22"), "data.port"),
    (sshfs(user="al ice"), "data.user"),
    (sshfs(identity="hunter2"), "data.identity"),
    (sshfs(hostKey="not a key at all"), "data.hostKey"),
    (sshfs(rootPath="srv"), "data.rootPath"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_check_server_names_the_field(spec: ServerSpec, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        check_server(spec)
    assert e.value.field == field
    assert field in str(e.value)
    assert KEY not in str(e.value)


def test_good_servers_pass() -> None:
    for spec in (ServerSpec("l", "local", {"rootPath": "/srv"}), sshfs(hostKey=HOST_KEY, port=2222),
                 ServerSpec("g", "glusterfs", {"address": "[fd00::1]", "volume": "v_1"}),
                 ServerSpec("n", "nfs", {"address": "198.18.1.1", "rootPath": "/", "options": "vers=4.1"})):
        check_server(spec)


def test_redacted_and_scrub_hide_the_identity() -> None:
    spec = sshfs(hostKey=HOST_KEY)
    view = redacted(spec)
    assert view["identity"] == REDACTED and view["hostKey"] == HOST_KEY and spec.data["identity"] == KEY
    line = KEY.splitlines()[1]
    assert scrub(f"ssh said: {KEY} and {line}", spec) == f"ssh said: {REDACTED} and {REDACTED}"
    nfs = ServerSpec("n", "nfs", {"address": "h", "rootPath": "/x"})
    assert redacted(nfs) == nfs.data and redacted(nfs) is not nfs.data


def test_key_changes_with_the_data() -> None:
    a = ServerSpec("g", "glusterfs", {"address": "h", "volume": "v"})
    b = ServerSpec("g", "glusterfs", {"volume": "v", "address": "h"})
    c = ServerSpec("g", "glusterfs", {"address": "h2", "volume": "v"})
    assert a.key == b.key != c.key
    assert a.key.startswith("g-") and len(a.key) == len("g-") + 12
