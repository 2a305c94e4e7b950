"""Joining a node from the command line, as ``kubeadm token create`` and ``kubeadm join`` do.

An admin runs ``apiary node bootstrap-token create --ttl 1h [--node N]`` (:data:`bootstrap_token_app`):
it prints the token once and the command the new node runs::

    apiary agent join --api https://CP:8470 --token abcdef.0123456789abcdef \\
        --ca-cert-hash sha256:<64 hex> --node N

:func:`agent_join` is that command. Discovery pins the platform CA by hash (kubeadm's
``--discovery-token-ca-cert-hash``): it reads ``GET /api/v2/cluster-info`` over HTTPS without
verification (it has no CA yet), trusts the CA found there only when
:func:`apiary.pki.ca_cert_hash` of it equals the pinned hash, and then verifies TLS against that CA
alone for ``POST /api/v2/nodes/{node}/join``, which spends the token and answers the node's agent
credential. It writes ``<credentials>/agent-<node>.token`` (0600, created so by ``os.open``) and
``<credentials>/ca.crt`` (0644) and prints the ``apiary agent`` command that runs the agent.

The join also asks for the node's serving certificate, as a kubelet does for its own: the node
makes its key here (EC P-256; it never leaves the node) and sends a certificate signing request
naming the node and its addresses (``--address``, repeatable; default: the addresses of this
host's interfaces other than loopback and link-local, its node name and its host name). When the
control plane holds the CA key it answers the certificate, written to ``<credentials>/node.crt``
(0644) beside ``node.key`` (0600), and the agent serves its ``/metrics`` over HTTPS with them
(``apiary agent --metrics-cert ... --metrics-key ...``); otherwise ``/metrics`` stays HTTP.

``--ca-cert-hash`` is required unless ``--unsafe-skip-ca-verification`` (kubeadm's flag: trust
whatever CA the server presents) or the API is plain HTTP on loopback (tests, one machine), where
no token leaves the host. A token is never sent in clear to another host
(:func:`apiary.client.check_token_transport`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import typer
from rich.console import Console

from apiary.cli.common import api_client, err, fail, settings
from apiary.cli.tables import print_rows, when
from apiary.errors import ApiaryError, UnavailableError, ValidationError, error_from_response
from apiary.timefmt import iso

bootstrap_token_app = typer.Typer(no_args_is_help=True, help="Bootstrap tokens new nodes join with (kubeadm's).")

#: ``sha256:`` and 64 hex digits: kubeadm's ``--discovery-token-ca-cert-hash``.
CA_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>[smh]?)$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl(text: str) -> float:
    """Seconds of a lifetime written ``3600``, ``90s``, ``30m`` or ``1h``. Raises ValidationError
    (field ``ttl``)."""
    m = _DURATION.match(text.strip().lower())
    if not m:
        raise ValidationError("ttl", f"{text!r} is not a duration: write 3600, 90s, 30m or 1h")
    return float(m["n"]) * _UNITS[m["unit"]]


def _run(fn: Any) -> Any:
    try:
        return fn()
    except ApiaryError as e:
        fail(e)


def _cluster_info(url: str, verify: ssl.SSLContext | bool, transport: httpx.BaseTransport | None = None) -> dict:
    """``GET /api/v2/cluster-info`` of ``url`` (no credential). Raises UnavailableError or the API's error."""
    try:
        with httpx.Client(verify=verify, transport=transport, timeout=30.0) as http:
            r = http.get(f"{url}/api/v2/cluster-info")
    except httpx.TransportError as e:
        raise UnavailableError(f"Apiary API at {url} is not reachable: {type(e).__name__}: {e}") from e
    if r.status_code >= 400:
        raise error_from_response(r.status_code, r.content, "GET /api/v2/cluster-info")
    return r.json()


