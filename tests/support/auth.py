"""Credentials for tests that drive the API as several principals at once.

:class:`Principals` issues real tokens through :class:`apiary.auth.Directory` over the plane's
store (users join the ``default`` group, which grants every VC, unless told otherwise).
:class:`ActAs` is an ``httpx.Auth`` for the functional API tests, which mix an agent's reports,
an admin's cycles and several users' submissions on one client: it sends the node agent's token
on ``/api/v2/nodes/{node}/{status,assignments,logs}``, the user's token when the request names a
test user in ``X-Test-User`` (the header is removed: the server never sees it), and the admin's
token otherwise. The authorization rules themselves are tested principal by principal in
tests/api/test_authz.py, without this.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable

import httpx

from apiary.auth import Directory
from apiary.auth.bootstrap import DEFAULT_GROUP

TEST_USER_HEADER = "X-Test-User"
_AGENT_PATH = re.compile(r"^/api/v2/nodes/(?P<node>[^/]+)/(status|assignments|logs)$")


class Principals:
    """Tokens for users, admins, agents and services, minted on first use and cached."""

    def __init__(self, directory: Directory, virtual_clusters: Iterable[str]) -> None:
        self.directory = directory
        self._tokens: dict[tuple[str, str], str] = {}
        directory.create_group(DEFAULT_GROUP, virtual_clusters=list(virtual_clusters), exist_ok=True)
        directory.create_group("admin", admin=True, exist_ok=True)

    def user(self, name: str, groups: Iterable[str] = (DEFAULT_GROUP,)) -> str:
        key = ("user", name)
        if key not in self._tokens:
            self.directory.create_user(name, groups=list(groups), exist_ok=True)
            self._tokens[key] = self.directory.create_token("user", name).token
        return self._tokens[key]

    def admin(self, name: str = "root") -> str:
        return self.user(name, groups=("admin",))

    def agent(self, node: str) -> str:
        key = ("agent", node)
        if key not in self._tokens:
            self._tokens[key] = self.directory.create_token("agent", node).token
        return self._tokens[key]

    def service(self, name: str) -> str:
        key = ("service", name)
        if key not in self._tokens:
            self._tokens[key] = self.directory.create_token("service", name).token
        return self._tokens[key]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class ActAs(httpx.Auth):
    """Picks each request's principal from its path and ``X-Test-User`` (module doc)."""

    def __init__(self, principals: Principals) -> None:
        self.principals = principals

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if "Authorization" not in request.headers:
            user = request.headers.get(TEST_USER_HEADER)
            agent = _AGENT_PATH.match(request.url.path)
            if user:
                token = self.principals.user(user)
            elif agent:
                token = self.principals.agent(agent["node"])
            else:
                token = self.principals.admin()
            request.headers["Authorization"] = f"Bearer {token}"
        if TEST_USER_HEADER in request.headers:
            del request.headers[TEST_USER_HEADER]
        yield request


def acting(plane) -> ActAs:
    """An :class:`ActAs` over ``plane``'s store (TestClient(..., auth=acting(plane)))."""
    principals = Principals(Directory(plane.sessions), plane.cluster.virtual_clusters)
    # Minted now: a test may make the store fail later, and its requests must still authenticate.
    for user in ("alice", "bob", "carol", "dan"):
        principals.user(user)
    principals.admin()
    for node in plane.scheduler.nodes():
        principals.agent(node)
    return ActAs(principals)


def with_auth(client, plane):
    """``client`` (a TestClient) acting as :func:`acting` decides; returns it."""
    client.auth = acting(plane)
    return client
