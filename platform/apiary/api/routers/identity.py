"""Identity routes, shaped like OpenPAI's REST server v2: ``/api/v2/users``, ``/api/v2/groups``
(members and virtual-cluster grants), ``/api/v2/tokens``, and ``/api/v2/me`` (who am I).

Users and groups are admin-only; any user creates, lists and revokes their own tokens (an admin
anyone's, and machine tokens). No change may leave the platform without an admin (409
``LastAdminError``: :class:`apiary.auth.Directory`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from apiary.api.auth import Admin, Caller, Dir, People
from apiary.api.deps import Plane
from apiary.api.guards import plain_text
from apiary.api.routers.storages import Storage, StorageName
from apiary.api.schemas import ERROR_RESPONSES, RequestBody
from apiary.auth.bootstrap import DEFAULT_GROUP
from apiary.errors import ForbiddenError, NoTokenError, NoVirtualClusterError

router = APIRouter(prefix="/api/v2", tags=["identity"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])

Name = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Letters, digits, '_' or '-' (1-64).")
def PathName() -> Any:  # noqa: N802 - reads as a type in signatures; one FieldInfo per parameter
    return Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", max_length=64)


class _Body(RequestBody):
    model_config = ConfigDict(extra="forbid")


class UserCreate(_Body):
    username: str = Name
    groups: list[str] | None = Field(default=None, max_length=100,
                                     description=f"Groups to join; default [{DEFAULT_GROUP!r}].")
    email: str | None = Field(default=None, max_length=200)


class UserJson(BaseModel):
    name: str
    email: str | None
    groups: list[str]
    virtualClusters: list[str]
    storageConfigs: list[str] = Field(default_factory=list, description="Storage configs the groups grant.")
    admin: bool


class GroupCreate(_Body):
    groupname: str = Name
    admin: bool = False
    description: str = Field(default="", max_length=1000)
    virtualClusters: list[str] = Field(default_factory=list, max_length=1000)


class GroupJson(BaseModel):
    name: str
    admin: bool
    description: str
    members: list[str]
    virtualClusters: list[str]
    storageConfigs: list[str] = Field(default_factory=list, description="Storage configs the group may use.")


class TokenCreate(_Body):
    kind: Literal["user", "agent", "service"] = Field(default="user", description="Admins only for agent and service.")
    subject: str | None = Field(default=None, max_length=200,
                                description="User, node or service; default the caller (admins only for others).")
    description: str = Field(default="", max_length=1000)
    expiresInS: float | None = Field(default=90 * 86400.0, gt=0, le=10 * 365 * 86400.0,
                                     description="Lifetime in seconds (default 90 days); null never expires "
                                     "(admins only).")


class TokenJson(BaseModel):
    id: str
    kind: str
    subject: str
    description: str
    created: float
    expires: float | None
    revoked: float | None


class NewTokenJson(TokenJson):
    token: str = Field(description="The bearer token. Shown once: Apiary keeps only its SHA-256.")


class Me(BaseModel):
    kind: str
    name: str
    admin: bool
    groups: list[str]
    virtualClusters: list[str]
    storageConfigs: list[str] = Field(default_factory=list, description="Storage configs the groups grant.")
    tokenId: str
    expires: float | None


@router.get("/me", response_model=Me)
def me(caller: Caller) -> dict:
    """Who the token is: kind (user / agent / service), name, groups and the VCs they may use."""
    return {"kind": caller.kind, "name": caller.name, "admin": caller.admin, "groups": sorted(caller.groups),
            "virtualClusters": sorted(caller.virtual_clusters), "storageConfigs": sorted(caller.storage_configs),
            "tokenId": caller.token_id, "expires": caller.expires}


@router.get("/users", response_model=list[UserJson])
def list_users(directory: Dir, _caller: Admin) -> list[dict]:
    return directory.list_users()


@router.post("/users", status_code=201, response_model=UserJson)
def create_user(body: UserCreate, directory: Dir, _caller: Admin) -> dict:
    """Create a user (admins only); without ``groups`` they join the ``default`` group."""
    return directory.create_user(body.username, groups=body.groups if body.groups is not None else [DEFAULT_GROUP],
                                 email=body.email)


@router.get("/users/{name}", response_model=UserJson)
def get_user(directory: Dir, caller: Caller, name: str = PathName()) -> dict:
    """A user; users may read themselves, admins anyone."""
    if not (caller.admin or (caller.kind == "user" and caller.name == name)):
        raise ForbiddenError(f"Only admins may read other users; you are {caller.describe()}.")
    return directory.get_user(name)


@router.delete("/users/{name}", status_code=204, response_class=Response)
def delete_user(directory: Dir, _caller: Admin, name: str = PathName()) -> Response:
    """Delete a user and revoke their tokens; their jobs stay. 409 ``LastAdminError`` for the last admin."""
    directory.delete_user(name)
    return Response(status_code=204)


@router.get("/groups", response_model=list[GroupJson])
def list_groups(directory: Dir, _caller: Admin) -> list[dict]:
    return directory.list_groups()


def _known_vcs(plane: Plane, vcs: list[str]) -> None:
    unknown = sorted(set(vcs) - set(plane.cluster.virtual_clusters))
    if unknown:
        raise NoVirtualClusterError(f"Virtual cluster {unknown[0]} not found.")


@router.post("/groups", status_code=201, response_model=GroupJson)
def create_group(body: GroupCreate, directory: Dir, plane: Plane, _caller: Admin) -> dict:
    _known_vcs(plane, body.virtualClusters)
    return directory.create_group(body.groupname, admin=body.admin, description=body.description,
                                  virtual_clusters=body.virtualClusters)


@router.delete("/groups/{name}", status_code=204, response_class=Response)
def delete_group(directory: Dir, _caller: Admin, name: str = PathName()) -> Response:
    """Delete a group (its members stay users). 409 ``LastAdminError`` for an admin group whose
    members are the last admins."""
    directory.delete_group(name)
    return Response(status_code=204)


@router.put("/groups/{name}/members/{user}", response_model=GroupJson)
def add_member(directory: Dir, _caller: Admin, name: str = PathName(), user: str = PathName()) -> dict:
    return directory.set_member(name, user, True)


@router.delete("/groups/{name}/members/{user}", response_model=GroupJson)
def remove_member(directory: Dir, _caller: Admin, name: str = PathName(), user: str = PathName()) -> dict:
    """Remove ``user`` from group ``name``. 409 ``LastAdminError`` when that leaves no admin."""
    return directory.set_member(name, user, False)


@router.put("/groups/{name}/virtualClusters/{vc}", response_model=GroupJson)
def grant(directory: Dir, plane: Plane, _caller: Admin, name: str = PathName(),
          vc: str = Path(max_length=100)) -> dict:
    """Let the group's members use virtual cluster ``vc``."""
    _known_vcs(plane, [vc])
    return directory.set_grant(name, vc, True)


