"""``apiary node bootstrap-token`` and ``apiary agent join`` (:mod:`apiary.cli.join`) against a real
control-plane app served over HTTPS on loopback with a certificate of the platform CA: the join
pins the CA by hash, refuses another one, verifies TLS against the pinned CA, and writes the node's
credential 0600."""

from __future__ import annotations

import re
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
import uvicorn
from tests.support.auth import Principals
from tests.support.builders import LAB6
from tests.support.polling import until
from tests.support.serving import serving
from typer.testing import CliRunner

from apiary import pki
from apiary.api import create_app
from apiary.auth import Directory
from apiary.cli.join import agent_join, bootstrap_token_app, parse_ttl
from apiary.client import ApiaryClient
from apiary.control import ControlPlane
from apiary.errors import ValidationError
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory
from apiary.tracking.prefect_server import free_port

CAROL, DAN = "hostname-carol", "hostname-dan"

#: The two commands as main.py mounts them (``apiary node bootstrap-token ...``, ``apiary agent join``).
cli = typer.Typer()
cli.add_typer(bootstrap_token_app, name="bootstrap-token")
cli.command("join")(agent_join)


@contextmanager
def serving_tls(app: object, cert: Path, key: Path) -> Iterator[str]:
    """``https://127.0.0.1:<port>`` while ``app`` is served there with ``cert`` (uvicorn in a thread)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=1, **pki.server_ssl_kwargs(cert, key)))
    thread = threading.Thread(target=server.run, name=f"uvicorn-tls-{port}", daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 30, f"the TLS test server on port {port}")
        yield f"https://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class Platform:
    app: object
    ca: Path
    ca_dir: Path
    admin: str
    tmp: Path


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[Platform]:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    directory = Directory(plane.sessions)
    admin = Principals(directory, ["default", "vc1"]).admin()
    ca = pki.init_ca(tmp_path / "ca")
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), cluster_id="c-cli",
                     settings=Settings(ca_cert=ca), directory=directory)
    yield Platform(app, ca, tmp_path / "ca", admin, tmp_path)
    engine.dispose()


@pytest.fixture
def https(platform: Platform) -> Iterator[str]:
    cert, key = pki.issue(platform.ca_dir, platform.tmp / "certs", "cp", ["127.0.0.1"])
    with serving_tls(platform.app, cert, key) as url:
        yield url


def run(args: list[str], url: str, p: Platform, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setenv("APIARY_HOME", str(p.tmp / "home"))
    monkeypatch.setenv("APIARY_API_URL", url)
    monkeypatch.setenv("APIARY_TOKEN", p.admin)
    monkeypatch.setenv("APIARY_CA_CERT", str(p.ca))
    result = CliRunner().invoke(cli, args)
    return result.exit_code, " ".join(result.output.split())


def new_token(url: str, p: Platform, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[str, str]:
    """``(token, the printed join command)`` of ``bootstrap-token create``."""
    code, out = run(["bootstrap-token", "create", "--ttl", "30m", *extra], url, p, monkeypatch)
    assert code == 0, out
    token = re.search(r"\b[a-z0-9]{6}\.[a-z0-9]{16}\b", out)
    command = re.search(r"apiary agent join .*? --node \S+", out)
    assert token and command, out
    return token[0], command[0]


def test_a_node_joins_over_tls_pinning_the_ca_and_keeps_its_credential_0600(
        platform: Platform, https: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ca_hash = pki.ca_cert_hash(platform.ca.read_bytes())
    token, command = new_token(https, platform, monkeypatch, "--node", DAN)
    assert command == f"apiary agent join --api {https} --token {token} --ca-cert-hash {ca_hash} --node {DAN}"
    creds = platform.tmp / "node" / "credentials"

    wrong = "sha256:" + "0" * 64
    code, out = run(["join", "--api", https, "--token", token, "--ca-cert-hash", wrong, "--node", DAN,
                     "--credentials", str(creds)], https, platform, monkeypatch)
    assert code == 1 and "refusing to join" in out and f"a CA whose hash is {ca_hash}, not the pinned {wrong}" in out
    assert not creds.exists()
    code, out = run(["join", "--api", https, "--token", token, "--node", DAN, "--credentials", str(creds)],
                    https, platform, monkeypatch)
    assert code == 1 and "ca-cert-hash: required" in out and not creds.exists()

    code, out = run(command.split()[2:] + ["--credentials", str(creds)], https, platform, monkeypatch)
    assert code == 0, out
    token_file, ca_file = creds / f"agent-{DAN}.token", creds / "ca.crt"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and stat.S_IMODE(ca_file.stat().st_mode) == 0o644
    assert stat.S_IMODE(creds.stat().st_mode) == 0o700
    assert ca_file.read_bytes() == platform.ca.read_bytes()
    assert f"apiary agent --api {https} --node {DAN} --credentials {creds} --ca-cert {ca_file}" in out
    agent = ApiaryClient(https, token=token_file.read_text().strip(), ca_cert=ca_file)
    assert agent.me()["name"] == DAN and agent.me()["kind"] == "agent"
    agent.close()

    code, out = run(command.split()[2:] + ["--credentials", str(creds)], https, platform, monkeypatch)
    assert code == 1 and "was already used (by node hostname-dan" in out
    code, out = run(["bootstrap-token", "list"], https, platform, monkeypatch)
    assert code == 0 and token[:6] in out and "used" in out and token[7:] not in out


def test_a_server_with_the_pinned_ca_in_its_cluster_info_but_another_cas_certificate_gets_no_token(
        platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin is checked twice: the CA's hash, then TLS against that CA. A server that copies the
    platform's cluster info but cannot show a certificate of that CA is sent nothing."""
    pki.init_ca(platform.tmp / "other-ca")
    cert, key = pki.issue(platform.tmp / "other-ca", platform.tmp / "other-certs", "fake", ["127.0.0.1"])
    creds = platform.tmp / "node"
    with serving_tls(platform.app, cert, key) as url:
        token = platform.app.state.bootstrap_tokens.create(600)[0]  # type: ignore[attr-defined]
        code, out = run(["join", "--api", url, "--token", token, "--ca-cert-hash",
                         pki.ca_cert_hash(platform.ca.read_bytes()), "--node", DAN, "--credentials", str(creds)],
                        url, platform, monkeypatch)
        assert code == 1 and "not reachable with the pinned CA" in out and "CERTIFICATE_VERIFY_FAILED" in out
        assert not creds.exists()
        assert platform.app.state.bootstrap_tokens.list()[0]["state"] == "valid"  # type: ignore[attr-defined]


