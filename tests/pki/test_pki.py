"""The platform CA: files and modes, SANs and usages, kubeadm's CA hash, idempotence."""

from __future__ import annotations

import hashlib
import ipaddress
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from apiary import pki
from apiary.errors import ValidationError


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_init_ca_writes_cert_0644_and_key_0600_and_keeps_an_existing_ca(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca", common_name="test-ca")
    assert ca == tmp_path / "ca" / "ca.crt"
    assert _mode(ca) == 0o644
    assert _mode(tmp_path / "ca" / "ca.key") == 0o600
    cert = x509.load_pem_x509_certificate(ca.read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    before = ca.read_bytes(), (tmp_path / "ca" / "ca.key").read_bytes()
    assert pki.init_ca(tmp_path / "ca") == ca
    assert (ca.read_bytes(), (tmp_path / "ca" / "ca.key").read_bytes()) == before


def test_init_ca_refuses_a_directory_with_only_the_certificate(tmp_path: Path) -> None:
    pki.init_ca(tmp_path)
    (tmp_path / "ca.key").unlink()
    with pytest.raises(ValidationError) as err:
        pki.init_ca(tmp_path)
    assert err.value.field == "ca_dir"


def test_issue_puts_ip_and_dns_sans_and_both_usages_and_chains_to_the_ca(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    crt, key = pki.issue(tmp_path / "ca", tmp_path / "out", "cp-1", ["198.18.0.2", "cp-1.apiary", "::1"])
    assert (crt, key) == (tmp_path / "out" / "cp-1.crt", tmp_path / "out" / "cp-1.key")
    assert (_mode(crt), _mode(key)) == (0o644, 0o600)
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("198.18.0.2"), ipaddress.ip_address("::1")]
    assert san.get_values_for_type(x509.DNSName) == ["cp-1.apiary"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.read_bytes()))
    # openssl agrees that the chain verifies for TLS servers
    out = subprocess.run(["openssl", "verify", "-CAfile", str(ca), "-purpose", "sslserver", str(crt)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_a_client_certificate_is_client_auth_only(tmp_path: Path) -> None:
    pki.init_ca(tmp_path / "ca")
    crt, _ = pki.issue(tmp_path / "ca", tmp_path, "node-1", [], client=True)
    eku = x509.load_pem_x509_certificate(crt.read_bytes()).extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(eku.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]


@pytest.mark.parametrize(
    ("name", "hosts", "days", "field"),
    [("../x", ["h"], 365, "name"), ("", ["h"], 365, "name"), ("cp", [], 365, "hosts"), ("cp", ["h"], 0, "days")],
    ids=["name-with-slash", "empty-name", "server-without-hosts", "zero-days"],
)
def test_issue_names_the_bad_field(tmp_path: Path, name: str, hosts: list[str], days: int, field: str) -> None:
    pki.init_ca(tmp_path / "ca")
    with pytest.raises(ValidationError) as err:
        pki.issue(tmp_path / "ca", tmp_path, name, hosts, days=days)
    assert err.value.field == field


def test_issue_without_a_ca_says_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="apiary ca init") as err:
        pki.issue(tmp_path, tmp_path, "cp", ["h"])
    assert err.value.field == "ca_dir"


def test_ca_cert_hash_is_kubeadms_spki_sha256_as_openssl_computes_it(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path)
    pub = subprocess.run(["openssl", "x509", "-pubkey", "-noout", "-in", str(ca)], capture_output=True,
                         check=True).stdout
    der = subprocess.run(["openssl", "pkey", "-pubin", "-outform", "der"], input=pub, capture_output=True,
                         check=True).stdout
    assert pki.ca_cert_hash(ca.read_bytes()) == "sha256:" + hashlib.sha256(der).hexdigest()
    other = pki.init_ca(tmp_path / "other")
    assert pki.ca_cert_hash(other.read_bytes()) != pki.ca_cert_hash(ca.read_bytes())


def test_load_ca_pem_and_server_ssl_kwargs_name_the_setting(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path)
    assert pki.load_ca_pem(ca) == ca.read_bytes()
    with pytest.raises(ValidationError) as err:
        pki.load_ca_pem(tmp_path / "missing.crt")
    assert err.value.field == "ca_cert"
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(ValidationError):
        pki.load_ca_pem(tmp_path / "junk.crt")
    crt, key = pki.issue(tmp_path, tmp_path, "cp", ["127.0.0.1"])
    assert pki.server_ssl_kwargs(crt, key) == {"ssl_certfile": str(crt), "ssl_keyfile": str(key)}
    with pytest.raises(ValidationError) as err:
        pki.server_ssl_kwargs(crt, tmp_path / "nope.key")
    assert err.value.field == "tls_key"


# --------------------------------------------------------------------------- nodes' serving certificates


def test_sign_csr_keeps_the_node_sans_names_it_and_is_server_auth_only(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    key_pem, csr_pem = pki.make_node_csr("node-a", ["198.18.0.11", "node-a.rack3", "198.18.0.11"])
    cert = x509.load_pem_x509_certificate(pki.sign_csr(ca, tmp_path / "ca" / "ca.key", csr_pem, node="node-a"))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["node-a", "node-a.rack3"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("198.18.0.11")]
    assert cert.subject.rfc4514_string() == "CN=node-a"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert 364 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 366
    # The certificate holds the node's own key (made on the node), and the CA signed it.
    node_key = serialization.load_pem_private_key(key_pem, password=None)
    assert cert.public_key() == node_key.public_key()
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.read_bytes()))


def test_sign_csr_refuses_another_nodes_name_and_bad_requests_naming_the_field(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    ca_key = tmp_path / "ca" / "ca.key"
    others = {"node-b"}
    _, csr_pem = pki.make_node_csr("node-a", ["198.18.0.11", "node-b"])
    with pytest.raises(ValidationError) as e:
        pki.sign_csr(ca, ca_key, csr_pem, node="node-a", allowed=lambda n: n not in others)
    assert e.value.field == "csr" and "'node-b'" in e.value.message
    for bad in (b"not a csr", pki.make_node_csr("node-a", ["*.example"])[1]):
        with pytest.raises(ValidationError) as e:
            pki.sign_csr(ca, ca_key, bad, node="node-a")
        assert e.value.field == "csr"
    other_ca = pki.init_ca(tmp_path / "other")
    with pytest.raises(ValidationError) as e:  # a key that is not the certificate's
        pki.sign_csr(other_ca, ca_key, pki.make_node_csr("node-a", [])[1], node="node-a")
    assert e.value.field == "ca_key"
