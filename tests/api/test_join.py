"""Joining a node over REST (:mod:`apiary.api.routers.join`): admins make bootstrap tokens, anyone
reads the cluster info, a bootstrap token joins its node once and is a credential nowhere else; every
refusal is a 401 whose body says why."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6

from apiary import pki
from apiary.api import create_app
from apiary.auth import Directory
from apiary.auth.bootstrap_tokens import TOKEN_FORMAT, BootstrapTokens
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

CAROL, DAN = "hostname-carol", "hostname-dan"
T0 = 1_800_000_000.0


@dataclass
class World:
    client: TestClient
    plane: ControlPlane
    headers: dict[str, dict[str, str]]
    clock: list[float]
    ca_pem: str


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    directory = Directory(plane.sessions)
    p = Principals(directory, ["default", "vc1"])
    headers = {"admin": bearer(p.admin()), "alice": bearer(p.user("alice")), "agent-carol": bearer(p.agent(CAROL)),
               "bridge": bearer(p.service("bridge")), "alertmanager": bearer(p.service("alertmanager"))}
    ca = pki.init_ca(tmp_path / "ca")
    clock = [T0]
    settings = Settings(ca_cert=ca, api_url="https://198.18.0.2:8470,https://198.18.0.3:8470")
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), cluster_id="c-join", settings=settings,
                     directory=directory, bootstrap_tokens=BootstrapTokens(plane.sessions, directory,
                                                                           clock=lambda: clock[0]))
    with TestClient(app) as client:
        yield World(client, plane, headers, clock, ca.read_text())
    engine.dispose()


def new_token(w: World, **body: object) -> dict:
    r = w.client.post("/api/v2/bootstrap-tokens", json=body, headers=w.headers["admin"])
    assert r.status_code == 201, r.text
    return r.json()


def join(w: World, node: str, token: str | None) -> tuple[int, dict]:
    r = w.client.post(f"/api/v2/nodes/{node}/join", headers=bearer(token) if token is not None else {})
    return r.status_code, r.json()


def test_cluster_info_is_public_and_names_the_ca_and_the_replicas(world: World) -> None:
    r = world.client.get("/api/v2/cluster-info")
    assert r.status_code == 200
    assert r.json() == {"clusterId": "c-join", "caCert": world.ca_pem,
                        "apiUrls": ["https://198.18.0.2:8470", "https://198.18.0.3:8470"]}


def test_cluster_info_without_a_ca_says_null(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/b.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), settings=Settings())
    with TestClient(app) as client:
        assert client.get("/api/v2/cluster-info").json() == {"clusterId": None, "caCert": None, "apiUrls": None}
    engine.dispose()


def test_a_node_joins_once_and_its_credential_is_its_own_agents_only(world: World) -> None:
    c, h = world.client, world.headers
    made = new_token(world, description="rack 3")
    assert re.fullmatch(TOKEN_FORMAT, made["token"]) and made["expires"] - made["created"] == 3600
    assert made["createdBy"] == "root" and made["state"] == "valid" and made["node"] is None

    r = c.post(f"/api/v2/nodes/{DAN}/join", headers=bearer(made["token"]))
    assert r.status_code == 200, r.text
    assert r.headers["Cache-Control"] == "no-store"
    joined = r.json()
    assert joined["node"] == DAN and joined["caCert"] == world.ca_pem
    agent = bearer(joined["token"])
    assert c.get("/api/v2/me", headers=agent).json()["name"] == DAN
    report = {"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": []}
    assert c.post(f"/api/v2/nodes/{DAN}/status", json=report, headers=agent).status_code == 200
    r = c.post(f"/api/v2/nodes/{CAROL}/status", json=report, headers=agent)
    assert r.status_code == 403 and f"the agent of node {DAN}" in r.json()["message"]

    status, body = join(world, DAN, made["token"])
    assert status == 401 and body["code"] == "BootstrapTokenError"
    assert f"was already used (by node {DAN} at " in body["message"]
    listed = c.get("/api/v2/bootstrap-tokens", headers=h["admin"])
    assert listed.json()[0]["state"] == "used" and listed.json()[0]["usedBy"] == DAN
    assert made["token"][7:] not in listed.text and "token" not in listed.json()[0]


def test_every_refusal_is_a_401_naming_why(world: World) -> None:
    c, h = world.client, world.headers
    for_carol = new_token(world, node=CAROL)
    status, body = join(world, DAN, for_carol["token"])
    assert (status, body["message"]) == (401, f"Bootstrap token {for_carol['id']} is for node {CAROL}, not {DAN}.")

    revoked = new_token(world)
    r = c.delete(f"/api/v2/bootstrap-tokens/{revoked['id']}", headers=h["admin"])
    assert r.status_code == 200 and r.json()["state"] == "revoked"
    status, body = join(world, DAN, revoked["token"])
    assert status == 401 and f"Bootstrap token {revoked['id']} was revoked" in body["message"]

    short = new_token(world, ttlSeconds=60)
    world.clock[0] += 60
    status, body = join(world, DAN, short["token"])
    assert status == 401 and f"Bootstrap token {short['id']} has expired" in body["message"]

    for token, why in ((None, "Missing bootstrap token"), ("nonsense", "Malformed bootstrap token"),
                       ("zzzzzz.0123456789abcdef", "Invalid bootstrap token zzzzzz")):
        r = c.post(f"/api/v2/nodes/{DAN}/join", headers=bearer(token) if token else {})
        assert r.status_code == 401 and why in r.json()["message"], r.text
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    for who in h:  # an Apiary token is no bootstrap token, an admin's included
        status, body = join(world, DAN, h[who]["Authorization"][7:])
        assert status == 401 and "Malformed bootstrap token" in body["message"], who
    assert c.get("/api/v2/cluster/status", headers=bearer(new_token(world)["token"])).status_code == 401


def test_unknown_and_joined_nodes(world: World) -> None:
    made = new_token(world)
    status, body = join(world, "hostname-zed", made["token"])
    assert (status, body["message"]) == (404, "Node hostname-zed is not in the cluster config.")
    status, body = join(world, CAROL, made["token"])  # carol's agent token exists (the World made one)
    assert status == 409 and body["code"] == "NodeJoinedError" and f"Node {CAROL} has joined already" in body["message"]
    assert join(world, DAN, made["token"])[0] == 200  # neither refusal spent it
    r = world.client.post("/api/v2/bootstrap-tokens", json={"node": "hostname-zed"}, headers=world.headers["admin"])
    assert r.status_code == 404 and "hostname-zed" in r.json()["message"]


@pytest.mark.parametrize("body, field", [
    ({"ttlSeconds": 86401}, "ttlSeconds"), ({"ttlSeconds": 0}, "ttlSeconds"), ({"ttl": 60}, "ttl"),
    ({"description": "x" * 1001}, "description"),
])
def test_a_bad_body_is_a_400_naming_the_field(world: World, body: dict, field: str) -> None:
    r = world.client.post("/api/v2/bootstrap-tokens", json=body, headers=world.headers["admin"])
    assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_only_admins_manage_bootstrap_tokens(world: World) -> None:
    c, h = world.client, world.headers
    made = new_token(world)
    for who in ("alice", "agent-carol", "bridge", "alertmanager"):
        assert c.post("/api/v2/bootstrap-tokens", json={}, headers=h[who]).status_code == 403, who
        assert c.get("/api/v2/bootstrap-tokens", headers=h[who]).status_code == 403, who
        assert c.delete(f"/api/v2/bootstrap-tokens/{made['id']}", headers=h[who]).status_code == 403, who
    assert c.get("/api/v2/bootstrap-tokens").status_code == 401
    assert c.delete("/api/v2/bootstrap-tokens/zzzzzz", headers=h["admin"]).status_code == 404
    assert [t["state"] for t in c.get("/api/v2/bootstrap-tokens", headers=h["admin"]).json()] == ["valid"]


def test_the_unauthenticated_routes_are_rate_limited_per_client_address(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/r.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}),
                     settings=Settings(rate_calls="3/minute"))
    with TestClient(app) as client:
        assert [client.get("/api/v2/cluster-info").status_code for _ in range(4)] == [200, 200, 200, 429]
        codes = [client.post(f"/api/v2/nodes/{DAN}/join", headers=bearer("zzzzzz.0123456789abcdef")).status_code
                 for _ in range(4)]
        assert codes == [401, 401, 401, 429]  # a guesser gets few tries
    engine.dispose()


def _with_ca_key(world: World, ca_dir: Path) -> None:
    """This replica holds the CA key (APIARY_CA_KEY), as a control-plane host does."""
    app = world.client.app
    app.state.settings = Settings(ca_cert=ca_dir / "ca.crt", ca_key=ca_dir / "ca.key")  # type: ignore[attr-defined]


def test_a_join_with_a_csr_answers_the_nodes_serving_certificate_signed_by_the_ca(world: World,
                                                                               tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    _with_ca_key(world, tmp_path / "ca")
    key_pem, csr_pem = pki.make_node_csr(DAN, ["198.18.0.21"])
    r = world.client.post(f"/api/v2/nodes/{DAN}/join", json={"csr": csr_pem.decode()},
                          headers=bearer(new_token(world)["token"]))
    assert r.status_code == 200, r.text
    cert = x509.load_pem_x509_certificate(r.json()["certificate"].encode())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(world.ca_pem.encode()))
    assert cert.subject.rfc4514_string() == f"CN={DAN}"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [DAN]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["198.18.0.21"]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert key_pem.decode() not in r.text


def test_a_csr_naming_another_node_is_a_400_and_leaves_the_token_unspent(world: World, tmp_path: Path) -> None:
    _with_ca_key(world, tmp_path / "ca")
    made = new_token(world)
    _, csr_pem = pki.make_node_csr(DAN, [CAROL])
    r = world.client.post(f"/api/v2/nodes/{DAN}/join", json={"csr": csr_pem.decode()}, headers=bearer(made["token"]))
    assert r.status_code == 400 and r.json()["field"] == "csr" and CAROL in r.json()["message"]
    r = world.client.post(f"/api/v2/nodes/{DAN}/join", json={"csr": "junk"}, headers=bearer(made["token"]))
    assert r.status_code == 400 and r.json()["field"] == "csr"
    # a caller without a good token learns nothing of the CSR's fate
    r = world.client.post(f"/api/v2/nodes/{DAN}/join", json={"csr": csr_pem.decode()},
                          headers=bearer("zzzzzz.0123456789abcdef"))
    assert r.status_code == 401
    status, body = join(world, DAN, made["token"])  # the refusals spent nothing
    assert status == 200 and body["certificate"] is None


def test_without_the_ca_key_a_join_with_a_csr_answers_no_certificate(world: World) -> None:
    _, csr_pem = pki.make_node_csr(DAN, ["198.18.0.21"])
    r = world.client.post(f"/api/v2/nodes/{DAN}/join", json={"csr": csr_pem.decode()},
                          headers=bearer(new_token(world)["token"]))
    assert r.status_code == 200, r.text
    assert r.json()["certificate"] is None and r.json()["caCert"] == world.ca_pem


def test_without_a_bootstrap_token_a_join_is_a_401_whatever_the_body_holds(world: World) -> None:
    for body in ({"csr": 5}, {"csr": "x\u0000y"}, {"other": 1}):
        r = world.client.post(f"/api/v2/nodes/{DAN}/join", json=body)
        assert r.status_code == 401 and r.json()["code"] == "BootstrapTokenError", (body, r.text)
    status, _ = join(world, DAN, new_token(world)["token"])  # nothing was spent by them
    assert status == 200
