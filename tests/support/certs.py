"""Throwaway certificates for the mTLS tests: a CA and leaf certificates it signs (EC P-256,
valid for a day), written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> dict[str, Path]:
    paths = {"cert": folder / f"{stem}.crt", "key": folder / f"{stem}.key"}
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


class Authority:
    def __init__(self, folder: Path, name: str = "rekv test CA"):
        self.folder, self.key = folder, ec.generate_private_key(ec.SECP256R1())
        self.cert = (_builder(name, _name(name), self.key.public_key())
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))
        self.ca = _write(folder, name.replace(" ", "-"), self.cert, self.key)["cert"]

    def issue(self, stem: str, dns_names: list[str]) -> dict[str, Path]:
        """A certificate for server and client use, valid for `dns_names` and 127.0.0.1."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(n) for n in dns_names] + [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (_builder(stem, self.cert.subject, key.public_key())
                .add_extension(x509.SubjectAlternativeName(names), False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), False)
                .sign(self.key, hashes.SHA256()))
        return _write(self.folder, stem, cert, key)
