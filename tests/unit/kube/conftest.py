"""Fixtures of the ledger's unit tests: a KubeLedger fed from the fake API server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.unit.domain.builders import NOW
from tests.unit.fake_kube import FakeKube
from tests.unit.kube.ledger_harness import cluster, fed, streams_of
from vramshare.domain import Accounting, has_room_for_its_bookings
from vramshare.kube.ledger import KubeLedger


@pytest_asyncio.fixture(
    loop_scope="function",  # the test's own loop, so the watch runs during it
    params=["own streams", "following the controller's streams"],
)
async def running(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeKube, KubeLedger]]:
    """A ledger whose watch caches are fed from the fake API server: by streams of its own (the
    webhook's), or following the streams the controller's state keeps (its queue's ledger)."""
    kube = await cluster()
    if request.param == "own streams":
        async with fed(KubeLedger(kube)) as ledger:  # type: ignore[arg-type]
            yield kube, ledger
    else:
        streams = streams_of(kube)
        following = KubeLedger(kube, follow=streams)  # type: ignore[arg-type]
        async with fed(following, streams.devices, streams.reservations) as ledger:
            yield kube, ledger


@pytest_asyncio.fixture(loop_scope="function")
async def rebasing() -> AsyncIterator[tuple[FakeKube, KubeLedger, list[str]]]:
    """As `running`, with the webhook's room check (no safety margin: the GPU holds 16384 MiB of
    bookings); the list records each commit that stood on a newer token."""
    kube = await cluster()
    rebases: list[str] = []
    ledger = KubeLedger(
        kube,  # type: ignore[arg-type]
        has_room=lambda g, index: has_room_for_its_bookings(
            g, index, accounting=Accounting(safety_margin_mib=0), now=NOW
        ),
        on_rebase=lambda: rebases.append("rebased"),
    )
    async with fed(ledger):
        yield kube, ledger, rebases
