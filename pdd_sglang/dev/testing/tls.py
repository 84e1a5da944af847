"""Certificates for tests: a throw-away CA, and server and client certificates it signs
(``cryptography``), written as PEM files; nothing here is fit for a deployment."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    certfile: str
    keyfile: str


@dataclass(frozen=True)
class Pki:
    ca_file: str
    server: Pair  # for 127.0.0.1 and localhost
    client: Pair


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> Pair:
    certfile, keyfile = directory / f"{stem}.crt", directory / f"{stem}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return Pair(str(certfile), str(keyfile))


def _signed(subject: str, key, issuer: x509.Name, issuer_key, usage, san=None, ca=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pdd test CA")
    ca = _signed("pdd test CA", ca_key, ca_name, ca_key, None, ca=True)
    ca_pair = _write(directory, "ca", ca, ca_key)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _signed("127.0.0.1", server_key, ca_name, ca_key, ExtendedKeyUsageOID.SERVER_AUTH,
                     san)
    client = _signed("pdd router", client_key, ca_name, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca_pair.certfile, _write(directory, "server", server, server_key),
                   _write(directory, "client", client, client_key))
