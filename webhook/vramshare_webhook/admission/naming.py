"""Names: the reservation a pod's booking gets, and whether the pod's own name is taken."""

from __future__ import annotations

import secrets
from typing import Any

from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.decision import NameTaken


def reservation_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata", {})
    base = str(meta.get("name") or meta.get("generateName") or "pod").rstrip("-")[:52].rstrip("-.")
    return f"{base}-{secrets.token_hex(4)}"


async def name_taken(intent: Intent, *, ctx: Context) -> NameTaken | None:
    """Step 4: a pod of that name exists already. The create will fail with AlreadyExists: a booking
    for it would only hold memory until the TTL ends it, and a loop of such creates could keep every
    large GPU booked."""
    request = intent.request
    if request.name and await ctx.ledger.pod_exists(request.namespace, request.name):
        return NameTaken(
            message=f'pods "{request.name}" already exists in namespace {request.namespace}; vramshare '
            "books nothing for a pod that cannot be created"
        )
    return None
