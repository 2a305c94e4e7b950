"""``apiary ca``: init, issue and hash through the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from typer.testing import CliRunner

from apiary import pki
from apiary.cli.ca import ca_app


def run(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(ca_app, list(args))
    return result.exit_code, result.output.splitlines()


def test_init_issue_and_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("APIARY_CA_CERT", raising=False)
    code, lines = run("init")  # default: APIARY_HOME/pki
    ca = tmp_path / "home" / "pki" / "ca.crt"
    assert code == 0 and lines == [str(ca), pki.ca_cert_hash(ca.read_bytes())]
    assert run("init") == (0, lines)  # kept, not replaced
    code, lines = run("issue", "cp-1", "--host", "198.18.0.2", "--host", "cp-1.apiary", "--out", str(tmp_path / "o"))
    assert code == 0 and lines == [str(tmp_path / "o" / "cp-1.crt"), str(tmp_path / "o" / "cp-1.key")]
    cert = x509.load_pem_x509_certificate((tmp_path / "o" / "cp-1.crt").read_bytes())
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["cp-1.apiary"]
    assert (tmp_path / "o" / "cp-1.key").stat().st_mode & 0o777 == 0o600
    expected = pki.ca_cert_hash(ca.read_bytes())
    assert run("hash") == (0, [expected])
    assert run("hash", "--cert", str(ca)) == (0, [expected])
    monkeypatch.setenv("APIARY_CA_CERT", str(ca))
    assert run("hash") == (0, [expected])


def test_errors_name_what_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_HOME", str(tmp_path))
    code, lines = run("issue", "cp-1", "--host", "h", "--dir", str(tmp_path / "none"))
    assert code == 1 and "apiary ca init" in " ".join(lines)
    run("init", "--dir", str(tmp_path / "ca"))
    code, lines = run("issue", "cp-1", "--dir", str(tmp_path / "ca"))
    assert code == 1 and "hosts" in " ".join(lines)
    code, lines = run("hash", "--cert", str(tmp_path / "missing.crt"))
    assert code == 1 and "ca_cert" in " ".join(lines)