def join_command(api: str, token: str, ca_hash: str | None, node: str | None) -> str:
    """The ``apiary agent join`` command line a node runs (without a CA: the unsafe flag)."""
    pin = f"--ca-cert-hash {ca_hash}" if ca_hash else "--unsafe-skip-ca-verification"
    return f"apiary agent join --api {api} --token {token} {pin} --node {node or '<NODE>'}"


@bootstrap_token_app.command("create")
def create(
    ttl: str = typer.Option("1h", "--ttl", help="Lifetime: 3600, 90s, 30m or 1h (at most 24h)."),
    node: str | None = typer.Option(None, "--node", help="The one node it may join as (default: any not joined)."),
    description: str = typer.Option("", "--description", help="What it is for (shown by list)."),
    as_json: bool = typer.Option(False, "--json", help="Print the token and the join command as JSON."),
) -> None:
    """Create a bootstrap token (admins): print it once, and the apiary agent join command the new node runs."""
    from apiary import pki
    from apiary.client import http_verify

    ttl_s = _run(lambda: parse_ttl(ttl))
    client = api_client()
    made = _run(lambda: client.create_bootstrap_token(ttl_s, node=node, description=description))
    info = _run(lambda: _cluster_info(client.api_url, http_verify(settings().ca_cert)))
    ca_hash = pki.ca_cert_hash(info["caCert"].encode("ascii")) if info.get("caCert") else None
    api = (info.get("apiUrls") or [client.api_url])[0]
    command = join_command(api, made["token"], ca_hash, node)
    if as_json:
        typer.echo(json.dumps({**made, "caCertHash": ca_hash, "joinCommand": command}))
        return
    typer.echo(made["token"])
    err.print(f"bootstrap token {made['id']} expires {when(iso(made['expires']))} UTC; it joins "
              f"{'node ' + node if node else 'one node not joined yet'}, once. On the new node run:",
              markup=False, highlight=False)
    err.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)
    if ca_hash is None:
        err.print("warning: the platform has no CA (APIARY_CA_CERT unset): the node cannot check whom it joins.",
                  markup=False, highlight=False)


@bootstrap_token_app.command("list")
def list_tokens(as_json: bool = typer.Option(False, "--json", help="Print the tokens as JSON.")) -> None:
    """Bootstrap tokens, newest first (never their secrets)."""
    rows = _run(lambda: api_client().bootstrap_tokens())
    if as_json:
        typer.echo(json.dumps(rows))
        return
    print_rows(Console(), ["ID", "STATE", "NODE", "EXPIRES", "USED-BY", "BY"],
               [[t["id"], t["state"], t["node"] or "-", when(iso(t["expires"])), t["usedBy"] or "-",
                 t["createdBy"] or "-"] for t in rows],
               sentence="DESCRIPTION", sentences=[t["description"] for t in rows])


@bootstrap_token_app.command("revoke")
def revoke(token_id: str) -> None:
    """Revoke a bootstrap token (a node that joined with it keeps its credential: apiary token revoke)."""
    _run(lambda: api_client().revoke_bootstrap_token(token_id))
    typer.echo(f"Bootstrap token {token_id} revoked.")


# --------------------------------------------------------------------------- the join


@dataclass(frozen=True)
class Joined:
    """What :func:`join` wrote: the agent token file, the CA file (None: no CA), and the node's
    serving certificate and key (None: the control plane signed none)."""

    node: str
    token_file: Path
    ca_file: Path | None
    cert_file: Path | None = None
    key_file: Path | None = None


#: File names of a node's serving certificate and key in its credentials directory.
NODE_CERT, NODE_KEY = "node.crt", "node.key"


def host_addresses() -> list[str]:
    """This host's addresses that other hosts may reach it by: every IPv4 and IPv6 address of its
    interfaces (``psutil.net_if_addrs``) except loopback, link-local and unspecified ones, in
    interface order, without duplicates."""
    import psutil

    found: list[str] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(a.address.split("%", 1)[0])
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified or str(ip) in found:
                continue
            found.append(str(ip))
    return found


