"""OpenPAI's ssh runtime plugin on the process runtime: an sshd in every task, as the task's uid.

OpenPAI's ``sshd.sh`` runs the image's sshd as root inside the container and lets users in as root.
A process-runtime task has no container and runs as a leased uid without a passwd entry
(:mod:`apiary.runtime.isolation`), so here Debian's ``/usr/sbin/sshd`` runs as the task's own uid,
which lets in that uid only (a non-root sshd cannot switch users), in the task's own mount namespace
where a private ``/etc/passwd`` and ``/etc/group`` (the node's, plus the task's uid under the job's
user name and ``apiary-<uid>``, with the task's home and ``/bin/bash``) are bound over the node's:
sshd and ssh both need the uid's name and home. What the root side writes before the task starts
(:func:`prepare`), all owned by the task's uid, files 0600 in 0700 directories::

    <home>/.ssh/
      authorized_keys   the user's account keys, the job's userssh keys, the job's public key (jobssh)
      environment       the task's environment, for ssh sessions (PermitUserEnvironment, as OpenPAI's
                        ``env > ~/.ssh/environment``); values with a newline are left out
      id_job, id_job.pub  the job's key pair (jobssh)
      config            ``Host <taskrole>-<index>`` for every peer: HostName, Port, User, IdentityFile,
                        HostKeyAlias and StrictHostKeyChecking yes against known_hosts (jobssh)
      known_hosts       the job's host public key under its alias
      sshd/host_key     the job's host key (every instance presents it); sshd/sshd_config; sshd/sshd.log
    <run dir>/passwd, group   0644, root's: bound read-only over /etc/passwd and /etc/group

:func:`prelude` is the shell the task's script runs first: it starts ``sshd -D`` in the background
(in the task's process group, so the wrapper's ``kill -TERM 0`` at the end takes it down; sessions
sshd forked into sessions of their own run as the uid, which the lease's release kills), waits up to
:data:`SSHD_START_S` for its port, and with ``sshbarrier`` tries ``ssh <peer> true`` (BatchMode: a
TCP connect and a full SSH handshake with the job's key) until every peer answers; past
``barrierTimeoutS`` it exits 249 (:data:`apiary.lifecycle.exitspec.EXIT_SSH_BARRIER_TIMEOUT`).
With ``failurePolicy: ignore`` a failure is written to stderr and the commands run anyway.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

from apiary.lifecycle.exitspec import EXIT_SSH_BARRIER_TIMEOUT

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
#: Seconds the prelude waits for the task's own sshd to listen.
SSHD_START_S = 20
#: Seconds between two rounds of the barrier (OpenPAI's is 10; peers here start within seconds).
BARRIER_POLL_S = 1
#: Seconds one ``ssh`` of the barrier may take to connect.
CONNECT_TIMEOUT_S = 5
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PASSWD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def check_launch(ssh: dict) -> None:
    """Raise ValueError naming what is missing from ``ssh`` (:attr:`TaskLaunch.ssh`) or unusable."""
    for key in ("port", "login", "hostKey", "hostPublicKey", "hostKeyAlias", "authorizedKeys"):
        if not ssh.get(key) and key != "authorizedKeys":
            raise ValueError(f"the ssh launch has no {key}")
    if not isinstance(ssh["port"], int) or not 0 < ssh["port"] < 65536:
        raise ValueError(f"the ssh launch's port is not a TCP port: {ssh['port']!r}")
    if not _PASSWD_NAME.fullmatch(str(ssh["login"])):
        raise ValueError(f"{ssh['login']!r} cannot be a login name")


def _write(path: Path, text: str, uid: int, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        if uid >= 0:
            os.fchown(fd, uid, uid)
        with open(fd, "w", encoding="utf-8", closefd=False) as f:
            f.write(text)
    finally:
        os.close(fd)


def _mkdir(path: Path, uid: int) -> None:
    path.mkdir(mode=0o700, exist_ok=True)
    os.chown(path, uid, uid)
    os.chmod(path, 0o700)


def _node_db(path: str, drop_names: set[str], drop_ids: set[int]) -> list[str]:
    """The node's ``/etc/passwd`` or ``/etc/group`` lines, without those naming ``drop_names`` or
    ids in ``drop_ids``."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":")
        if len(parts) < 3 or parts[0] in drop_names or (parts[2].isdigit() and int(parts[2]) in drop_ids):
            continue
        out.append(line)
    return out


def _ssh_config(ssh: dict, home: Path) -> str:
    blocks = []
    for peer in ssh.get("peers") or []:
        blocks.append("\n".join([
            f"Host {peer['name']}",
            f"  HostName {peer['host']}",
            f"  Port {int(peer['port'])}",
            f"  User {ssh['login']}",
            f"  IdentityFile {home}/.ssh/id_job",
            "  IdentitiesOnly yes",
            f"  HostKeyAlias {ssh['hostKeyAlias']}",
            f"  UserKnownHostsFile {home}/.ssh/known_hosts",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes",
            "  LogLevel ERROR",
        ]))
    return "# Apiary: the job's instances (generated; see apiary.runtime.sshd).\n" + "\n".join(blocks) + "\n"


