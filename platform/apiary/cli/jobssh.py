"""``apiary job ssh``: log in to a task instance of a job with the ssh runtime plugin.

Reads the job's SSH info (``GET /api/v2/jobs/{id}/ssh``: each instance's host, port and login, and
the host key every instance presents), writes that host key to
``APIARY_HOME/ssh/<alias>.known_hosts`` and execs the system ``ssh`` with the user's private key
(``--key``, else ``~/.ssh/id_ed25519`` or ``~/.ssh/id_rsa``; its public key must be on the account:
``apiary user ssh-key add``, or the job's ``userssh``), checking the host key strictly. A command
after ``--`` runs in BatchMode (no prompt: a refused key fails at once). ``--print-config`` prints
an ssh_config block per instance (``Host apiary-<user>-<job>-<role>-<index>``) for ``~/.ssh/config``,
which VS Code's Remote-SSH reads.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from apiary.errors import ApiaryError, NotFoundError, ValidationError

#: The private keys tried, in order, when ``--key`` is not given (ssh's own defaults).
DEFAULT_KEYS = ("~/.ssh/id_ed25519", "~/.ssh/id_rsa")


def _known_hosts(home: Path, info: dict) -> Path:
    """Write the job's host key where ssh reads it (0600 in a 0700 directory); its path."""
    directory = home / "ssh"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{info['hostKeyAlias']}.known_hosts"
    kind, blob = info["hostPublicKey"].split()[:2]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as f:
        f.write(f"{info['hostKeyAlias']} {kind} {blob}\n")
    return path


def _pick(info: dict, task: str | None) -> dict:
    tasks = info["tasks"]
    if task is not None:
        role, sep, index = task.partition("/")
        if not sep or not index.isdigit():
            raise ValidationError("--task", f"{task!r} must be ROLE/INDEX, e.g. worker/1")
        found = [t for t in tasks if t["taskRole"] == role and t["index"] == int(index)]
        if not found:
            raise NotFoundError(f"Job {info['jobId']} has no task {task}.")
        return found[0]
    running = [t for t in tasks if t["running"]]
    if not (running or tasks):
        raise NotFoundError(f"Job {info['jobId']} has no task instance yet.")
    return (running or tasks)[0]


def _key(key: Path | None) -> Path | None:
    if key is not None:
        return key.expanduser()
    for candidate in DEFAULT_KEYS:
        path = Path(candidate).expanduser()
        if path.is_file():
            return path
    return None


def _options(info: dict, known: Path, key: Path | None) -> list[tuple[str, str]]:
    opts = [("HostKeyAlias", info["hostKeyAlias"]), ("UserKnownHostsFile", str(known)),
            ("GlobalKnownHostsFile", "/dev/null"), ("StrictHostKeyChecking", "yes")]
    if key is not None:
        opts += [("IdentityFile", str(key)), ("IdentitiesOnly", "yes")]
    return opts


def config_block(info: dict, t: dict, known: Path, key: Path | None) -> str:
    """One ``Host apiary-<user>-<job>-<role>-<index>`` block for ``~/.ssh/config``."""
    lines = [f"Host {info['hostKeyAlias']}-{t['taskRole']}-{t['index']}", f"  HostName {t['host']}",
             f"  Port {t['port']}", f"  User {info['login']}"]
    lines += [f"  {k} {v}" for k, v in _options(info, known, key)]
    return "\n".join(lines) + "\n"


def ssh_argv(info: dict, t: dict, known: Path, key: Path | None, command: list[str]) -> list[str]:
    """The ``ssh`` command line that reaches instance ``t`` (``command``: run it in BatchMode)."""
    argv = ["ssh", "-p", str(t["port"]), "-l", info["login"]]
    for k, v in _options(info, known, key):
        argv += ["-o", f"{k}={v}"]
    if command:
        argv += ["-o", "BatchMode=yes"]
    argv.append(t["host"])
    return [*argv, "--", *command] if command else argv


def add_job_ssh_command(job_app: typer.Typer, client: Callable[[], Any], fail: Callable[[ApiaryError], None],
                        home: Callable[[], Path]) -> None:
    """Add ``ssh`` to the ``job`` command group; ``client()`` makes an API client, ``home()`` is
    APIARY_HOME."""

    @job_app.command("ssh")
    def job_ssh(
        job_id: str = typer.Argument(..., help="The job, user~name."),
        command: list[str] | None = typer.Argument(None, help="A command to run (after --), in BatchMode."),
        task: str | None = typer.Option(None, "--task", help="ROLE/INDEX; default the first running instance."),
        key: Path | None = typer.Option(None, "--key", help="Private key; default ~/.ssh/id_ed25519 or id_rsa."),
        print_config: bool = typer.Option(False, "--print-config",
                                          help="Print ssh_config blocks (VS Code Remote-SSH) instead of connecting."),
    ) -> None:
        """Log in to a task instance of a job with the ssh runtime plugin (OpenPAI's SSH info)."""
        try:
            info = client().job_ssh(job_id)
            if not info.get("hostPublicKey"):
                raise NotFoundError(f"Job {job_id} has no sshd yet (no ssh runtime plugin, or no task launched).")
            known = _known_hosts(home(), info)
            private = _key(key)
            if print_config:
                chosen = [_pick(info, task)] if task else info["tasks"]
                print("\n".join(config_block(info, t, known, private) for t in chosen if t["port"] and t["host"]))
                return
            t = _pick(info, task)
            if not t["running"] or not t["port"]:
                raise NotFoundError(f"Task {t['taskRole']}/{t['index']} of job {job_id} is not running "
                                    f"(state {t['state']}).")
        except ApiaryError as e:
            fail(e)
            return
        if private is None:
            typer.echo(f"no private key: none of {', '.join(DEFAULT_KEYS)} exists; pass --key", err=True)
            raise typer.Exit(2)
        ssh = shutil.which("ssh")
        if ssh is None:
            typer.echo("the ssh client (OpenSSH) is not installed", err=True)
            raise typer.Exit(2)
        argv = ssh_argv(info, t, known, private, list(command or []))
        os.execv(ssh, argv)