@router.delete("/groups/{name}/virtualClusters/{vc}", response_model=GroupJson)
def revoke_grant(directory: Dir, _caller: Admin, name: str = PathName(), vc: str = Path(max_length=100)) -> dict:
    return directory.set_grant(name, vc, False)


@router.put("/groups/{name}/storageConfigs/{config}", response_model=GroupJson)
def grant_storage(directory: Dir, storage: Storage, _caller: Admin, name: str = PathName(),
                  config: str = StorageName()) -> dict:
    """Let the group's members mount storage config ``config`` and use its files (OpenPAI's group
    ``extension.acls.storageConfigs``)."""
    storage.config(config)  # 404 for a config that does not exist
    return directory.set_storage_grant(name, config, True)


@router.delete("/groups/{name}/storageConfigs/{config}", response_model=GroupJson)
def revoke_storage(directory: Dir, _caller: Admin, name: str = PathName(), config: str = StorageName()) -> dict:
    """Take the grant back: jobs launched from now on no longer mount it."""
    return directory.set_storage_grant(name, config, False)


@router.post("/tokens", status_code=201, response_model=NewTokenJson)
def create_token(body: TokenCreate, directory: Dir, caller: People) -> dict:
    """A new token, shown once. Users create their own personal tokens; admins also create them
    for others, tokens that never expire, and agent and service tokens."""
    subject = body.subject or caller.name
    own = body.kind == "user" and caller.kind == "user" and subject == caller.name
    if not caller.admin and (not own or body.expiresInS is None):
        raise ForbiddenError(f"Only admins may create that token; you are {caller.describe()}.")
    new = directory.create_token(body.kind, subject, description=body.description, expires_in_s=body.expiresInS)
    return {**new.info, "token": new.token}


@router.get("/tokens", response_model=list[TokenJson])
def list_tokens(directory: Dir, caller: People) -> list[dict]:
    """The caller's tokens (admins: all), newest first; never the secrets."""
    if caller.admin:
        return directory.list_tokens()
    return directory.list_tokens(kind="user", subject=caller.name)


@router.delete("/tokens/{token_id}", response_model=TokenJson)
def revoke_token(directory: Dir, caller: People, token_id: str = Path(pattern=r"^[0-9a-f]{12}$")) -> dict:
    """Revoke a token (idempotent): the caller's own, or any for admins."""
    info = directory.token_info(token_id)
    if not caller.admin and not (info["kind"] == "user" and info["subject"] == caller.name):
        raise NoTokenError(f"Token {token_id} not found.")
    return directory.revoke_token(token_id)
