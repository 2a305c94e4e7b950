"""The MLflow authorization plugin's logic without MLflow (it imports flask and mlflow lazily): which
token a header carries, the identity cache (answers and refusals, expiry, no caching of an outage),
the MLflow users it makes, and the reserved experiments; and that the module imports nothing of
``apiary`` (it runs inside MLflow's venv, where there is none)."""

from __future__ import annotations

import ast
import base64
import importlib.util
from types import ModuleType

import pytest

from apiary.marketplace.mlflow_server import PLUGIN_DIR

PLUGIN = PLUGIN_DIR / "apiary_mlflow_auth.py"


@pytest.fixture
def plugin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("apiary_mlflow_auth_under_test", PLUGIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_imports_only_the_standard_library_at_import_time() -> None:
    tree = ast.parse(PLUGIN.read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top <= {"__future__", "base64", "hashlib", "importlib", "json", "os", "secrets", "threading", "time",
                   "urllib", "typing"}, top
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "apiary" in ast.dump(n) for n in ast.walk(tree))


@pytest.mark.parametrize(("header", "token"), [
    pytest.param("Bearer abc", "abc", id="bearer"),
    pytest.param("bearer  abc ", "abc", id="bearer-any-case"),
    pytest.param("Basic " + base64.b64encode(b"alice:tok:with:colons").decode(), "tok:with:colons", id="basic"),
    pytest.param("Basic " + base64.b64encode(b"alice:").decode(), None, id="basic-no-password"),
    pytest.param("Basic !!!", None, id="basic-garbage"),
    pytest.param("Bearer ", None, id="bearer-empty"),
    pytest.param("Token abc", None, id="other-scheme"),
    pytest.param("", None, id="none"),
])
def test_the_token_of_a_header(plugin: ModuleType, header: str, token: str | None) -> None:
    assert plugin.token_of(header) == token


def test_answers_and_refusals_are_cached_until_they_expire(plugin: ModuleType, monkeypatch) -> None:
    monkeypatch.setenv("APIARY_MLFLOW_AUTH_CACHE_S", "30")
    asked: list[str] = []

    def fetch(token: str) -> dict | None:
        asked.append(token)
        return {"user": "alice", "admin": False, "groups": []} if token == "good" else None

    assert plugin.identity_of("good", now=100.0, fetch=fetch)["user"] == "alice"
    assert plugin.identity_of("good", now=129.0, fetch=fetch)["user"] == "alice"
    assert plugin.identity_of("bad", now=100.0, fetch=fetch) is None
    assert plugin.identity_of("bad", now=110.0, fetch=fetch) is None
    assert asked == ["good", "bad"]
    plugin.identity_of("good", now=131.0, fetch=fetch)  # expired: asked again (a revoked token stops here)
    assert asked == ["good", "bad", "good"]


def test_an_outage_is_not_cached(plugin: ModuleType) -> None:
    calls = []

    def down(token: str) -> dict | None:
        calls.append(token)
        raise plugin.Unavailable("down")

    for _ in range(2):
        with pytest.raises(plugin.Unavailable):
            plugin.identity_of("t", now=1.0, fetch=down)
    assert len(calls) == 2


def test_fetch_identity_against_a_route_that_refuses_and_one_that_is_gone(plugin: ModuleType) -> None:
    with pytest.raises(plugin.Unavailable):
        plugin.fetch_identity("t", api_url="http://127.0.0.1:9", timeout_s=2)  # nothing listens on port 9
    with pytest.raises(plugin.Unavailable, match="APIARY_API_URL"):
        plugin.fetch_identity("t", api_url="")


class FakeStore:
    def __init__(self) -> None:
        self.users: dict[str, tuple[str, bool]] = {}

    def has_user(self, name: str) -> bool:
        return name in self.users

    def create_user(self, name: str, password: str, is_admin: bool = False) -> None:
        self.users[name] = (password, is_admin)

    def get_user(self, name: str) -> object:
        return type("U", (), {"is_admin": self.users[name][1]})()

    def update_user(self, name: str, password: str | None = None, is_admin: bool | None = None) -> None:
        self.users[name] = (self.users[name][0], bool(is_admin))


def test_users_are_made_with_unusable_passwords_and_follow_apiarys_admin_flag(plugin: ModuleType) -> None:
    store = FakeStore()
    plugin.ensure_user("alice", False, store)
    plugin.ensure_user("root", True, store)
    assert store.users["alice"][1] is False and store.users["root"][1] is True
    assert len(store.users["alice"][0]) >= 48 and store.users["alice"][0] != store.users["root"][0]
    plugin._users.clear()
    plugin.ensure_user("root", False, store)  # no longer an admin in Apiary: no longer one in MLflow
    assert store.users["root"][1] is False


@pytest.mark.parametrize(("who", "name", "refused"), [
    pytest.param("alice", "users/alice", False, id="own"),
    pytest.param("alice", "users/bob", True, id="another-users"),
    pytest.param("alice", "team-x", False, id="free-name"),
    pytest.param("root", "users/bob", False, id="admin"),
])
def test_a_users_experiment_is_theirs(plugin: ModuleType, who: str, name: str, refused: bool) -> None:
    identity = {"user": who, "admin": who == "root", "groups": []}
    why = plugin.squatting("POST", "/api/2.0/mlflow/experiments/create", {"name": name}, identity)
    assert bool(why) is refused
    assert plugin.squatting("GET", "/api/2.0/mlflow/experiments/get-by-name", {"name": name}, identity) is None