def test_unsafe_skip_ca_verification_trusts_the_presented_ca_and_says_so(
        platform: Platform, https: str, monkeypatch: pytest.MonkeyPatch) -> None:
    token, _ = new_token(https, platform, monkeypatch)
    creds = platform.tmp / "node"
    code, out = run(["join", "--api", https, "--token", token, "--unsafe-skip-ca-verification", "--node", CAROL,
                     "--credentials", str(creds)], https, platform, monkeypatch)
    assert code == 0 and "trusted unchecked" in out, out
    assert (creds / "ca.crt").read_bytes() == platform.ca.read_bytes()
    code, out = run(["bootstrap-token", "create", "--ttl", "25h"], https, platform, monkeypatch)
    assert code == 1 and "(400)" in out and "ttlSeconds" in out  # the server's limit: 24 h


def test_plain_http_joins_on_loopback_only_and_revoked_tokens_are_refused(
        platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    creds = platform.tmp / "node"
    with serving(platform.app) as url:
        tokens = platform.app.state.bootstrap_tokens  # type: ignore[attr-defined]
        revoked, row = tokens.create(600)
        code, out = run(["bootstrap-token", "revoke", row["id"]], url, platform, monkeypatch)
        assert code == 0 and f"Bootstrap token {row['id']} revoked" in out
        code, out = run(["join", "--api", url, "--token", revoked, "--node", DAN, "--credentials", str(creds)],
                        url, platform, monkeypatch)
        assert code == 1 and "(401)" in out and f"Bootstrap token {row['id']} was revoked" in out
        code, out = run(["join", "--api", url, "--token", tokens.create(600)[0], "--node", DAN, "--credentials",
                         str(creds)], url, platform, monkeypatch)
        assert code == 0 and stat.S_IMODE((creds / f"agent-{DAN}.token").stat().st_mode) == 0o600, out
    code, out = run(["join", "--api", "http://198.18.0.2:8470", "--token", "abcdef.0123456789abcdef",
                     "--unsafe-skip-ca-verification", "--node", CAROL], url, platform, monkeypatch)
    assert code == 1 and "refusing to send a token over plain HTTP" in out


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("3600", 3600), ("30m", 1800), ("1h", 3600), ("1.5h", 5400)])
def test_ttl_forms(text: str, seconds: float) -> None:
    assert parse_ttl(text) == seconds


@pytest.mark.parametrize("text", ["1d", "h", "-5m", ""])
def test_a_ttl_that_is_no_duration_names_the_option(text: str) -> None:
    with pytest.raises(ValidationError, match="ttl"):
        parse_ttl(text)


def test_the_help_texts_are_plain_text() -> None:
    markup = re.compile(r"``|`|:(?:class|func|mod|meth|attr|data|exc):")
    for args in (["bootstrap-token", "create"], ["bootstrap-token", "list"], ["bootstrap-token", "revoke"],
                 ["bootstrap-token"], ["join"]):
        result = CliRunner().invoke(cli, [*args, "--help"])
        assert result.exit_code == 0 and not markup.findall(result.output), result.output


def test_a_node_gets_its_serving_certificate_when_the_control_plane_holds_the_ca_key(
        platform: Platform, https: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    creds = platform.tmp / "node" / "credentials"
    # Without the CA key: the join works, and says /metrics stays HTTP.
    token, command = new_token(https, platform, monkeypatch, "--node", CAROL)
    code, out = run(command.split()[2:] + ["--credentials", str(creds)], https, platform, monkeypatch)
    assert code == 0 and "/metrics stays HTTP" in out and "--metrics-cert" not in out, out
    assert not (creds / "node.key").exists() and not (creds / "node.crt").exists()

    platform.app.state.settings = Settings(ca_cert=platform.ca, ca_key=platform.ca_dir / "ca.key")  # type: ignore[attr-defined]
    token, command = new_token(https, platform, monkeypatch, "--node", DAN)
    code, out = run(command.split()[2:] + ["--credentials", str(creds), "--address", "198.18.0.21",
                                           "--address", "dan.rack3"], https, platform, monkeypatch)
    assert code == 0, out
    crt, key = creds / "node.crt", creds / "node.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(crt.stat().st_mode) == 0o644
    assert f"--metrics-cert {crt} --metrics-key {key}" in out
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(platform.ca.read_bytes()))
    assert cert.public_key() == serialization.load_pem_private_key(key.read_bytes(), None).public_key()
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [DAN, "dan.rack3"]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["198.18.0.21"]


def test_an_address_that_is_no_address_names_the_option() -> None:
    from apiary.cli.join import serving_names

    assert serving_names("n1", ["10.0.0.5", "n1", "n1.example"]) == ["n1", "10.0.0.5", "n1.example"]
    with pytest.raises(ValidationError) as e:
        serving_names("n1", ["not an address"])
    assert e.value.field == "address"
    default = serving_names("n1")
    assert default[0] == "n1" and "127.0.0.1" not in default and "::1" not in default
