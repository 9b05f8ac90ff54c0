"""Certificates for the local control plane, made with `cryptography`.

One CA signs the API server's serving certificate, the client certificates (CN = user, O = groups, as
the API server's client-certificate authenticator reads them) and webhook serving certificates. The
service-account signing key is a separate RSA key pair.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from vramshare_webhook.certificates import new_ca

_VALIDITY = dt.timedelta(days=7)


@dataclass(frozen=True, kw_only=True)
class CertPair:
    cert_path: Path
    key_path: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


class CertificateAuthority:
    """A throwaway CA stored as `<dir>/ca.crt` and `<dir>/ca.key`."""

    def __init__(self, directory: Path, *, name: str = "vramshare-e2e-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.cert, self._key = new_ca(common_name=name, now=dt.datetime.now(dt.UTC), validity=_VALIDITY)
        self.cert_path = directory / "ca.crt"
        self.cert_path.write_bytes(self.cert_pem)
        _write_key(directory / "ca.key", self._key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: tuple[str, ...] = (),
        server_names: tuple[str, ...] = (),
        server_ips: tuple[str, ...] = (),
        client: bool = False,
        validity: dt.timedelta = _VALIDITY,
    ) -> CertPair:
        """Sign a leaf certificate; with `server_names`/`server_ips` it serves TLS, with `client` it
        authenticates to the API server."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        usages = []
        if server_names or server_ips:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = CertPair(cert_path=self.directory / f"{name}.crt", key_path=self.directory / f"{name}.key")
        pair.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pair.key_path, key)
        return pair


def service_account_keys(directory: Path) -> CertPair:
    """The RSA key pair the API server signs and verifies service-account tokens with."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pair = CertPair(cert_path=directory / "sa.pub", key_path=directory / "sa.key")
    pair.cert_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    _write_key(pair.key_path, key)
    return pair
