"""Who is calling, for the routes: ``Authorization: Bearer <token>`` -> a :class:`Principal`.

Nothing else names the caller: no ``?user=``, no ``X-Apiary-User``. The one delegation is the
Prefect bridge's service token, which may submit on behalf of an existing user who is neither an
admin nor a service (``X-Apiary-On-Behalf-Of``; :func:`submitter`). Every route states what it
needs with one of the dependencies below, as the table :data:`apiary.api.access.ACCESS` says; a
missing or bad token is 401 (``WWW-Authenticate: Bearer``), a known caller without the right is
403 naming who they are and what they lack.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool

from apiary.auth import Directory, Principal
from apiary.auth.principal import SERVICES
from apiary.errors import ForbiddenError

ON_BEHALF_HEADER = "X-Apiary-On-Behalf-Of"


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header (RFC 6750), or None."""
    header = request.headers.get("authorization") or ""
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def get_directory(request: Request) -> Directory:
    return request.app.state.directory


async def get_principal(request: Request) -> Principal:
    """The verified caller (401 otherwise); a non-admin user's call counts against their rate limit."""
    directory, token = request.app.state.directory, bearer(request)
    principal = directory.authenticate_cached(token)
    if principal is None:  # a store read: off the event loop, or every request waits behind it
        principal = await run_in_threadpool(directory.authenticate, token)
    limiter = getattr(request.app.state, "limiter", None)
    if limiter is not None and principal.kind == "user" and not principal.admin:
        limiter.hit_call(principal.name)  # admins (operators), agents and services are not limited
    request.state.principal = principal
    return principal


Caller = Annotated[Principal, Depends(get_principal)]
Dir = Annotated[Directory, Depends(get_directory)]


async def require_admin(caller: Caller) -> Principal:
    if not caller.admin:
        raise ForbiddenError(f"Only admins may do this; you are {caller.describe()}.")
    return caller


async def require_people(caller: Caller) -> Principal:
    """Users, admins and the bridge: everything but machine-only credentials."""
    if caller.kind == "agent" or caller.is_alertmanager:
        raise ForbiddenError(f"{caller.describe().capitalize()} may not do this.")
    return caller


async def require_user(caller: Caller) -> Principal:
    """Users and admins (a personal token): no agent and no service."""
    if caller.kind != "user":
        raise ForbiddenError(f"Only users may do this; you are {caller.describe()}.")
    return caller


async def require_admin_or_bridge(caller: Caller) -> Principal:
    if not (caller.admin or caller.is_bridge):
        raise ForbiddenError(f"Only admins and the Prefect bridge may do this; you are {caller.describe()}.")
    return caller


def require_agent(node: str, caller: Principal) -> Principal:
    """Routes under ``/api/v2/nodes/{node}/`` for agents: only ``node``'s own agent."""
    if not caller.is_agent_of(node):
        raise ForbiddenError(f"Only the agent of node {node} may do this; you are {caller.describe()}.")
    return caller


async def node_agent(node: str, caller: Caller) -> Principal:
    return require_agent(node, caller)


async def submitter(
    caller: Caller, directory: Dir, on_behalf_of: Annotated[str | None, Header(alias=ON_BEHALF_HEADER)] = None
) -> Principal:
    """Who a submission belongs to: the calling user, or (bridge token only) the existing user
    named in ``X-Apiary-On-Behalf-Of``. Counts against that user's submission limit.

    The bridge acts only for ordinary users: a header naming an admin or a service (``bridge``,
    ``alertmanager``) is a 403, so the bridge's token (and whoever starts its flows) cannot
    submit as an admin, whose submissions are not rate-limited and may use every VC. A name that
    is no user is a 404 ``NoUserError``."""
    if on_behalf_of is not None:
        if not caller.is_bridge:
            raise ForbiddenError(f"Only the Prefect bridge may submit on behalf of another user "
                                 f"({ON_BEHALF_HEADER}); you are {caller.describe()}.")
        if on_behalf_of in SERVICES:
            raise ForbiddenError(f"{ON_BEHALF_HEADER} names the {on_behalf_of} service; the bridge submits "
                                 f"on behalf of users only.")
        who = directory.user_principal(on_behalf_of)
        if who.admin:
            raise ForbiddenError(f"{ON_BEHALF_HEADER} names admin {on_behalf_of}; the bridge may not submit "
                                 f"on behalf of an admin (admins submit with their own token).")
    elif caller.kind == "user":
        who = caller
    else:
        raise ForbiddenError(f"Jobs are submitted by users; you are {caller.describe()}.")
    return who


Admin = Annotated[Principal, Depends(require_admin)]
People = Annotated[Principal, Depends(require_people)]
Users = Annotated[Principal, Depends(require_user)]
AdminOrBridge = Annotated[Principal, Depends(require_admin_or_bridge)]
NodeAgent = Annotated[Principal, Depends(node_agent)]
Submitter = Annotated[Principal, Depends(submitter)]
