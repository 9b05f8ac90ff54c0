"""Names: the reservation a pod's booking gets, and whether the pod's own name is taken."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.decision import NameTaken


def reservation_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata", {})
    base = str(meta.get("name") or meta.get("generateName") or "pod").rstrip("-")[:52].rstrip("-.")
    return f"{base}-{secrets.token_hex(4)}"


class NameTakenError(Exception):
    """Raised into a commit whose pod's name is taken: the commit creates nothing."""

    def __init__(self, decision: NameTaken) -> None:
        super().__init__(decision.message)
        self.decision = decision


class NameCheck:
    """Step 4, whether a pod of that name exists already. The create would fail with AlreadyExists: a
    booking for it would only hold memory until the TTL ends it, and a loop of such creates could keep
    every large GPU booked.

    It is a look-up (a GET from the API server's cache), started before the pod is placed and awaited
    only where it must be: before anything is written (the booking's create, a queue entry) and before
    any other answer, so a taken name is still answered as taken and books nothing. Meanwhile the pod
    is placed and its commit waits for its GPU's earlier group (issue #45: the look-up was 15 ms of a
    177 ms answer at concurrency 16, in series with the rest)."""

    def __init__(self, intent: Intent, *, ctx: Context) -> None:
        request = intent.request
        self._task: asyncio.Task[NameTaken | None] | None = None
        if request.name:
            self._task = asyncio.ensure_future(_look_up(request.namespace, request.name, ctx=ctx))

    async def taken(self) -> NameTaken | None:
        """The answer for a taken name, or None when the name is free."""
        return await self._task if self._task is not None else None

    async def must_be_free(self) -> None:
        """Return when the name is free; raise NameTakenError when it is taken."""
        taken = await self.taken()
        if taken is not None:
            raise NameTakenError(taken)

    async def close(self) -> None:
        """Stop a look-up nobody will wait for (the admission ended another way, or was cancelled)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def _look_up(namespace: str, name: str, *, ctx: Context) -> NameTaken | None:
    if await ctx.ledger.pod_exists(namespace, name):
        return NameTaken(
            message=f'pods "{name}" already exists in namespace {namespace}; vramshare '
            "books nothing for a pod that cannot be created"
        )
    return None
