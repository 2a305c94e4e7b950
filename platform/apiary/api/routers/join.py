"""Joining a node (``kubeadm join``'s flow): bootstrap tokens, the public cluster info, the join.

* ``POST /api/v2/bootstrap-tokens`` (admins): a short-lived token ``<id>.<secret>``, shown once;
  ``GET`` lists them without their secrets; ``DELETE /api/v2/bootstrap-tokens/{token_id}`` revokes one.
* ``GET /api/v2/cluster-info`` (no credential, like kubeadm's ``cluster-info`` ConfigMap in
  ``kube-public``): the cluster id, the platform CA's certificate and the API's URLs. A joining
  node fetches it without verifying TLS and trusts it only when the CA's public key hashes to the
  value it was given (``--ca-cert-hash``, :func:`apiary.pki.ca_cert_hash`).
* ``POST /api/v2/nodes/{node}/join`` with ``Authorization: Bearer <bootstrap token>``: spends the
  token and answers the node's own agent credential (:class:`apiary.auth.bootstrap_tokens.BootstrapTokens`).
  With a body ``{"csr": PEM}`` (the node's certificate signing request, its key made on the node)
  and the CA key on this host (``APIARY_CA_KEY``), it also answers the node's serving certificate
  for its ``/metrics``, signed as Kubernetes signs a kubelet's (:func:`apiary.pki.sign_csr`);
  without the CA key the join answers no certificate.
  A bootstrap token is a credential of this route only; every refusal is a 401 naming why (404 for
  a node the cluster config lacks, 409 for a node that has joined already).

Unauthenticated calls (the cluster info, the join) count against a rate limit per client address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from apiary import pki
from apiary.api.auth import Admin, bearer
from apiary.api.deps import Plane
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, RequestBody
from apiary.auth.bootstrap_tokens import DEFAULT_TTL_S, MAX_DESCRIPTION, MAX_TTL_S, BootstrapTokens, parse
from apiary.errors import PlatformError
from apiary.settings import Settings

router = APIRouter(prefix="/api/v2", tags=["joining nodes"], responses=ERROR_RESPONSES)
_admin = [Depends(plain_text)]


class BootstrapTokenCreate(RequestBody):
    model_config = ConfigDict(extra="forbid")

    ttlSeconds: float = Field(default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S,
                              description="How long the token joins a node, in seconds (default 1 h, at most 24 h).")
    node: str | None = Field(default=None, max_length=200,
                             description="The one node it may join as (one of the cluster config); default any node "
                                         "not joined yet.")
    description: str = Field(default="", max_length=MAX_DESCRIPTION)


class BootstrapTokenJson(BaseModel):
    """A bootstrap token without its secret; times in unix seconds; ``state``: ``valid``,
    ``used``, ``expired`` or ``revoked``."""

    id: str
    node: str | None
    description: str
    createdBy: str
    created: float
    expires: float
    used: float | None
    usedBy: str | None
    revoked: float | None
    state: str


class NewBootstrapTokenJson(BootstrapTokenJson):
    token: str = Field(description="The bootstrap token, <id>.<secret>. Shown once: Apiary keeps only a SHA-256 "
                                   "of the secret.")


class ClusterInfo(BaseModel):
    """What a joining node needs before it trusts anything: ``caCert`` (PEM; null when the
    platform has no CA and serves plain HTTP), ``apiUrls`` (the control-plane replicas' URLs, when
    configured) and ``clusterId``."""

    clusterId: str | None
    caCert: str | None
    apiUrls: list[str] | None


class JoinRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    csr: str | None = Field(
        default=None, max_length=pki.MAX_CSR_BYTES,
        description="The node's certificate signing request (PEM) for its serving certificate: CN and SANs its "
                    "name and addresses. Its SANs may not name another node of the cluster config.")


class Joined(BaseModel):
    """A node's join: ``token`` is its agent credential (shown once; keep it mode 0600), ``caCert``
    the platform CA (PEM) to verify the API with, or null; ``certificate`` the node's serving
    certificate (PEM, signed by that CA; server auth, 365 days) when it sent a CSR and this host
    holds the CA key, else null."""

    node: str
    token: str
    caCert: str | None
    certificate: str | None = None


async def get_tokens(request: Request) -> BootstrapTokens:
    return request.app.state.bootstrap_tokens


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def ca_pem(settings: Settings) -> str | None:
    """The platform CA's certificate (``APIARY_CA_CERT``) as PEM text, or None when unset. Raises
    PlatformError (500) naming the setting when the file cannot be read."""
    path: Path | None = settings.ca_cert
    if path is None:
        return None
    try:
        return path.expanduser().read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise PlatformError(f"the platform CA certificate APIARY_CA_CERT={path} cannot be read: {e}") from e


def api_urls(settings: Settings) -> list[str] | None:
    """The replicas' URLs: ``APIARY_API_URL`` (comma-separated) if set, else ``APIARY_ADVERTISE_URL``."""
    urls = [u.strip().rstrip("/") for u in (settings.api_url or settings.advertise_url or "").split(",") if u.strip()]
    return urls or None


