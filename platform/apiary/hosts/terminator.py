"""TLS termination with Debian's nginx in front of a component that serves plain HTTP only.

Which components need it: **the Prefect server**. ``prefect server start`` (Prefect 3.8.8) takes
``--host``, ``--port``, ``--keep-alive-timeout``, ``--log-level``, ``--workers`` and service
switches, and calls ``uvicorn.run(...)`` with host, port, keep-alive and websocket ping settings
only (``prefect/cli/_server_utils.py``): no certificate option and no ``PREFECT_SERVER_*``
setting reaches uvicorn's ``ssl_certfile``/``ssl_keyfile``. (Prefect's ``PREFECT_API_SSL_CERT_FILE``
is the *client's* CA bundle, the right setting for the bridge and the flows to verify this
terminator.) Running ``uvicorn --factory prefect.server.api.server:create_app --ssl-certfile ...``
by hand would bypass Prefect's own start-up (settings, services, migrations), which Prefect does not
support; a terminator keeps Prefect as Prefect runs it. Apiary's control plane serves TLS itself
(``APIARY_TLS_CERT``/``APIARY_TLS_KEY``, :func:`apiary.pki.server_ssl_kwargs`) and needs none.

:class:`Terminator` writes its own ``nginx.conf`` into ``workdir`` and runs ``nginx`` in the
foreground (``daemon off``) with every path it writes (pid file, error and access logs, temp
directories) under ``workdir``, so it needs no system service and leaves ``/etc/nginx`` alone.
It listens with TLS on ``listen_host:listen_port`` (the host's address) and passes every request
to ``upstream_url``, which must be plain HTTP on **loopback** (the plain port never leaves the
host; anything else is refused). The proxy:

- upgrades websockets (``Upgrade``/``Connection`` headers, HTTP/1.1 to the upstream), as Prefect's
  ``/api/events/in``, ``/api/events/out``, ``/api/logs/out`` and
  ``/api/task_runs/subscriptions/scheduled`` need (nginx's "WebSocket proxying" guide: the
  hop-by-hop headers are not passed unless set explicitly);
- keeps long polls and websockets open for ``read_timeout_s`` (``proxy_read_timeout``, nginx's
  default 60 s; Prefect's server pings websockets every
  ``PREFECT_SERVER_API_WEBSOCKET_PING_INTERVAL``, 20 s by default, and Apiary's long polls wait
  less than the default 300 s) and buffers neither requests nor answers (streams pass as they
  come; no temp files);
- passes ``Host`` as the client sent it and ``X-Forwarded-For``/``X-Forwarded-Proto: https``;
- takes TLS 1.2 and 1.3 only (Mozilla's "intermediate" profile's protocols).

For the Prefect UI to reach its API through the terminator, set ``PREFECT_UI_API_URL`` to the
terminator's ``https://<host>:<port>/api`` on the Prefect server.

Needs the ``nginx`` binary (Debian package ``nginx``; ``.ci/run`` installs it); raises
:class:`TerminatorError` when it is missing, when nginx exits at start (the error log's tail
in the message) or is not ready within ``START_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from apiary.client import is_loopback_host
from apiary.errors import PlatformError, PortInUseError, ValidationError

__all__ = ["Terminator", "TerminatorError", "find_nginx"]

#: How long :meth:`Terminator.start` waits for nginx to listen, seconds (a busy 2-core machine).
START_TIMEOUT_S = 30.0
#: How long :meth:`Terminator.stop` waits for a graceful stop before SIGTERM, then SIGKILL, seconds.
STOP_TIMEOUT_S = 10.0


class TerminatorError(PlatformError):
    """nginx is missing, or did not start (the message carries its error log's tail). HTTP 500."""

    code = "TerminatorError"


def find_nginx() -> Path:
    """The ``nginx`` binary: on ``PATH``, else ``/usr/sbin/nginx`` (Debian's, outside a non-root
    ``PATH``). Raises :class:`TerminatorError` naming the package to install."""
    found = shutil.which("nginx") or (os.access("/usr/sbin/nginx", os.X_OK) and "/usr/sbin/nginx")
    if not found:
        raise TerminatorError("nginx is not installed: apt-get install nginx (Debian's package; no service "
                              "needs to run, the terminator starts its own)")
    return Path(found)


def _listen_address(host: str, port: int) -> str:
    """nginx's ``listen`` address: ``[v6]:port`` or ``v4-or-name:port``."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip() or "(empty)"
    except OSError:
        return "(no log)"


class Terminator:
    """nginx terminating TLS on ``listen_host:listen_port`` for the plain HTTP ``upstream_url``.

    ``cert``/``key``: the server certificate (signed by the platform CA, its SANs naming the
    addresses clients use) and its key (0600; nginx's master reads it before any worker starts,
    so it may stay readable by root only). ``workdir``: where the config, pid file, logs and temp
    directories go (created). ``runner``: starts the command line instead of this object, e.g.
    ``lambda argv: hosts.run("prefect", argv)`` to run nginx inside a host of
    :class:`apiary.hosts.netns.Hosts` (which then tracks and stops it too); it must return the
    nginx process itself (``ip netns exec`` execs nginx, keeping the pid).
    ``read_timeout_s``: how long a proxied connection may stay quiet (long polls, websockets),
    seconds.

    Raises :class:`~apiary.errors.ValidationError` naming the argument for an upstream that is
    not ``http://<loopback>:<port>`` without a path, a port outside 1..65535, or a missing
    certificate or key file.
    """

    def __init__(self, listen_host: str, listen_port: int, upstream_url: str, cert: Path, key: Path,
                 workdir: Path, *, runner: Callable[[list[str]], subprocess.Popen[bytes]] | None = None,
                 read_timeout_s: float = 300.0) -> None:
        if not 0 < listen_port < 65536:
            raise ValidationError("listen_port", f"{listen_port} is not a TCP port")
        up = urlsplit(upstream_url)
        if up.scheme != "http" or not up.hostname or not up.port or up.path not in ("", "/") or up.query:
            raise ValidationError("upstream_url", f"{upstream_url!r} must be http://<loopback address>:<port>")
        if not is_loopback_host(up.hostname):
            raise ValidationError("upstream_url", f"{upstream_url!r} is not on loopback: the plain-HTTP port "
                                                  "must not be reachable from other hosts")
        for field, path in (("cert", cert), ("key", key)):
            if not path.is_file():
                raise ValidationError(field, f"{path} does not exist")
        if read_timeout_s <= 0:
            raise ValidationError("read_timeout_s", f"{read_timeout_s} must be > 0")
        self.listen_host, self.listen_port = listen_host, listen_port
        self.upstream_url = f"http://{up.netloc}"
        self.cert, self.key = cert.resolve(), key.resolve()
        self.workdir = workdir.resolve()
        self.runner = runner
        self.read_timeout_s = read_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    # --- paths and config ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``https://<listen_host>:<listen_port>``: the address clients use."""
        return f"https://{_listen_address(self.listen_host, self.listen_port)}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "nginx.conf"

    @property
    def pid_path(self) -> Path:
        return self.workdir / "nginx.pid"

    @property
    def error_log(self) -> Path:
        return self.workdir / "error.log"

    def render(self) -> str:
        """The ``nginx.conf`` text (see the module docstring for what it sets)."""
        w = self.workdir
        timeout = f"{self.read_timeout_s:.0f}s"
        temp = "\n".join(f"    {kind}_temp_path {w / (kind + '_temp')};"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        return f"""# Written by apiary.hosts.terminator; replaced at every start.
daemon off;
worker_processes 1;
pid {self.pid_path};
error_log {self.error_log} warn;
# long polls and websockets: a stop waits this long for them, then closes them
worker_shutdown_timeout 10s;

events {{
    worker_connections 4096;
}}

http {{
    access_log {w / "access.log"};
{temp}
    # the upstream judges body sizes (Apiary's APIARY_MAX_BODY_BYTES)
    client_max_body_size 0;
    server_tokens off;

    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}

    server {{
        listen {_listen_address(self.listen_host, self.listen_port)} ssl;
        ssl_certificate {self.cert};
        ssl_certificate_key {self.key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:apiary_tls:1m;

        location / {{
            proxy_pass {self.upstream_url};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto https;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout {timeout};
            proxy_send_timeout {timeout};
        }}
    }}
}}
"""

    def argv(self) -> list[str]:
        """The command line that runs nginx with this config. ``-e`` sends the errors of start-up,
        before the config is read, to the work directory's log too."""
        return [str(find_nginx()), "-p", str(self.workdir), "-c", str(self.config_path),
                "-e", str(self.error_log)]

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Terminator:
        """Write the config and start nginx; returns ``self`` once it listens.

        Ready means: nginx wrote its pid file, which its master does only after binding and
        listening on every ``listen`` socket (nginx.c: ``ngx_init_cycle`` opens the listening
        sockets before ``ngx_create_pidfile``); this works inside another network namespace too.
        Raises :class:`~apiary.errors.PortInUseError` when the address is taken,
        :class:`TerminatorError` (with the error log's tail) when nginx exits or is not ready in
        ``timeout_s`` seconds. Calling it on a running terminator does nothing.
        """
        if self.running:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.render(), encoding="utf-8")
        self.pid_path.unlink(missing_ok=True)
        argv = self.argv()
        if self.runner is not None:
            self._process = self.runner(argv)
        else:
            with open(self.workdir / "nginx.out", "ab") as out:
                self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                                 stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log = _tail(self.error_log)
                self._process = None
                if "Address already in use" in log:
                    raise PortInUseError(self.listen_port, self.listen_host)
                raise TerminatorError(f"nginx exited at start ({' '.join(argv)}): {log}")
            with contextlib.suppress(OSError, ValueError):
                if int(self.pid_path.read_text().strip()) == self._process.pid:
                    return self
            time.sleep(0.05)
        self.stop()
        raise TerminatorError(f"nginx did not listen on {self.url} within {timeout_s:.0f} s: {_tail(self.error_log)}")

    @property
    def running(self) -> bool:
        """Whether the nginx this object started is running."""
        return self._process is not None and self._process.poll() is None

    def stop(self, graceful: bool = True, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop nginx: SIGQUIT (graceful: stop accepting, finish requests under way, at most
        ``worker_shutdown_timeout``) or, with ``graceful=False``, SIGTERM (fast: close now), as
        nginx's "Controlling nginx" docs define them; SIGKILL to its process group when it is not
        gone within ``timeout_s`` seconds. Idempotent; the work directory is kept (logs)."""
        p = self._process
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGQUIT if graceful else signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(p.pid) == p.pid:  # its own group: the workers go too
                        os.killpg(p.pid, signal.SIGKILL)
                    else:
                        p.kill()
                p.wait(timeout=10)
        self._process = None

    def __enter__(self) -> Terminator:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
