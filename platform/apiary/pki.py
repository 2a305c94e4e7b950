"""The platform CA: certificates for the control plane, agents and services.

One self-signed CA (``ca.crt`` 0644, ``ca.key`` 0600 in one directory) signs a certificate per
component with the host names and addresses it is reached by (:func:`issue`). Clients verify
servers against ``ca.crt`` (``APIARY_CA_CERT``); a joining node pins the CA by
:func:`ca_cert_hash`, the form of kubeadm's ``--discovery-token-ca-cert-hash``.

Keys are ECDSA on P-256 (NIST SP 800-186; the curve TLS 1.2 and 1.3 implementations all accept),
signatures SHA-256. Key files are created with mode 0600 (``os.open`` with the mode, so no moment
exists where the key is readable by others) and never logged. This module is a leaf: it imports
only :mod:`apiary.errors` and ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from apiary.errors import ValidationError

#: File names in a CA directory.
CA_CERT = "ca.crt"
CA_KEY = "ca.key"

#: How long the CA lasts (kubeadm's CA: 10 years).
CA_DAYS = 3650

#: Allowed clock skew between hosts: certificates are valid from this long before now.
_BACKDATE = dt.timedelta(minutes=5)


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` created 0600 (replacing a file that was there)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` created 0644 (whole or not at all)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.fchmod(fd, 0o644)  # readable by all whatever the umask (a CLI process runs under 077)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def init_ca(directory: Path, common_name: str = "apiary-ca") -> Path:
    """Make the platform CA in ``directory`` (created 0700 if missing); returns the ``ca.crt`` path.

    Writes ``ca.crt`` (PEM, 0644) and ``ca.key`` (PEM PKCS#8, 0600). Idempotent: when ``ca.crt``
    and ``ca.key`` exist they are kept as they are (a second ``apiary ca init`` must not replace
    the CA every node has pinned). A directory with only one of the two raises
    :class:`~apiary.errors.ValidationError` (field ``ca_dir``) rather than guessing.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() and key_path.exists():
        return cert_path
    if cert_path.exists() or key_path.exists():
        raise ValidationError("ca_dir", f"{directory} holds only one of {CA_CERT} and {CA_KEY}; "
                                        "restore the other or use an empty directory")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def _san(host: str) -> x509.GeneralName:
    """A SubjectAlternativeName entry: an IP address when ``host`` parses as one, else a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(
    ca_dir: Path, out_dir: Path, name: str, hosts: list[str], *, client: bool = False, days: int = 365
) -> tuple[Path, Path]:
    """Sign a certificate for ``name`` with the CA in ``ca_dir``; returns ``(cert path, key path)``.

    Writes ``out_dir/<name>.crt`` (PEM, 0644) and ``out_dir/<name>.key`` (PEM PKCS#8, 0600),
    replacing earlier ones. The subject's common name is ``name``; the SubjectAlternativeName
    holds each entry of ``hosts`` as an IP address when it parses as one, else as a DNS name
    (clients match the SAN, not the CN: RFC 6125 section 6.4.4). The extended key usage is TLS
    server and client authentication; ``client=True`` makes a client-only certificate (no
    server auth, ``hosts`` may be empty). Valid from 5 minutes ago (clock skew) for ``days`` days.

    Raises :class:`~apiary.errors.ValidationError` naming the field: ``name`` empty or not a
    plain file name, ``hosts`` empty for a server certificate, ``days`` < 1, ``ca_dir`` without a
    CA (run :func:`init_ca`).
    """
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValidationError("name", f"{name!r} must be a plain file name (no '/', not starting with '.')")
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts and not client:
        raise ValidationError("hosts", "a server certificate needs at least one host name or address")
    if days < 1:
        raise ValidationError("days", f"{days} must be >= 1")
    ca_cert, ca_key = _load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    _write_private(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise ValidationError("ca_dir", f"no CA in {ca_dir} ({CA_CERT} and {CA_KEY}); run 'apiary ca init'")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValidationError("ca_dir", f"{key_path} is not an EC private key")
    return cert, key


def load_ca_pem(path: Path) -> bytes:
    """The PEM bytes of the CA certificate at ``path``.

    Raises :class:`~apiary.errors.ValidationError` (field ``ca_cert``) when the file is missing or
    holds no PEM certificate.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValidationError("ca_cert", f"cannot read {path}: {e.strerror or e}") from e
    try:
        x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise ValidationError("ca_cert", f"{path} holds no PEM certificate") from e
    return data


def ca_cert_hash(ca_pem: bytes) -> str:
    """``"sha256:<64 hex>"``: SHA-256 of the CA certificate's DER SubjectPublicKeyInfo.

    The same value as kubeadm's ``--discovery-token-ca-cert-hash`` (kubeadm's docs: "the hash is
    calculated over the bytes of the Subject Public Key Info (SPKI) object (as in RFC7469)"), so
    ``openssl x509 -pubkey | openssl pkey -pubin -outform der | sha256sum`` gives it too. Hashing
    the key rather than the whole certificate keeps the pin valid across a re-signed CA with the
    same key. Raises ValueError if ``ca_pem`` holds no PEM certificate.
    """
    cert = x509.load_pem_x509_certificate(ca_pem)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def server_ssl_kwargs(cert: Path, key: Path) -> dict[str, str]:
    """uvicorn's TLS arguments for a server certificate: ``{"ssl_certfile": str, "ssl_keyfile": str}``.

    Pass them to ``uvicorn.Config(...)`` / ``uvicorn.run(...)``. Raises
    :class:`~apiary.errors.ValidationError` (field ``tls_cert`` or ``tls_key``) when a file is
    missing, so a typo fails before the server binds.
    """
    for field, path in (("tls_cert", cert), ("tls_key", key)):
        if not path.is_file():
            raise ValidationError(field, f"{path} does not exist (APIARY_{field.upper()})")
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


# --------------------------------------------------------------------------- nodes' serving certificates

#: The most SubjectAlternativeName entries a node's CSR may carry (a node has a few addresses).
MAX_CSR_SANS = 64
#: The most bytes of a CSR (PEM) a join may carry.
MAX_CSR_BYTES = 16 * 1024


def make_node_csr(node: str, hosts: list[str]) -> tuple[bytes, bytes]:
    """A new key and a certificate signing request for node ``node``'s serving certificate:
    returns ``(key PEM PKCS#8, CSR PEM)``. The key is ECDSA P-256 and made here, on the node: only
    the CSR leaves it (the kubelet's serving certificate request, Kubernetes'
    ``kubernetes.io/kubelet-serving`` signer). The subject's CN is ``node``; the SANs are ``node``
    and each entry of ``hosts`` (IP address when it parses as one, else DNS name), without
    duplicates. Write the key with mode 0600 (:func:`write_private`). Raises
    :class:`~apiary.errors.ValidationError` (field ``node``) for an empty name."""
    if not node.strip():
        raise ValidationError("node", "a node's certificate needs its name")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[str] = []
    for h in [node, *hosts]:
        h = h.strip()
        if h and h not in names:
            names.append(h)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` (a private key) to ``path``, created with mode 0600 and replaced whole."""
    _write_private(path, data)


def write_public(path: Path, data: bytes) -> None:
    """Write ``data`` (a certificate) to ``path``, mode 0644, replaced whole."""
    _write_public(path, data)


def _csr_key_ok(key: object) -> bool:
    """EC keys on P-256 or P-384, RSA keys of 2048 bits or more (what TLS clients accept)."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    if isinstance(key, ec.EllipticCurvePublicKey):
        return isinstance(key.curve, ec.SECP256R1 | ec.SECP384R1)
    return isinstance(key, rsa.RSAPublicKey) and key.key_size >= 2048


def csr_names(csr_pem: bytes) -> list[str]:
    """The DNS names and IP addresses (as text) in a CSR's SubjectAlternativeName, in order;
    other kinds of names (e-mail, URI) are left out. Raises ValidationError (field ``csr``) when
    ``csr_pem`` is not a PEM CSR or its signature does not verify."""
    return [name for name, _ in _csr_sans(_load_csr(csr_pem))]


def _load_csr(csr_pem: bytes) -> x509.CertificateSigningRequest:
    if len(csr_pem) > MAX_CSR_BYTES:
        raise ValidationError("csr", f"the certificate signing request is over {MAX_CSR_BYTES} bytes")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise ValidationError("csr", "not a PEM certificate signing request (-----BEGIN CERTIFICATE REQUEST-----)") \
            from e
    if not csr.is_signature_valid:
        raise ValidationError("csr", "the certificate signing request's signature does not verify")
    return csr


def _csr_sans(csr: x509.CertificateSigningRequest) -> list[tuple[str, x509.GeneralName]]:
    try:
        ext = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    out: list[tuple[str, x509.GeneralName]] = []
    for general in ext:
        if isinstance(general, x509.DNSName):
            out.append((general.value, general))
        elif isinstance(general, x509.IPAddress) and isinstance(
                general.value, ipaddress.IPv4Address | ipaddress.IPv6Address):  # not a network
            out.append((str(general.value), general))
    return out


def sign_csr(
    ca_cert: Path, ca_key: Path, csr_pem: bytes, *, node: str,
    allowed: Callable[[str], bool] | None = None, days: int = 365,
) -> bytes:
    """Sign node ``node``'s serving certificate from its CSR with the CA (``ca_cert``, ``ca_key``
    PEM files); returns the certificate (PEM).

    As Kubernetes signs a kubelet's serving certificate (``kubernetes.io/kubelet-serving``: server
    auth only, the node's names and addresses): the subject is CN=``node`` whatever the CSR asked;
    the SANs are the CSR's DNS names and IP addresses (other kinds are dropped), each of which
    ``allowed`` (name or address text -> bool; None: all) must accept; the extended key usage is
    TLS server authentication alone; valid from 5 minutes ago (clock skew) for ``days`` days. The
    key stays the CSR's: no private key is made or seen here.

    Raises :class:`~apiary.errors.ValidationError` naming the field: ``csr`` (not a PEM CSR, a bad
    signature, a key other than EC P-256/P-384 or RSA >= 2048 bits, no DNS name or IP address, more
    than :data:`MAX_CSR_SANS`, a wildcard, a name ``allowed`` refuses), ``days`` < 1, ``ca_key``
    (unreadable, not an EC key, or not the key of ``ca_cert``).
    """
    if days < 1:
        raise ValidationError("days", f"{days} must be >= 1")
    csr = _load_csr(csr_pem)
    public = csr.public_key()
    if not _csr_key_ok(public):
        raise ValidationError("csr", "the CSR's key must be EC P-256/P-384 or RSA of 2048 bits or more")
    sans = _csr_sans(csr)
    if not sans:
        raise ValidationError("csr", "the CSR names no DNS name or IP address (SubjectAlternativeName)")
    if len(sans) > MAX_CSR_SANS:
        raise ValidationError("csr", f"the CSR names {len(sans)} hosts; at most {MAX_CSR_SANS}")
    for name, _ in sans:
        if "*" in name:
            raise ValidationError("csr", f"the CSR names {name!r}: a node's certificate holds no wildcard")
        if allowed is not None and not allowed(name):
            raise ValidationError("csr", f"the CSR names {name!r}, which node {node} may not have in its certificate")
    try:
        authority = x509.load_pem_x509_certificate(ca_cert.read_bytes())
        signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise ValidationError("ca_key", f"cannot load the CA ({ca_cert}, {ca_key}): {e}") from e
    if not isinstance(signer, ec.EllipticCurvePrivateKey):
        raise ValidationError("ca_key", f"{ca_key} is not an EC private key")
    if signer.public_key() != authority.public_key():
        raise ValidationError("ca_key", f"{ca_key} is not the key of the CA certificate {ca_cert}")
    now = dt.datetime.now(dt.UTC)
    unique: list[x509.GeneralName] = []
    for _, general in sans:
        if general not in unique:
            unique.append(general)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(authority.subject)
        .public_key(public)  # checked by _csr_key_ok
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
        .add_extension(x509.SubjectAlternativeName(unique), critical=False)
        .sign(signer, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)