def _limit(request: Request, what: str) -> None:
    """Count an unauthenticated call against the client address's call budget (429 past it)."""
    limiter = getattr(request.app.state, "limiter", None)
    if limiter is not None:
        limiter.hit_call(f"{what}@{request.client.host if request.client else '?'}")


@router.post("/bootstrap-tokens", status_code=201, response_model=NewBootstrapTokenJson, dependencies=_admin)
def create_bootstrap_token(body: BootstrapTokenCreate, plane: Plane, caller: Admin,
                           tokens: BootstrapTokens = Depends(get_tokens)) -> dict:
    """A new bootstrap token (admins only), shown once; 404 for a ``node`` the cluster config lacks."""
    token, shown = tokens.create(body.ttlSeconds, node=body.node, description=body.description, by=caller.name,
                                 known_nodes=plane.cache.node_names)
    return {**shown, "token": token}


@router.get("/bootstrap-tokens", response_model=list[BootstrapTokenJson], dependencies=_admin)
def list_bootstrap_tokens(_caller: Admin, tokens: BootstrapTokens = Depends(get_tokens)) -> list[dict]:
    """Every bootstrap token, newest first, never a secret (admins only)."""
    return tokens.list()


@router.delete("/bootstrap-tokens/{token_id}", response_model=BootstrapTokenJson, dependencies=_admin)
def revoke_bootstrap_token(_caller: Admin, tokens: BootstrapTokens = Depends(get_tokens),
                           token_id: str = PathParam(pattern=r"^[a-z0-9]{6}$")) -> dict:
    """Revoke a bootstrap token (admins only; idempotent). The nodes that joined with it keep
    their credentials (revoke those with ``DELETE /api/v2/tokens/{id}``)."""
    return tokens.revoke(token_id)


@router.get("/cluster-info", response_model=ClusterInfo)
def cluster_info(request: Request, settings: Settings = Depends(get_settings)) -> dict[str, Any]:
    """Public: the cluster id, the platform CA (PEM) and the API's URLs, for a joining node to
    check against its pinned CA hash."""
    _limit(request, "cluster-info")
    return {"clusterId": request.app.state.cluster_id, "caCert": ca_pem(settings), "apiUrls": api_urls(settings)}


def _bootstrap_bearer(request: Request) -> str | None:
    """The request's bearer token once it has the form of a bootstrap token (401 otherwise). A
    dependency, so FastAPI runs it before it validates the body: a caller without one gets its 401
    whatever the body holds."""
    _limit(request, "join")
    token = bearer(request)
    parse(token)
    return token


@router.post("/nodes/{node}/join", response_model=Joined)
def join_node(node: str, response: Response, plane: Plane, body: JoinRequest | None = None,
              token: str | None = Depends(_bootstrap_bearer), settings: Settings = Depends(get_settings),
              tokens: BootstrapTokens = Depends(get_tokens)) -> dict:
    """Join ``node`` with the bootstrap token in ``Authorization: Bearer``: answers its agent
    credential once, and its serving certificate when the body carries a CSR and this host holds
    the CA key. 401 naming why the token is refused (malformed, unknown, revoked, used, expired,
    for another node), 404 for a node the cluster config lacks, 409 for a node that has joined
    already (an admin revokes its agent token first), 400 (field ``csr``) for a CSR that is not
    one, or names another node of the cluster config: the token stays unspent."""
    signed: list[str] = []
    csr = body.csr if body is not None else None
    ca_cert, ca_key = settings.ca_cert, settings.ca_key

    def approve() -> None:  # after the token and the node are checked, before anything is written
        if not csr or ca_cert is None or ca_key is None:
            return
        others = set(plane.cache.node_names) - {node}
        signed.append(pki.sign_csr(ca_cert.expanduser(), ca_key.expanduser(), csr.encode("utf-8"), node=node,
                                   allowed=lambda name: name not in others).decode("ascii"))

    # The token is checked first, and ``node`` reaches the store only once it is a node of the
    # cluster config: whatever the path or the CSR holds, a caller without a good token learns nothing else.
    agent_token = tokens.spend(token, node, plane.cache.node_names, approve=approve)
    response.headers["Cache-Control"] = "no-store"  # it carries a credential (RFC 9111 section 5.2.2.5)
    return {"node": node, "token": agent_token, "caCert": ca_pem(settings),
            "certificate": signed[0] if signed else None}
