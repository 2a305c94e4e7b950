"""A small synchronous client of Apiary's REST API, used by the CLI, the demo and tests.

Also the transport rules every Apiary HTTP caller shares (the agent, the Prefect bridge, replicas
forwarding writes): :func:`http_verify` (what httpx verifies HTTPS against) and
:func:`check_token_transport` (no token in clear over the network).
"""

from __future__ import annotations

import builtins  # the client has a method named list
import ipaddress
import ssl
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from apiary.errors import PlaintextTokenError, UnavailableError, ValidationError, error_from_response

#: Methods that change nothing on the server (RFC 9110 section 9.2.1): after any transport error
#: they are retried on the next replica; other methods only when the connection was never made.
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

#: With several replicas, how long a connection (TCP and TLS handshake) may take before the next
#: replica is tried, seconds: a replica whose host is down or cut off answers nothing, and waiting
#: the whole call timeout for it would outlast the leader lease (6 s) that replaces it.
FAILOVER_CONNECT_TIMEOUT_S = 3.0

#: Transports that answer inside this process (tests' fakes): nothing they carry reaches a network,
#: so :func:`check_token_transport` does not apply to them.
_IN_PROCESS_TRANSPORTS = (httpx.MockTransport, httpx.WSGITransport)


def split_api_urls(api_url: str) -> list[str]:
    """The control-plane replicas' URLs of ``api_url`` (one URL, or several comma-separated), each
    without a trailing ``/``. Raises :class:`~apiary.errors.ValidationError` (field
    ``APIARY_API_URL``) when there is none or one is not ``http://`` or ``https://``."""
    urls = [u.strip().rstrip("/") for u in api_url.split(",") if u.strip()]
    if not urls:
        raise ValidationError("APIARY_API_URL", f"{api_url!r} holds no URL")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValidationError("APIARY_API_URL", f"{url!r} must be http://HOST[:PORT] or https://HOST[:PORT]")
    return urls


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a URL's host name, without brackets) is this machine's loopback:
    ``localhost`` (RFC 6761 section 6.3 reserves it for loopback), 127.0.0.0/8 or ::1."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token_transport(url: str, token: str | None) -> None:
    """Refuse to send ``token`` over plain HTTP to a host that is not loopback.

    ``url`` is one URL (``http://198.18.0.2:8080``). Plain HTTP is allowed without a token, and to
    loopback with one (nothing leaves the machine). Raises
    :class:`~apiary.errors.PlaintextTokenError`, whose message names the settings to change
    (``APIARY_API_URL`` to ``https://``, ``APIARY_CA_CERT``). The token itself is never in the
    message.
    """
    if not token:
        return
    parts = urlsplit(url)
    if parts.scheme == "http" and not is_loopback_host(parts.hostname or ""):
        where = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        raise PlaintextTokenError(
            f"refusing to send a token over plain HTTP to {where}, which is not a loopback address: set "
            "APIARY_API_URL (or --api) to the control plane's https:// URL and APIARY_CA_CERT to the platform "
            "CA's certificate (apiary ca init / apiary ca issue)", url=where)


def http_verify(ca_cert: Path | None) -> ssl.SSLContext | bool:
    """What to pass as httpx's ``verify=``: an SSL context that trusts only the platform CA in
    ``ca_cert`` (PEM; host names and IP addresses checked against the certificate's SANs), or
    ``True`` (httpx's default CAs) when ``ca_cert`` is None. Raises
    :class:`~apiary.errors.ValidationError` (field ``APIARY_CA_CERT``) when the file cannot be read
    or holds no certificate."""
    if ca_cert is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(ca_cert))
    except (OSError, ssl.SSLError) as e:
        raise ValidationError("APIARY_CA_CERT", f"cannot load the CA certificate {ca_cert}: {e}") from e


