"""A private OpenSSH server for tests: Debian's ``/usr/sbin/sshd``, never the system service.

:class:`Sshd` runs ``sshd -D -e -f <state>/sshd_config`` on a port of its own (a free one on
loopback, 22 inside a host of :mod:`apiary.hosts.netns`), with its own ed25519 host key, and
lets in one ``user`` with the given public keys only (no passwords, no PAM). The SFTP subsystem
is sshd's ``internal-sftp``, which sshfs mounts use; the SSH runtime plugin will log in the same
way. Its files, under the state directory (created)::

    sshd_config              written here
    ssh_host_ed25519_key     the host key (0600); .pub is :attr:`Sshd.host_key`
    authorized_keys/<user>   the user's keys (0644, root's: sshd reads it as the user)
    sshd.log                 sshd's output (-e: its log goes to stderr)

``StrictModes no``: sshd would refuse an ``authorized_keys`` whose path passes through a
group- or world-writable directory, and tests keep their files under ``/tmp`` (1777). The files
written here are root's and not writable by others. A user other than root must be able to
traverse the state directory's parents.

The server is stopped by :meth:`Sshd.stop` or the context manager's exit; on loopback it also gets
SIGTERM when the process that started it dies (``PR_SET_PDEATHSIG``), so a crashed test leaves no
sshd behind; inside a host the harness's teardown stops it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from apiary.hosts.netns import Hosts, HostsError
from apiary.procutil import die_with_parent, private_dir

__all__ = ["SSHD", "Sshd", "SshdError", "SshdNotFound", "generate_keypair", "sshd_available"]

#: Debian's sshd (package openssh-server).
SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 20.0
STOP_GRACE_S = 5.0


class SshdError(HostsError):
    """The private sshd could not be started or stopped; the message quotes its log."""


class SshdNotFound(SshdError):
    """sshd or ssh-keygen is not installed (Debian: openssh-server, openssh-client)."""


def sshd_available() -> str | None:
    """``None`` when this process can run a private sshd (root, sshd, ssh-keygen), else why not."""
    if os.geteuid() != 0:
        return "a private sshd needs root (it switches to the logged-in user)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (Debian: apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found (Debian: apt-get install openssh-client)"
    return None


def generate_keypair(path: Path | str, *, comment: str = "apiary-test") -> tuple[str, str]:
    """Make an ed25519 key pair at ``path`` (private, 0600) and ``path.pub`` with ssh-keygen,
    replacing any; returns ``(private key text, public key line "ssh-ed25519 AAAA... comment")``.
    Raises :class:`SshdNotFound` without ssh-keygen, :class:`SshdError` when it fails."""
    path = Path(path)
    if shutil.which("ssh-keygen") is None:
        raise SshdNotFound("ssh-keygen not found (Debian: apt-get install openssh-client)")
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    r = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        raise SshdError(f"ssh-keygen failed ({r.returncode}): {r.stderr.strip()}")
    return path.read_text(), path.with_name(path.name + ".pub").read_text().strip()


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class Sshd:
    """One private sshd (module doc).

    ``state_dir``: its files (created, 0700). ``user``: the one user it lets in (must exist on
    the machine), with ``public_keys`` (``authorized_keys`` lines). On loopback it listens on
    ``address`` (default 127.0.0.1) and ``port`` (default: a free one); inside host ``host`` of
    ``hosts`` on the host's address and ``port`` (default 22).
    """

    def __init__(self, state_dir: Path | str, *, user: str, public_keys: Sequence[str],
                 address: str = "127.0.0.1", port: int | None = None,
                 hosts: Hosts | None = None, host: str | None = None) -> None:
        if (hosts is None) != (host is None):
            raise SshdError("host: give both hosts and host, or neither (loopback)")
        self.state_dir = Path(state_dir)
        self.user = user
        self.public_keys = list(public_keys)
        self.hosts = hosts
        self.host = host
        self.address = hosts.address(host) if hosts is not None and host is not None else address
        self.port = port if port is not None else (22 if hosts is not None else 0)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def host_key(self) -> str:
        """The server's public host key, ``"ssh-ed25519 AAAA..."`` (a known_hosts key, no comment)."""
        text = (self.state_dir / "ssh_host_ed25519_key.pub").read_text().split()
        return f"{text[0]} {text[1]}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Sshd:
        """Write the config and keys, start sshd and wait (at most ``timeout_s``) until it sends
        its banner. Raises :class:`SshdNotFound`, :class:`SshdError` (its log quoted)."""
        why = sshd_available()
        if why is not None:
            raise SshdNotFound(why)
        state = private_dir(self.state_dir)
        keys = state / "authorized_keys"
        keys.mkdir(mode=0o755, exist_ok=True)
        os.chmod(keys, 0o755)
        (keys / self.user).write_text("".join(k.strip() + "\n" for k in self.public_keys))
        os.chmod(keys / self.user, 0o644)
        host_key = state / "ssh_host_ed25519_key"
        if not host_key.exists():
            generate_keypair(host_key, comment="apiary-test-host")
        # sshd refuses to start without its privilege separation directory (the service makes it)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for _attempt in range(5):  # a free port may be taken before sshd binds it
            port = self.port or _free_port(self.address)
            self._write_config(port)
            if self._launch(port, timeout_s):
                self.port = port
                return self
            if self.port:  # a port we were given: no second try
                break
        raise SshdError(f"sshd did not start on {self.address}: {self._log_tail()}")

    def _write_config(self, port: int) -> None:
        s = self.state_dir
        lines = [
            f"Port {port}",
            f"ListenAddress {self.address}",
            f"HostKey {s / 'ssh_host_ed25519_key'}",
            f"PidFile {s / 'sshd.pid'}",
            f"AuthorizedKeysFile {s / 'authorized_keys'}/%u",
            "AuthenticationMethods publickey",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            f"AllowUsers {self.user}",
            "Subsystem sftp internal-sftp",
            "PrintMotd no",
            "LogLevel VERBOSE",
            "",
        ]
        (s / "sshd_config").write_text("\n".join(lines))

    def _launch(self, port: int, timeout_s: float) -> bool:
        """Start sshd on ``port``; True once its banner arrives, False when it exits (the port
        taken after all); raises SshdError past ``timeout_s``."""
        argv = [SSHD, "-D", "-e", "-f", str(self.state_dir / "sshd_config")]
        r = subprocess.run([SSHD, "-t", "-f", str(self.state_dir / "sshd_config")],
                           capture_output=True, text=True, timeout=30, check=False)
        if r.returncode != 0:
            raise SshdError(f"sshd -t refuses the config: {r.stderr.strip()}")
        self._log = open(self.state_dir / "sshd.log", "ab")  # noqa: SIM115 (closed in stop)
        if self.hosts is not None and self.host is not None:
            self._process = self.hosts.run(self.host, argv, stdout=self._log, stderr=subprocess.STDOUT)
        else:
            self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self.stop()
                return False
            try:
                with socket.create_connection((self.address, port), timeout=1) as c:
                    c.settimeout(2)
                    if c.recv(8).startswith(b"SSH-"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise SshdError(f"sshd did not answer on {self.address}:{port} within {timeout_s:g} s: {self._log_tail()}")

    def stop(self) -> None:
        """Stop sshd (SIGTERM to its group, SIGKILL after a grace) and the sessions it forked.
        Idempotent."""
        p, self._process = self._process, None
        if p is not None:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
            if self.hosts is not None:
                with contextlib.suppress(HostsError, subprocess.TimeoutExpired):
                    self.hosts.stop(p, grace_s=0.1)
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self) -> str:
        try:
            return (self.state_dir / "sshd.log").read_text(errors="replace")[-1500:] or "(empty log)"
        except OSError:
            return "(no log)"

    def __enter__(self) -> Sshd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
