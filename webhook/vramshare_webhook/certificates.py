"""Certificates for the self-managed TLS mode: a CA and a serving certificate, made and judged here.

Pure functions of their inputs (`now` is passed in), in the shape of controller-runtime's
cert-controller: `generate()` makes a bundle, `needs_renewal()` says whether a bundle will still be
good `lookahead` from now for the names the webhook serves.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALIDITY = dt.timedelta(days=3650)
SERVING_VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """PEM bytes as stored in the Secret (`ca.crt`, `ca.key`, `tls.crt`, `tls.key`, `ca-bundle.crt`)."""

    ca_cert: bytes
    ca_key: bytes
    cert: bytes
    key: bytes
    trusted: bytes = b""
    """Every CA clients must trust now: the current one, and after a CA rotation the previous one
    until it expires, since replicas still serving its certificates are only told at their next sync."""

    @property
    def ca_bundle(self) -> bytes:
        """What the webhook configuration's caBundle must hold."""
        return self.trusted or self.ca_cert

    def to_secret_data(self) -> dict[str, bytes]:
        return {
            "ca.crt": self.ca_cert,
            "ca.key": self.ca_key,
            "tls.crt": self.cert,
            "tls.key": self.key,
            "ca-bundle.crt": self.ca_bundle,
        }

    @classmethod
    def from_secret_data(cls, data: dict[str, bytes]) -> Bundle | None:
        try:
            ca_cert, ca_key = data["ca.crt"], data["ca.key"]
            return cls(
                ca_cert=ca_cert,
                ca_key=ca_key,
                cert=data["tls.crt"],
                key=data["tls.key"],
                trusted=data.get("ca-bundle.crt", b""),
            )
        except KeyError:
            return None


def _still_valid(pem_bundle: bytes, *, at: dt.datetime) -> list[bytes]:
    """The certificates in a PEM bundle that are valid at `at`, each as PEM."""
    try:
        certs = x509.load_pem_x509_certificates(pem_bundle) if pem_bundle.strip() else []
    except ValueError:
        return []
    return [
        c.public_bytes(serialization.Encoding.PEM)
        for c in certs
        if c.not_valid_before_utc <= at < c.not_valid_after_utc
    ]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _sans(names: tuple[str, ...]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    return sans


def _serving(
    *,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    names: tuple[str, ...],
    now: dt.datetime,
    validity: dt.timedelta,
) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def new_ca(
    *, common_name: str, now: dt.datetime, validity: dt.timedelta
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA that signs leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def generate(
    *,
    names: tuple[str, ...],
    now: dt.datetime,
    serving_validity: dt.timedelta = SERVING_VALIDITY,
    ca_validity: dt.timedelta = CA_VALIDITY,
    keep_ca: Bundle | None = None,
    previous: Bundle | None = None,
) -> Bundle:
    """A serving certificate for `names` (DNS names or IPs), signed by `keep_ca`'s CA or a new one. The
    CAs `previous` trusted that are still valid stay trusted next to it (the overlap of a CA rotation)."""
    if keep_ca is not None:
        ca_cert = x509.load_pem_x509_certificate(keep_ca.ca_cert)
        loaded = serialization.load_pem_private_key(keep_ca.ca_key, password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key in the Secret is not an EC key")
        ca_key = loaded
    else:
        ca_cert, ca_key = new_ca(common_name="vramshare-webhook-ca", now=now, validity=ca_validity)
    cert, key = _serving(ca_cert=ca_cert, ca_key=ca_key, names=names, now=now, validity=serving_validity)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    older = _still_valid(previous.ca_bundle, at=now) if previous is not None else []
    return Bundle(
        ca_cert=ca_pem,
        ca_key=_pem_key(ca_key),
        cert=cert,
        key=key,
        trusted=b"".join([ca_pem, *(c for c in older if c != ca_pem)]),
    )


def signed_by(cert_pem: bytes, ca_pem: bytes) -> bool:
    """Whether the certificate was issued by that CA (its signature verifies)."""
    try:
        x509.load_pem_x509_certificate(cert_pem).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_pem)
        )
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def needs_renewal(bundle: Bundle | None, *, names: tuple[str, ...], at: dt.datetime) -> str | None:
    """Why `bundle` cannot serve `names` at time `at` (pass now + lookahead), or None when it can."""
    if bundle is None:
        return "no certificate yet"
    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_cert)
        cert = x509.load_pem_x509_certificate(bundle.cert)
        key = serialization.load_pem_private_key(bundle.key, password=None)
    except ValueError as exc:
        return f"unreadable: {exc}"
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        return "certificate and key do not match"
    if cert.issuer != ca.subject:
        return "certificate not issued by the CA"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "certificate signature does not verify against the CA"
    for which, c in (("CA", ca), ("certificate", cert)):
        if c.not_valid_after_utc <= at:
            return f"{which} expires at {c.not_valid_after_utc.isoformat()}"
        if c.not_valid_before_utc > at:
            return f"{which} not valid before {c.not_valid_before_utc.isoformat()}"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "certificate has no subject alternative names"
    covered = {str(v) for v in san.get_values_for_type(x509.DNSName)}
    covered |= {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    missing = [n for n in names if n not in covered]
    if missing:
        return f"certificate does not cover {', '.join(missing)}"
    return None


def ca_usable(bundle: Bundle | None, *, at: dt.datetime) -> bool:
    """True when the bundle's CA can still sign: readable, with its key, valid at `at`."""
    if bundle is None:
        return False
    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_cert)
        key = serialization.load_pem_private_key(bundle.ca_key, password=None)
    except ValueError:
        return False
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return (
        isinstance(key, ec.EllipticCurvePrivateKey)
        and ca.public_key().public_bytes(der, spki) == key.public_key().public_bytes(der, spki)
        and ca.not_valid_before_utc <= at < ca.not_valid_after_utc
    )


def serial(cert_pem: bytes) -> int:
    return x509.load_pem_x509_certificate(cert_pem).serial_number
