"""dockerd and a private Docker registry, started on this machine when they are not running.

* :func:`ensure_dockerd` starts Debian's ``dockerd`` (package ``docker.io``) with
  ``--bridge=none --iptables=false --ip-masq=false`` -- the flags these machines need: no bridge
  or NAT rules can be made, so every container uses host networking -- unless the socket already
  answers. It needs root.
* :class:`Registry` runs Debian's ``docker-registry`` (package ``docker-registry``: the CNCF
  distribution registry, API v2) on ``127.0.0.1:<port>`` with its storage under a directory of
  ``APIARY_HOME``. dockerd treats registries on 127.0.0.0/8 as insecure by default, so pushes and
  pulls need no TLS here.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from apiary.errors import PlatformError, UnavailableError
from apiary.procutil import PRIVATE_UMASK, open_private, private_dir, write_private

logger = logging.getLogger(__name__)

DOCKERD_FLAGS = ("--bridge=none", "--iptables=false", "--ip-masq=false")


def docker_client(timeout: int = 120) -> Any:
    """``docker.from_env()``; raises :class:`UnavailableError` when dockerd does not answer."""
    import docker

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except docker.errors.DockerException as exc:
        raise UnavailableError(f"dockerd does not answer: {exc}") from exc


def ensure_dockerd(log_path: Path, timeout_s: float = 60.0) -> subprocess.Popen[bytes] | None:
    """Return at once if dockerd answers; else start it (output to ``log_path``) and wait until it
    answers (``log_path`` is 0600; dockerd keeps its own umask, its files are not the home's).
    Returns the process started, or ``None`` if one was already running (it is left
    alone). Raises :class:`PlatformError` when ``dockerd`` is not installed or exits, and
    :class:`UnavailableError` when it does not answer within ``timeout_s`` seconds."""
    try:
        docker_client(timeout=5)
        return None
    except UnavailableError:
        pass
    binary = shutil.which("dockerd") or ("/usr/sbin/dockerd" if os.path.exists("/usr/sbin/dockerd") else None)
    if binary is None:
        raise PlatformError("dockerd is not installed (apt-get install docker.io)")
    private_dir(log_path.parent)
    with open_private(log_path) as log:
        proc = subprocess.Popen([binary, *DOCKERD_FLAGS], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PlatformError(f"dockerd exited with {proc.returncode}; see {log_path}")
        try:
            docker_client(timeout=5)
            logger.info("dockerd started pid=%d", proc.pid)
            return proc
        except UnavailableError:
            time.sleep(0.2)
    raise UnavailableError(f"dockerd did not answer within {timeout_s} s; see {log_path}")


REGISTRY_CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


@dataclass
class Registry:
    """A ``docker-registry`` on ``127.0.0.1:port`` storing under ``root`` (0700; the registry runs
    with umask 077).

    :meth:`start` (blocks until ``/v2/`` answers, at most ``timeout_s``), :meth:`stop`;
    :attr:`address` is the ``host:port`` image names start with."""

    root: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def argv(self) -> list[str]:
        """The command line, for a supervisor that restarts it (writes the config file)."""
        binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
        if not os.path.exists(binary):
            raise PlatformError("docker-registry is not installed (apt-get install docker-registry)")
        private_dir(self.root)
        config = self.root / "config.yml"
        write_private(config, REGISTRY_CONFIG.format(root=self.root / "data", port=self.port))
        return [binary, "serve", str(config)]

    def start(self, log_path: Path, timeout_s: float = 30.0) -> Registry:
        argv = self.argv()
        with open_private(log_path) as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, umask=PRIVATE_UMASK)
        self.wait(timeout_s, log_path)
        return self

    def wait(self, timeout_s: float = 30.0, log_path: Path | None = None) -> None:
        """Until ``GET /v2/`` answers 200. Raises :class:`UnavailableError` after ``timeout_s``,
        :class:`PlatformError` if the process this object started exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise PlatformError(f"docker-registry exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{self.url}/v2/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise UnavailableError(f"docker-registry at {self.url} did not answer within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def list_images(registry_url: str, timeout_s: float = 10.0) -> dict[str, list[str]]:
    """``{repository: [tags]}`` of the registry at ``registry_url`` (API v2: ``/v2/_catalog`` and
    ``/v2/<name>/tags/list``; the catalog's first 1,000 repositories). Raises
    :class:`UnavailableError` when it does not answer."""
    try:
        with httpx.Client(base_url=registry_url, timeout=timeout_s) as c:
            repos = c.get("/v2/_catalog", params={"n": 1000}).raise_for_status().json().get("repositories") or []
            return {r: sorted(c.get(f"/v2/{r}/tags/list").raise_for_status().json().get("tags") or [])
                    for r in repos}
    except httpx.HTTPError as exc:
        raise UnavailableError(f"registry {registry_url} does not answer: {exc}") from exc