def _sshd_config(ssh: dict, home: Path) -> str:
    sftp = next((p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server") if os.path.exists(p)), None)
    lines = [
        "# Apiary: the task's sshd, run as the task's uid (generated; see apiary.runtime.sshd).",
        f"Port {int(ssh['port'])}",
        f"HostKey {home}/.ssh/sshd/host_key",
        "PidFile none",
        "UsePAM no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        f"AuthorizedKeysFile {home}/.ssh/authorized_keys",
        f"AllowUsers {ssh['login']}",
        "PermitUserEnvironment yes",
        "PrintMotd no",
        "X11Forwarding no",
        "AllowTcpForwarding yes",
        "LogLevel INFO",
    ]
    if sftp:
        lines.append(f"Subsystem sftp {sftp}")
    return "\n".join(lines) + "\n"


def prepare(ssh: dict, *, uid: int, home: Path, run_dir: Path, env: dict[str, str]) -> list[dict]:
    """Write the task's SSH files (module doc) for ``ssh`` (:attr:`TaskLaunch.ssh`), the task's
    ``uid`` and ``home``, and its environment ``env``; return the bind mounts of the private
    ``/etc/passwd`` and ``/etc/group`` (``{"source", "target", "readOnly"}``). Raises ValueError for a
    malformed ``ssh`` and OSError when a file cannot be written."""
    check_launch(ssh)
    login = str(ssh["login"])
    names = {login, f"apiary-{uid}"}
    dot = home / ".ssh"
    _mkdir(dot, uid)
    _mkdir(dot / "sshd", uid)
    keys = [k for k in ssh.get("authorizedKeys") or [] if isinstance(k, str) and "\n" not in k]
    _write(dot / "authorized_keys", "".join(f"{k}\n" for k in keys), uid)
    _write(dot / "environment", "".join(
        f"{k}={v}\n" for k, v in env.items() if _ENV_NAME.fullmatch(k) and "\n" not in v and "\r" not in v), uid)
    _write(dot / "known_hosts", f"{ssh['hostKeyAlias']} {ssh['hostPublicKey'].split(' ')[0]} "
                                f"{ssh['hostPublicKey'].split(' ')[1]}\n", uid)
    _write(dot / "sshd" / "host_key", ssh["hostKey"].rstrip("\n") + "\n", uid)
    _write(dot / "sshd" / "sshd_config", _sshd_config(ssh, home), uid)
    if ssh.get("jobKey"):
        _write(dot / "id_job", ssh["jobKey"].rstrip("\n") + "\n", uid)
        _write(dot / "id_job.pub", f"{ssh['jobPublicKey']}\n", uid)
        _write(dot / "config", _ssh_config(ssh, home), uid)
    passwd = _node_db("/etc/passwd", names, {uid})
    passwd += [f"{name}:*:{uid}:{uid}:Apiary task:{home}:/bin/bash" for name in (login, f"apiary-{uid}")]
    group = _node_db("/etc/group", names, {uid}) + [f"{login}:x:{uid}:"]
    _write(run_dir / "passwd", "\n".join(passwd) + "\n", -1, 0o644)
    _write(run_dir / "group", "\n".join(group) + "\n", -1, 0o644)
    return [{"source": str(run_dir / "passwd"), "target": "/etc/passwd", "readOnly": True},
            {"source": str(run_dir / "group"), "target": "/etc/group", "readOnly": True}]


def prelude(ssh: dict[str, Any]) -> str:
    """The shell the task's script runs before its commands (module doc)."""
    ignore = ssh.get("failurePolicy") == "ignore"
    fail = "echo \"apiary: ssh runtime plugin: $1 (failurePolicy: ignore, the commands run anyway)\" >&2" \
        if ignore else "echo \"apiary: ssh runtime plugin: $1\" >&2; exit \"${2:-1}\""
    peers = " ".join(shlex.quote(p["name"]) for p in ssh.get("peers") or []) if ssh.get("sshbarrier") else ""
    timeout = max(1, int(round(float(ssh.get("barrierTimeoutS") or 1800))))
    return f"""# Apiary ssh runtime plugin (generated; see apiary.runtime.sshd).
__apiary_ssh_fail() {{ {fail}; }}
__apiary_ssh() {{
  local port={int(ssh['port'])} deadline peer left
  {SSHD} -D -f "$HOME/.ssh/sshd/sshd_config" -E "$HOME/.ssh/sshd/sshd.log" </dev/null &
  deadline=$((SECONDS + {SSHD_START_S}))
  until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    if ! kill -0 $! 2>/dev/null || ((SECONDS >= deadline)); then
      tail -n 5 "$HOME/.ssh/sshd/sshd.log" >&2 2>/dev/null
      __apiary_ssh_fail "sshd did not start on port $port"; return 0
    fi
    sleep 0.1
  done
  left="{peers}"
  [ -n "$left" ] || return 0
  echo "apiary: ssh barrier: waiting for $left (at most {timeout} s)"
  deadline=$((SECONDS + {timeout}))
  while :; do
    local failed=""
    for peer in $left; do
      {SSH} -q -o BatchMode=yes -o ConnectTimeout={CONNECT_TIMEOUT_S} "$peer" true </dev/null || failed="$failed $peer"
    done
    left="${{failed# }}"
    [ -n "$left" ] || break
    if ((SECONDS >= deadline)); then
      __apiary_ssh_fail "ssh barrier timed out after {timeout} s; no answer from: $left" {EXIT_SSH_BARRIER_TIMEOUT}
      return 0
    fi
    sleep {BARRIER_POLL_S}
  done
  echo "apiary: ssh barrier: every instance answers"
}}
__apiary_ssh
"""