def _verify_failure(e: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error in ``e``'s cause chain, if any."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class ApiaryClient:
    """Calls the control plane at ``api_url`` with ``token`` (``Authorization: Bearer``; the
    caller's identity: a user, a node agent or a service). Error answers come back as the
    :mod:`apiary.errors` class of :func:`~apiary.errors.error_from_response`, carrying the server's
    message and status; an unreachable server raises UnavailableError.

    ``api_url``: one URL or several comma-separated (control-plane replicas). A call whose
    connection cannot be made (refused, timed out, TLS handshake failed) is tried on the next URL,
    and so is a GET/HEAD that failed in transit; the client then keeps to the URL that answered.
    ``timeout`` bounds each call, seconds; with several URLs a connection may take at most
    :data:`FAILOVER_CONNECT_TIMEOUT_S` before the next is tried. Other calls that fail in transit
    are not retried (a POST may have been committed), and error answers (4xx, 5xx) never are.
    ``ca_cert``: the platform CA (PEM) HTTPS is verified against (None: httpx's default CAs).
    Raises :class:`~apiary.errors.PlaintextTokenError` at construction when a token would go over
    plain HTTP to a host that is not loopback (unless ``transport`` is an in-process fake,
    ``httpx.MockTransport`` or ``httpx.WSGITransport``, which sends nothing over a network).
    """

    def __init__(self, api_url: str, timeout: float = 30.0, transport: httpx.BaseTransport | None = None,
                 token: str | None = None, ca_cert: Path | None = None) -> None:
        self.api_urls = split_api_urls(api_url)
        if not isinstance(transport, _IN_PROCESS_TRANSPORTS):
            for url in self.api_urls:
                check_token_transport(url, token)
        self._current = 0
        self._timeout = timeout
        self._transport = transport
        self._ca_cert = ca_cert
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        connect = min(timeout, FAILOVER_CONNECT_TIMEOUT_S) if len(self.api_urls) > 1 else timeout
        # transport: tests pass httpx.MockTransport.
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=connect), transport=transport,
                                  headers=headers, verify=http_verify(ca_cert))

    @property
    def api_url(self) -> str:
        """The replica the client calls now (the first, or the last one that answered)."""
        return self.api_urls[self._current]

    def as_token(self, token: str) -> ApiaryClient:
        """Another client of the same API with another identity (same replicas, CA and transport).
        Raises :class:`~apiary.errors.PlaintextTokenError` as the constructor does."""
        other = ApiaryClient(",".join(self.api_urls), timeout=self._timeout, transport=self._transport,
                             token=token, ca_cert=self._ca_cert)
        other._current = self._current
        return other

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The answer of the first replica (from the current one on) that answers; raises
        UnavailableError naming each replica's failure when none does."""
        failures: list[str] = []
        last: httpx.TransportError | None = None
        n = len(self.api_urls)
        for step in range(n):
            i = (self._current + step) % n
            url = self.api_urls[i]
            try:
                r = self._http.request(method, url + path, **kw)
            except httpx.TransportError as e:
                last = e
                failures.append(f"{url} is not reachable: {self._why(e)}")
                never_sent = isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)
                if never_sent or method.upper() in _SAFE_METHODS:
                    continue
                break
            self._current = i
            return r
        raise UnavailableError("Apiary API at " + "; ".join(failures)) from last

    def _why(self, e: httpx.TransportError) -> str:
        """One line on why a call failed in transit; a failed certificate verification names the
        CA it was verified against and the setting that chooses it."""
        bad_cert = _verify_failure(e)
        if bad_cert is None:
            return f"{type(e).__name__}: {e}"
        against = f"the CA in {self._ca_cert} (APIARY_CA_CERT)" if self._ca_cert else \
            "the system's CAs (set APIARY_CA_CERT to the platform CA's certificate)"
        return f"TLS certificate verification failed against {against}: {bad_cert.verify_message or bad_cert}"

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        r = self._send(method, path, **kw)
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content)
        return r

    def health(self) -> dict:
        """``GET /healthz``'s body: ``status`` ``ok`` or ``unhealthy`` (with ``reason``), and
        ``clusterId``. An unhealthy platform (503 with a body) is answered, not raised: it is still
        the platform a home names. Raises :class:`UnavailableError` when unreachable."""
        r = self._send("GET", "/healthz")
        if r.status_code == 503:
            try:
                body = r.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and "clusterId" in body:
                return body
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content)
        return r.json()

    def submit(self, job: str | Path, flow_run_id: str | None = None, on_behalf_of: str | None = None) -> dict:
        """Submit a job as the token's user (``on_behalf_of``: the bridge's token only)."""
        text = Path(job).read_text() if isinstance(job, Path) else job
        headers = {"Content-Type": "text/yaml"}
        if flow_run_id:
            headers["X-Apiary-Flow-Run-Id"] = flow_run_id
        if on_behalf_of:
            headers["X-Apiary-On-Behalf-Of"] = on_behalf_of
        return self._call("POST", "/api/v2/jobs", content=text.encode(), headers=headers).json()

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/api/v2/jobs/{job_id}").json()

    def list(self, **filters) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/jobs", params={k: v for k, v in filters.items() if v}).json()

    def stop(self, job_id: str) -> dict:
        return self._call("PUT", f"/api/v2/jobs/{job_id}/executionType", json={"value": "STOP"}).json()

    def logs(self, job_id: str, task_role: str | None = None, index: int = 0, stream: str = "stdout",
             attempt: int | None = None) -> str:
        params: dict[str, str | int] = {"index": index, "stream": stream}
        if task_role:
            params["taskRole"] = task_role
        if attempt is not None:
            params["attempt"] = attempt
        return self._call("GET", f"/api/v2/jobs/{job_id}/logs", params=params).text

    def nodes(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/nodes").json()

    def node(self, node: str) -> dict:
        """``GET /api/v2/nodes/{node}``: the node with its cordons."""
        return self._call("GET", f"/api/v2/nodes/{node}").json()

    def cordon(self, node: str, value: bool = True, *, reason: str | None = None, source: str | None = None,
               all: bool = False) -> dict:
        """Set (``value``) or remove ``source``'s cordon (None: the server's default, ``admin``) with
        ``reason``; ``all`` with ``value=False`` removes every cordon. Returns the node."""
        body: dict[str, object] = {"value": value}
        if reason is not None:
            body["reason"] = reason
        if source is not None:
            body["source"] = source
        if all:
            body["all"] = True
        return self._call("PUT", f"/api/v2/nodes/{node}/cordon", json=body).json()

    def events(self, after: int = 0, job_id: str | None = None, limit: int = 1000) -> builtins.list[dict]:
        params: dict[str, str | int] = {"after": after, "limit": limit}
        if job_id:
            params["jobId"] = job_id
        return self._call("GET", "/api/v2/events", params=params).json()["events"]

    def cluster_status(self, vc: str | None = None) -> dict:
        return self._call("GET", "/api/v2/cluster/status", params={"vc": vc} if vc else None).json()

    def apply_cluster_config(self, text: str) -> dict:
        return self._call("PUT", "/api/v2/cluster/config", content=text.encode(),
                          headers={"Content-Type": "text/yaml"}).json()

    # ------------------------------------------------------------------ identity
    def me(self) -> dict:
        return self._call("GET", "/api/v2/me").json()

    def users(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/users").json()

    def create_user(self, name: str, groups: builtins.list[str] | None = None, email: str | None = None) -> dict:
        return self._call("POST", "/api/v2/users", json={"username": name, "groups": groups, "email": email}).json()

    def delete_user(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/users/{name}")

    def groups(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/groups").json()

    def create_group(self, name: str, virtual_clusters: builtins.list[str] = (),  # type: ignore[assignment]
                     admin: bool = False, description: str = "") -> dict:
        return self._call("POST", "/api/v2/groups", json={
            "groupname": name, "virtualClusters": list(virtual_clusters), "admin": admin,
            "description": description}).json()

    def delete_group(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/groups/{name}")

    def set_member(self, group: str, user: str, member: bool = True) -> dict:
        return self._call("PUT" if member else "DELETE", f"/api/v2/groups/{group}/members/{user}").json()

    def set_grant(self, group: str, virtual_cluster: str, granted: bool = True) -> dict:
        path = f"/api/v2/groups/{group}/virtualClusters/{virtual_cluster}"
        return self._call("PUT" if granted else "DELETE", path).json()

    def create_token(self, subject: str | None = None, kind: str = "user", description: str = "",
                     expires_in_s: float | None = 90 * 86400.0) -> dict:
        """A new token (``{"token", "id", ...}``; the token is shown once)."""
        return self._call("POST", "/api/v2/tokens", json={
            "kind": kind, "subject": subject, "description": description, "expiresInS": expires_in_s}).json()

    def tokens(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/tokens").json()

    def revoke_token(self, token_id: str) -> dict:
        return self._call("DELETE", f"/api/v2/tokens/{token_id}").json()

    # ------------------------------------------------------------------ ssh
    def ssh_keys(self, user: str) -> builtins.list[dict]:
        """The SSH public keys on ``user``'s account: ``[{"title", "value", "fingerprint", "created"}]``."""
        return self._call("GET", f"/api/v2/users/{user}/sshKeys").json()

    def add_ssh_key(self, user: str, title: str, value: str) -> dict:
        return self._call("POST", f"/api/v2/users/{user}/sshKeys", json={"title": title, "value": value}).json()

    def remove_ssh_key(self, user: str, title: str) -> None:
        self._call("DELETE", f"/api/v2/users/{user}/sshKeys/{title}")

    def job_ssh(self, job_id: str) -> dict:
        """OpenPAI's SSH info of a job: ``{"jobId", "login", "hostKeyAlias", "hostPublicKey", "tasks"}``."""
        return self._call("GET", f"/api/v2/jobs/{job_id}/ssh").json()

    # ------------------------------------------------------------------ job templates
    def templates(self, q: str | None = None, tag: str | None = None) -> builtins.list[dict]:
        """The job templates the token's user sees (``q``: text in name, summary or tags; ``tag``)."""
        return self._call("GET", "/api/v2/templates", params={k: v for k, v in (("q", q), ("tag", tag)) if v}).json()

    def template(self, name: str) -> dict:
        return self._call("GET", f"/api/v2/templates/{name}").json()

    def publish_template(self, doc: dict) -> dict:
        """Publish a template document (apiary.spec.template) owned by the token's user."""
        return self._call("POST", "/api/v2/templates", json=doc).json()

    def update_template(self, name: str, doc: dict) -> dict:
        """Replace template ``name`` (its owner or an admin)."""
        return self._call("PUT", f"/api/v2/templates/{name}", json=doc).json()

    def delete_template(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/templates/{name}")

    def run_template(self, name: str, parameters: dict | None = None, *, job_name: str | None = None,
                     virtual_cluster: str | None = None, flow_run_id: str | None = None,
                     on_behalf_of: str | None = None) -> dict:
        """Run template ``name`` with ``parameters`` (the rest keep their defaults) as the token's
        user (``on_behalf_of``: the bridge's token only); the submitted job's JSON."""
        body: dict = {"parameters": parameters or {}}
        if job_name:
            body["name"] = job_name
        if virtual_cluster:
            body["virtualCluster"] = virtual_cluster
        headers = {}
        if flow_run_id:
            headers["X-Apiary-Flow-Run-Id"] = flow_run_id
        if on_behalf_of:
            headers["X-Apiary-On-Behalf-Of"] = on_behalf_of
        return self._call("POST", f"/api/v2/templates/{name}/runs", json=body, headers=headers).json()

    # ------------------------------------------------------------------ storage
    def storage_servers(self) -> builtins.list[dict]:
        """Storage servers, secrets redacted (admins)."""
        return self._call("GET", "/api/v2/storages/servers").json()

    def put_storage_server(self, name: str, type_: str, data: dict) -> dict:
        """Create or replace a storage server (admins)."""
        return self._call("PUT", f"/api/v2/storages/servers/{name}", json={"type": type_, "data": data}).json()

    def delete_storage_server(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/storages/servers/{name}")

    def storage_configs(self) -> builtins.list[dict]:
        """The storage configs the token's user may use (admins: all)."""
        return self._call("GET", "/api/v2/storages/configs").json()

    def storage_config(self, name: str) -> dict:
        return self._call("GET", f"/api/v2/storages/configs/{name}").json()

    def put_storage_config(self, name: str, mount_infos: builtins.list[dict], default: bool = False) -> dict:
        """Create or replace a storage config (admins): OpenPAI's ``mountInfos``."""
        return self._call("PUT", f"/api/v2/storages/configs/{name}",
                          json={"default": default, "mountInfos": mount_infos}).json()

    def delete_storage_config(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/storages/configs/{name}")

    def set_storage_grant(self, group: str, config: str, granted: bool = True) -> dict:
        """Grant (or revoke) a group a storage config (admins); the group as the API shows it."""
        return self._call("PUT" if granted else "DELETE", f"/api/v2/groups/{group}/storageConfigs/{config}").json()

    def storage_list(self, config: str, path: str = "") -> builtins.list[dict]:
        """``[{name, type, size, mtime}]`` of a directory in a config (a file: its own entry)."""
        return self._call("GET", f"/api/v2/storages/configs/{config}/list", params={"path": path}).json()

    def storage_upload(self, config: str, path: str, source: Path, *, overwrite: bool = True,
                       progress: Any = None, chunk_bytes: int = 1 << 20) -> dict:
        """Stream the local file ``source`` to ``config:path``; ``progress(bytes)`` is called per
        chunk sent. Returns ``{"path", "size"}``. The file's size is sent as ``Content-Length``, so a
        file over the platform's limit is refused (413) before any byte is sent."""
        size = source.stat().st_size

        def chunks() -> Any:
            with source.open("rb") as f:
                while block := f.read(chunk_bytes):
                    if progress is not None:
                        progress(len(block))
                    yield block

        return self._call("PUT", f"/api/v2/storages/configs/{config}/files",
                          params={"path": path, "overwrite": str(overwrite).lower()}, content=chunks(),
                          headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}).json()

    def storage_download(self, config: str, path: str, dest: Path, *, progress: Any = None) -> int:
        """Stream ``config:path`` into the local file ``dest`` (written beside it, then renamed);
        ``progress(bytes, total)`` per chunk. Returns the bytes written. Raises what the API answers."""
        url = self.api_urls[self._current] + f"/api/v2/storages/configs/{config}/files"
        part = dest.with_name(dest.name + ".part")
        written = 0
        try:
            with self._http.stream("GET", url, params={"path": path}) as r:
                if r.status_code >= 400:
                    raise error_from_response(r.status_code, r.read())
                total = int(r.headers.get("Content-Length", "0") or 0)
                with part.open("wb") as f:
                    for block in r.iter_bytes():
                        f.write(block)
                        written += len(block)
                        if progress is not None:
                            progress(len(block), total)
            part.replace(dest)
        except httpx.TransportError as e:
            raise UnavailableError(f"Apiary API at {url}: {self._why(e)}") from e
        finally:
            part.unlink(missing_ok=True)
        return written

    def storage_remove(self, config: str, path: str, recursive: bool = False) -> None:
        self._call("DELETE", f"/api/v2/storages/configs/{config}/files",
                   params={"path": path, "recursive": str(recursive).lower()})

    # ---------------------------------------------------------------- models (MLflow's registry)
    def models(self) -> builtins.list[dict]:
        """The registered models the caller may read: ``[{name, description, latestVersions, ...}]``."""
        return self._call("GET", "/api/v2/models").json()

    def model(self, name: str) -> dict:
        """One registered model with ``versions`` (newest first)."""
        return self._call("GET", f"/api/v2/models/{quote(name, safe='')}").json()

    def model_version(self, name: str, version: str) -> dict:
        """One version with its lineage (``run``, ``job``)."""
        return self._call("GET", f"/api/v2/models/{quote(name, safe='')}/versions/{version}").json()

    def model_download(self, name: str, version: str, dest: Path) -> builtins.list[str]:
        """Download the version's files into directory ``dest`` (made if missing); returns the paths
        written, relative to ``dest``. Raises what the API answers, ValidationError for a tar entry
        that would leave ``dest``."""
        import tarfile
        import tempfile

        url = self.api_urls[self._current] + f"/api/v2/models/{quote(name, safe='')}/versions/{version}/download"
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as buf:
            try:
                with self._http.stream("GET", url) as r:
                    if r.status_code >= 400:
                        raise error_from_response(r.status_code, r.read())
                    for block in r.iter_bytes():
                        buf.write(block)
            except httpx.TransportError as e:
                raise UnavailableError(f"Apiary API at {url}: {self._why(e)}") from e
            buf.seek(0)
            written = []
            with tarfile.open(fileobj=buf, mode="r:") as tar:
                for member in tar.getmembers():
                    target = (dest / member.name).resolve()
                    if not member.isfile() or not target.is_relative_to(dest.resolve()):
                        raise ValidationError("download", f"unsafe entry {member.name!r} in the model's tar")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tar.extractfile(member)
                    assert src is not None
                    with src, target.open("wb") as f:
                        while block := src.read(1 << 20):
                            f.write(block)
                    written.append(member.name)
        return written

    # ------------------------------------------------------------------ images
    def images(self, *, framework: str | None = None, cuda: str | None = None, q: str | None = None,
               mine: bool = False) -> builtins.list[dict]:
        """The image catalogue the token's user sees (shared images and their own; admins: all)."""
        params = {k: v for k, v in {"framework": framework, "cuda": cuda, "q": q}.items() if v}
        if mine:
            params["mine"] = "true"
        return self._call("GET", "/api/v2/images", params=params).json()

    def image(self, repository: str) -> builtins.list[dict]:
        """The tags of one catalogue repository (``repo`` or ``repo:tag``)."""
        return self._call("GET", f"/api/v2/images/{repository}").json()

    def build_image(self, archive: Path, name: str, *, tag: str = "latest", shared: bool = False,
                    description: str | None = None, timeout_s: float = 1800.0) -> dict:
        """Upload the build directory in the tar file ``archive`` and wait until the platform has
        built and pushed it (at most ``timeout_s``); returns the image (``repository``, ``tag``,
        ``digest``, ...). ``shared``: publish as ``apiary/<name>`` (admins)."""
        params = {"name": name, "tag": tag, "shared": str(shared).lower()}
        if description:
            params["description"] = description
        with archive.open("rb") as f:
            return self._call("POST", "/api/v2/images/builds", params=params, content=f.read(),
                              headers={"Content-Type": "application/octet-stream"}, timeout=timeout_s).json()

    # ------------------------------------------------------------------ joining nodes
    def create_bootstrap_token(self, ttl_s: float = 3600.0, node: str | None = None, description: str = "") -> dict:
        """A bootstrap token that joins one node (``node``; None: any node not joined yet) for
        ``ttl_s`` seconds (admins; ``POST /api/v2/bootstrap-tokens``): ``{"token": "<id>.<secret>",
        "id", "node", "expires", ...}``; the token is shown once."""
        return self._call("POST", "/api/v2/bootstrap-tokens", json={
            "ttlSeconds": ttl_s, "node": node, "description": description}).json()

    def bootstrap_tokens(self) -> builtins.list[dict]:
        """Every bootstrap token, newest first, without secrets (admins)."""
        return self._call("GET", "/api/v2/bootstrap-tokens").json()

    def revoke_bootstrap_token(self, token_id: str) -> dict:
        """Revoke a bootstrap token (admins; idempotent); the token's record."""
        return self._call("DELETE", f"/api/v2/bootstrap-tokens/{token_id}").json()

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 0.5,
             states: tuple[str, ...] = ("SUCCEEDED", "FAILED", "STOPPED")) -> dict:
        """Poll until the job reaches one of ``states``; raises TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["state"] in states:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(poll_s)

    # ------------------------------------------------------------------ CI/CD records
    def record_ci_run(self, run: dict) -> dict:
        """Record (or update, same ``flowRunId``) one pipeline run (``POST /api/v2/ci/runs``; the
        wire shape, times ISO 8601); the stored record, with its ``id``."""
        return self._call("POST", "/api/v2/ci/runs", json=run).json()

    def ci_runs(self, limit: int = 50, **filters: str | None) -> builtins.list[dict]:
        """The newest pipeline runs, newest first; ``filters``: ``repo``, ``result``, ``kind``, ``sha``
        (a prefix) (None or empty: any)."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        return self._call("GET", "/api/v2/ci/runs", params=params).json()["runs"]

    def ci_records(self, limit: int = 50, **filters: str | None) -> builtins.list[dict]:
        """The newest CI records (a delivery, its pipeline run and its deployment), newest first;
        ``filters``: ``sha``, ``state``, ``delivery`` (None or empty: any)."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        return self._call("GET", "/api/v2/ci/records", params=params).json()["records"]

    def record_deployment(self, d: dict) -> dict:
        """Record one production deployment (``POST /api/v2/deployments``); the stored record, with its ``id``."""
        return self._call("POST", "/api/v2/deployments", json=d).json()

    def deployments(self, limit: int = 50, **filters: str | None) -> builtins.list[dict]:
        """The newest deployments, newest first; ``filters``: ``sha`` (a prefix), ``result``."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        return self._call("GET", "/api/v2/deployments", params=params).json()["deployments"]


class Tenants:
    """Several users on one platform, for the demo, tests and benchmarks: the admin's client
    (``apiary up`` writes its token in the home) for everything, and ``submit(text, user=...)``
    through that user's own token; the admin creates each user (in the ``default`` group: every
    VC) and a one-hour token on first use."""

    def __init__(self, admin: ApiaryClient) -> None:
        self.admin = admin
        self._users: dict[str, ApiaryClient] = {}

    def submit(self, text: str, user: str) -> dict:
        if user not in self._users:
            if user not in {u["name"] for u in self.admin.users()}:
                self.admin.create_user(user)
            token = self.admin.create_token(user, description="apiary.client.Tenants", expires_in_s=3600)["token"]
            self._users[user] = self.admin.as_token(token)
        return self._users[user].submit(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.admin, name)