def serving_names(node: str, addresses: list[str] | None = None) -> list[str]:
    """The names a node's serving certificate asks for: ``node``, then ``addresses`` (each checked
    to be an IP address or a host name; ValidationError field ``address``) or, when None,
    :func:`host_addresses` and this host's name."""
    if addresses is None:
        names = [node, *host_addresses(), socket.gethostname()]
    else:
        names = [node]
        for a in addresses:
            a = a.strip()
            try:
                ipaddress.ip_address(a)
            except ValueError:
                if not re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", a) or ".." in a:
                    raise ValidationError("address", f"{a!r} is neither an IP address nor a host name") from None
            names.append(a)
    return list(dict.fromkeys(n for n in names if n))


def join(api: str, token: str, node: str, credentials_dir: Path, *, ca_cert_hash: str | None = None,
         unsafe_skip_ca_verification: bool = False, addresses: list[str] | None = None,
         transport: httpx.BaseTransport | None = None) -> Joined:
    """Join ``node`` to the control plane at ``api`` (one URL) with bootstrap token ``token``
    (module doc); writes the credentials into ``credentials_dir``. ``addresses``: the IP addresses
    and host names the node's serving certificate names besides ``node`` (None: this host's, see
    :func:`serving_names`). Raises ValidationError (a bad
    ``--ca-cert-hash``, a missing pin, a URL that is neither HTTPS nor HTTP on loopback, a bad
    ``--address``), :class:`~apiary.errors.PlaintextTokenError`, :class:`CaMismatchError` (the presented CA is not
    the pinned one), UnavailableError (unreachable, or TLS verification failed) or the API's
    refusal (401 naming why, 404 unknown node, 409 joined already, 400 a CSR naming another
    node). ``transport``: tests' fake."""
    from apiary import pki
    from apiary.auth.bootstrap import agent_token_path, write_secret
    from apiary.client import check_token_transport, is_loopback_host

    api = api.rstrip("/")
    parts = urlsplit(api)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError("api", f"{api!r} must be https://HOST[:PORT] (or http:// on loopback)")
    if ca_cert_hash is not None:
        ca_cert_hash = ca_cert_hash.strip().lower()
        if not CA_HASH.match(ca_cert_hash):
            raise ValidationError("ca-cert-hash", f"{ca_cert_hash!r} is not sha256:<64 hex digits>")
    plain_loopback = parts.scheme == "http" and is_loopback_host(parts.hostname)
    if ca_cert_hash is None and not unsafe_skip_ca_verification and not plain_loopback:
        raise ValidationError("ca-cert-hash", "required: the platform CA's hash as `apiary node bootstrap-token "
                                              "create` prints it (or --unsafe-skip-ca-verification to trust whatever "
                                              "CA the server presents)")
    check_token_transport(api, token)  # plain HTTP only to loopback
    node_key, csr = pki.make_node_csr(node, serving_names(node, addresses))  # the key stays here

    # 1. Discovery: the CA, from a server not verified yet, trusted only by its hash.
    info = _cluster_info(api, False, transport)
    ca_pem: str | None = info.get("caCert")
    if ca_cert_hash is not None:
        presented = pki.ca_cert_hash(ca_pem.encode("ascii")) if ca_pem else None
        if presented is None or not hmac.compare_digest(presented, ca_cert_hash):
            raise CaMismatchError(
                f"refusing to join: the control plane at {api} presents "
                f"{'a CA whose hash is ' + presented if presented else 'no CA'}, not the pinned {ca_cert_hash} "
                f"(--ca-cert-hash). Check the hash with the admin; another server may be answering at that address.")
    # 2. The join, over TLS verified against that CA alone.
    verify: ssl.SSLContext | bool = ssl.create_default_context(cadata=ca_pem) if ca_pem else \
        parts.scheme == "https"  # no CA anywhere: the system's CAs (HTTPS) or nothing to verify (HTTP)
    try:
        with httpx.Client(verify=verify, transport=transport, timeout=30.0) as http:
            r = http.post(f"{api}/api/v2/nodes/{node}/join", headers={"Authorization": f"Bearer {token}"},
                          json={"csr": csr.decode("ascii")})
    except httpx.TransportError as e:
        raise UnavailableError(f"Apiary API at {api} is not reachable with the pinned CA: {type(e).__name__}: "
                               f"{e}") from e
    if r.status_code >= 400:
        raise error_from_response(r.status_code, r.content)
    joined = r.json()
    # 3. The credentials, 0600 and 0644, in a directory only its owner may enter.
    token_file = agent_token_path(credentials_dir, node)
    write_secret(token_file, joined["token"])
    ca_file = None
    if joined.get("caCert"):
        ca_file = credentials_dir / "ca.crt"
        fd = os.open(ca_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(joined["caCert"])
        os.chmod(ca_file, 0o644)
    cert_file = key_file = None
    if joined.get("certificate"):
        key_file, cert_file = credentials_dir / NODE_KEY, credentials_dir / NODE_CERT
        pki.write_private(key_file, node_key)
        pki.write_public(cert_file, joined["certificate"].encode("ascii"))
    return Joined(node, token_file, ca_file, cert_file, key_file)


class CaMismatchError(ValidationError):
    """The CA the server presents is not the one pinned by ``--ca-cert-hash``."""

    def __init__(self, message: str) -> None:
        super().__init__("ca-cert-hash", message)


def agent_join(
    api: str = typer.Option(..., "--api", help="The control plane's URL (https://HOST:PORT)."),
    token: str = typer.Option(..., "--token", envvar="APIARY_BOOTSTRAP_TOKEN",
                              help="The bootstrap token (<id>.<secret>)."),
    ca_cert_hash: str | None = typer.Option(
        None, "--ca-cert-hash", help="sha256:<hex> of the platform CA's public key, as bootstrap-token create prints."),
    node: str = typer.Option(..., "--node", help="This node's name in the cluster config."),
    credentials_dir: Path | None = typer.Option(
        None, "--credentials", help="Where to write agent-<node>.token and ca.crt (default APIARY_HOME/credentials)."),
    unsafe_skip_ca_verification: bool = typer.Option(
        False, "--unsafe-skip-ca-verification", help="Trust whatever CA the server presents (no pin)."),
    address: list[str] = typer.Option(
        [], "--address", help="An IP address or host name this node's /metrics is reached by, for its serving "
                              "certificate (repeatable; default: this host's non-loopback addresses and its name)."),
) -> None:
    """Join this node to the cluster with a bootstrap token (kubeadm join): pin the platform CA,
    receive the node's agent credential, and store it (0600)."""
    creds = (credentials_dir or settings().credentials_dir).expanduser()
    if unsafe_skip_ca_verification and ca_cert_hash is None:
        err.print("warning: --unsafe-skip-ca-verification: the CA the server presents is trusted unchecked.",
                  markup=False, highlight=False)
    done = _run(lambda: join(api, token, node, creds, ca_cert_hash=ca_cert_hash,
                             unsafe_skip_ca_verification=unsafe_skip_ca_verification, addresses=address or None))
    typer.echo(f"Node {node} joined. Wrote {done.token_file} (0600)"
               + (f" and {done.ca_file} (0644)." if done.ca_file else "."))
    ca = f" --ca-cert {done.ca_file}" if done.ca_file else ""
    tls = ""
    if done.cert_file and done.key_file:
        typer.echo(f"Its serving certificate: {done.cert_file} (0644), key {done.key_file} (0600).")
        tls = f" --metrics-cert {done.cert_file} --metrics-key {done.key_file}"
    else:
        typer.echo("The control plane signed no serving certificate (no APIARY_CA_KEY there): "
                   "the agent's /metrics stays HTTP.")
    typer.echo(f"Run its agent: apiary agent --api {api.rstrip('/')} --node {node} --credentials {creds}{ca}{tls}")
