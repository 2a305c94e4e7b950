"""``apiary ca``: the platform CA (:mod:`apiary.pki`).

* ``apiary ca init [--dir D]``: make the CA in D (default ``APIARY_HOME/pki``) unless one is there;
  prints ``ca.crt``'s path and its ``sha256:`` hash.
* ``apiary ca issue NAME --host H [--host H2 ...] [--client] [--days N] [--dir D] [--out O]``: sign
  ``O/NAME.crt`` and ``O/NAME.key`` (0600) for the hosts' names and addresses; prints both paths.
* ``apiary ca hash [--cert PATH]``: the CA's hash (kubeadm's ``--discovery-token-ca-cert-hash``)
  to give to joining nodes (``apiary agent join --ca-cert-hash``); default the CA in
  ``APIARY_CA_CERT``, else ``APIARY_HOME/pki/ca.crt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from apiary.cli.common import err, settings
from apiary.errors import ApiaryError

ca_app = typer.Typer(no_args_is_help=True, help="The platform CA: certificates for TLS between hosts.")

#: The CA's directory under APIARY_HOME when --dir is not given.
PKI_DIR = "pki"


def _default_dir() -> Path:
    return settings().home_dir / PKI_DIR


def _fail(message: str) -> NoReturn:
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@ca_app.command("init")
def init_command(
    directory: Path | None = typer.Option(None, "--dir", file_okay=False,
                                          help="The CA's directory (default APIARY_HOME/pki)."),
    common_name: str = typer.Option("apiary-ca", "--common-name", help="The CA certificate's subject CN."),
) -> None:
    """Make the platform CA (ca.crt 0644, ca.key 0600) unless the directory holds one; prints
    ca.crt's path and its sha256 hash."""
    from apiary import pki

    try:
        cert = pki.init_ca(directory or _default_dir(), common_name=common_name)
        print(cert)
        print(pki.ca_cert_hash(cert.read_bytes()))
    except ApiaryError as e:
        _fail(e.message)


@ca_app.command("issue")
def issue_command(
    name: str = typer.Argument(..., help="The certificate's name (its CN and file name), e.g. cp-1."),
    hosts: list[str] = typer.Option([], "--host", help="A host name or IP address the component is reached "
                                                       "by (repeat); IP addresses go in as IP SANs."),
    client: bool = typer.Option(False, "--client", help="A client certificate only (no server auth)."),
    days: int = typer.Option(365, "--days", help="Validity, days."),
    directory: Path | None = typer.Option(None, "--dir", file_okay=False,
                                          help="The CA's directory (default APIARY_HOME/pki)."),
    out: Path | None = typer.Option(None, "--out", file_okay=False,
                                    help="Where NAME.crt and NAME.key go (default the CA's directory)."),
) -> None:
    """Sign a certificate with the platform CA; prints the certificate's and the key's paths."""
    from apiary import pki

    ca_dir = directory or _default_dir()
    try:
        cert, key = pki.issue(ca_dir, out or ca_dir, name, hosts, client=client, days=days)
    except ApiaryError as e:
        _fail(e.message)
    print(cert)
    print(key)


@ca_app.command("hash")
def hash_command(
    cert: Path | None = typer.Option(None, "--cert", dir_okay=False,
                                     help="The CA certificate (default APIARY_CA_CERT, else APIARY_HOME/pki/ca.crt)."),
) -> None:
    """Print the CA's sha256 hash (of its public key, as kubeadm's --discovery-token-ca-cert-hash)."""
    from apiary import pki

    path = cert or settings().ca_cert or _default_dir() / pki.CA_CERT
    try:
        print(pki.ca_cert_hash(pki.load_ca_pem(path)))
    except ApiaryError as e:
        _fail(e.message)
