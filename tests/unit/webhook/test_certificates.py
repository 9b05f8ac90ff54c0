"""Self-managed certificates: generation, renewal decisions, CA reuse."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from vramshare_webhook import certificates

NOW = dt.datetime(2027, 1, 15, 8, 0, tzinfo=dt.UTC)
NAMES = ("vramshare-webhook.vramshare.svc", "127.0.0.1")


def test_generated_bundle_is_valid_for_its_names_until_it_expires() -> None:
    bundle = certificates.generate(names=NAMES, now=NOW, serving_validity=dt.timedelta(days=30))
    assert certificates.needs_renewal(bundle, names=NAMES, at=NOW) is None
    assert certificates.needs_renewal(bundle, names=NAMES, at=NOW + dt.timedelta(days=29)) is None
    expired = certificates.needs_renewal(bundle, names=NAMES, at=NOW + dt.timedelta(days=31))
    assert expired is not None
    assert expired.startswith("certificate expires at")
    assert (
        certificates.needs_renewal(bundle, names=("other.svc",), at=NOW)
        == "certificate does not cover other.svc"
    )
    assert certificates.needs_renewal(None, names=NAMES, at=NOW) == "no certificate yet"


def test_renewal_keeps_the_ca_so_the_ca_bundle_stays_valid() -> None:
    first = certificates.generate(names=NAMES, now=NOW)
    second = certificates.generate(names=NAMES, now=NOW, keep_ca=first)
    assert second.ca_cert == first.ca_cert
    assert certificates.serial(second.cert) != certificates.serial(first.cert)
    assert certificates.needs_renewal(second, names=NAMES, at=NOW) is None


def test_mismatched_key_or_foreign_ca_is_refused() -> None:
    a = certificates.generate(names=NAMES, now=NOW)
    b = certificates.generate(names=NAMES, now=NOW)
    mixed_key = certificates.Bundle(ca_cert=a.ca_cert, ca_key=a.ca_key, cert=a.cert, key=b.key)
    assert certificates.needs_renewal(mixed_key, names=NAMES, at=NOW) == "certificate and key do not match"
    foreign = certificates.Bundle(ca_cert=b.ca_cert, ca_key=b.ca_key, cert=a.cert, key=a.key)
    assert certificates.needs_renewal(foreign, names=NAMES, at=NOW) is not None


def test_bundle_loads_into_a_tls_server_context(tmp_path: Path) -> None:
    bundle = certificates.generate(names=NAMES, now=dt.datetime.now(dt.UTC))
    (tmp_path / "tls.crt").write_bytes(bundle.cert)
    (tmp_path / "tls.key").write_bytes(bundle.key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    data = bundle.to_secret_data()
    assert certificates.Bundle.from_secret_data(data) == bundle
    assert certificates.Bundle.from_secret_data({"tls.crt": b"x"}) is None


def test_ca_usable_judges_the_ca_alone() -> None:
    bundle = certificates.generate(names=NAMES, now=NOW, serving_validity=dt.timedelta(days=1))
    # The serving certificate is long expired by then, but the CA can still sign.
    assert certificates.ca_usable(bundle, at=NOW + dt.timedelta(days=100))
    assert not certificates.ca_usable(bundle, at=NOW + dt.timedelta(days=3651))
    assert not certificates.ca_usable(None, at=NOW)
    other = certificates.generate(names=NAMES, now=NOW)
    assert not certificates.ca_usable(
        certificates.Bundle(ca_cert=bundle.ca_cert, ca_key=other.ca_key, cert=bundle.cert, key=bundle.key),
        at=NOW,
    )


def test_a_new_ca_is_published_next_to_the_old_one_until_it_expires() -> None:
    first = certificates.generate(names=NAMES, now=NOW, ca_validity=dt.timedelta(days=100))
    assert first.ca_bundle == first.ca_cert
    # The CA would not outlive the next serving certificate: a new one, trusted next to the old.
    later = NOW + dt.timedelta(days=60)
    assert not certificates.ca_usable(first, at=later + dt.timedelta(days=60))
    second = certificates.generate(
        names=NAMES, now=later, serving_validity=dt.timedelta(days=30), previous=first
    )
    assert second.ca_cert != first.ca_cert
    assert second.ca_bundle == second.ca_cert + first.ca_cert
    assert certificates.signed_by(second.cert, second.ca_cert)
    assert not certificates.signed_by(first.cert, second.ca_cert)  # old replicas: trusted via the old CA
    # Round trip through the Secret keeps the bundle; once the old CA expired it is dropped.
    stored = certificates.Bundle.from_secret_data(second.to_secret_data())
    assert stored == second
    third = certificates.generate(
        names=NAMES, now=NOW + dt.timedelta(days=101), keep_ca=second, previous=second
    )
    assert third.ca_bundle == second.ca_cert
