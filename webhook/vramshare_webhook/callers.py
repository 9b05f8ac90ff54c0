"""Who may ask for an admission decision: the API server, known by its client certificate.

A decision has side effects (a booking, a hold, a queue entry), so a review must come from the API
server. It presents a client certificate when its AdmissionConfiguration names one for webhooks; the
TLS layer verifies it against `client_ca_file` (optional at the handshake, so the kubelet's probes
and Prometheus still reach /healthz, /readyz and /metrics without one), and /mutate then checks it is
there and names an accepted caller. Pure: it reads the peer certificate as Python's ssl module gives it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def names_of(peercert: dict[str, Any]) -> set[str]:
    """The common names and DNS names of a verified peer certificate (`SSLObject.getpeercert()`)."""
    names = {
        value
        for rdn in peercert.get("subject", ())
        for key, value in rdn
        if key == "commonName" and isinstance(value, str)
    }
    names |= {value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"}
    return names


def caller_problem(peercert: dict[str, Any] | None, *, accepted: Iterable[str]) -> str | None:
    """Why this caller may not have a decision; None when it may. `peercert` is what the TLS layer
    verified (None or empty: the caller presented no certificate)."""
    if not peercert:
        return (
            "vramshare answers admission reviews only from the API server: present the client "
            "certificate its AdmissionConfiguration names for webhooks"
        )
    allowed = set(accepted)
    if allowed and not names_of(peercert) & allowed:
        shown = ", ".join(sorted(names_of(peercert))) or "no name"
        return f"client certificate for {shown} is not one vramshare accepts (client_names)"
    return None
