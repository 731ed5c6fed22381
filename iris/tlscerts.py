"""Certificates for mutual TLS to Temporal's frontend (docs/DESIGN.md, "Where secrets live").

``ensure_tls(root, server_names)`` creates, once, a private CA and from it a server certificate
for Temporal and a client certificate for the worker and the CLI, each in its own directory so
each service mounts only its own:

- ``root/ca/``: ``ca.pem``, ``ca.key`` (the CA's key: only the keys service holds it);
- ``root/server/``: ``ca.pem``, ``server.pem``, ``server.key`` (Temporal; its certificate also
  serves as its client certificate between its own services);
- ``root/<client>/``: ``ca.pem``, ``<client>.pem``, ``<client>.key`` for each client name (e.g.
  ``client`` for the worker and the CLI, ``ui`` for the Web UI, ``admin`` for the admin tools).

Private keys are written 0600 and never overwritten; existing files are kept.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=825)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    usages: list[x509.ObjectIdentifier],
    names: list[str],
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def ensure_tls(root: Path, server_names: list[str], clients: tuple[str, ...] = ("client",)) -> list[str]:
    """Create what is missing under ``root`` (see the module doc); returns the files created.

    One client directory per name in ``clients`` (``root/<name>/<name>.pem``), so services that run
    as different users each mount their own."""
    created: list[str] = []
    ca_dir, server_dir = root / "ca", root / "server"
    for d in (ca_dir, server_dir, *(root / c for c in clients)):
        d.mkdir(parents=True, exist_ok=True)
    ca_key_path, ca_pem_path = ca_dir / "ca.key", ca_dir / "ca.pem"
    if not ca_key_path.exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("iris-federation-ca"))
            .issuer_name(_name("iris-federation-ca"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(ca_key_path, ca_key)
        ca_pem_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        created += [str(ca_key_path), str(ca_pem_path)]
    loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_key_path} is not an EC private key")
    ca_key = loaded
    ca_cert = x509.load_pem_x509_certificate(ca_pem_path.read_bytes())
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    leaves = [
        (
            server_dir,
            "server",
            server_names[0],
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            server_names,
        ),
        *((root / c, c, f"iris-{c}", [ExtendedKeyUsageOID.CLIENT_AUTH], []) for c in clients),
    ]
    for directory, stem, common_name, usages, names in leaves:
        (directory / "ca.pem").write_bytes(ca_pem)
        key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.pem"
        if key_path.exists():
            continue
        key, cert = _issue(ca_key, ca_cert, common_name, usages, names)
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        created += [str(key_path), str(cert_path)]
    return created
