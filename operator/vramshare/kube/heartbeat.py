"""The inventory heartbeat on the controller's Lease (see `vramshare.domain.freshness`).

The leader renews its Lease every retry period anyway; the heartbeat rides on that renewal as the
annotation `vramshare.io/inventory-heartbeat`, so it costs no write of its own. Readers (the webhook,
the controller's queue, `vramshare status`) follow the one Lease with a watch filtered to its name.

This module is only the annotation's format (the `vramshare status` plugin reads it, without
structlog); `vramshare.kube.lease_watch` follows the Lease.

The annotation is JSON: `{"sampledAt": RFC 3339, "devicesVersion": "<resourceVersion>",
"unconfirmed": [GPU UUIDs]}`. Anyone with write access to the Lease could edit it; a value that does
not parse is ignored (with a warning), and stored sample times apply, as without a heartbeat.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.kube.resources import format_time_precise, parse_time

ANNOTATION_HEARTBEAT = "vramshare.io/inventory-heartbeat"
DEFAULT_CONTROLLER_LEASE = "vramshare-controller"


def encode(heartbeat: InventoryHeartbeat) -> str:
    return json.dumps(
        {
            "sampledAt": format_time_precise(heartbeat.sampled_at),
            "devicesVersion": str(heartbeat.devices_version),
            "unconfirmed": sorted(heartbeat.unconfirmed),
        },
        separators=(",", ":"),
    )


def decode(raw: str) -> InventoryHeartbeat:
    """The heartbeat in an annotation's value; ValueError naming what is wrong."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    version = data.get("devicesVersion")
    if not isinstance(version, str) or not version.isdigit():
        raise ValueError(f"devicesVersion {version!r}: expected a resourceVersion (digits)")
    unconfirmed = data.get("unconfirmed", [])
    if not isinstance(unconfirmed, list) or not all(isinstance(u, str) for u in unconfirmed):
        raise ValueError("unconfirmed: expected a list of GPU UUIDs")
    raw_time = data.get("sampledAt")
    try:
        sampled_at = parse_time(raw_time) if isinstance(raw_time, str) else None
    except ValueError:
        sampled_at = None
    if sampled_at is None:
        raise ValueError(f"sampledAt {raw_time!r}: expected an RFC 3339 time")
    return InventoryHeartbeat(
        sampled_at=sampled_at, devices_version=int(version), unconfirmed=frozenset(unconfirmed)
    )


def lease_heartbeat(
    lease: dict[str, Any], *, on_invalid: Callable[[str, str], None] = lambda value, error: None
) -> InventoryHeartbeat | None:
    """The heartbeat a Lease carries, if any and valid; `on_invalid(value, why)` hears of one that is
    not (it is then ignored, and stored sample times apply)."""
    raw = ((lease.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_HEARTBEAT)
    if not raw:
        return None
    try:
        return decode(raw)
    except ValueError as exc:
        on_invalid(raw[:200], str(exc))
        return None


def parse_lease_ref(value: str) -> tuple[str, str]:
    """`namespace/name` of the controller's Lease; ValueError naming what is accepted."""
    namespace, slash, name = value.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise ValueError(f"{value!r}: expected <namespace>/<name> of the controller's Lease")
    return namespace, name
