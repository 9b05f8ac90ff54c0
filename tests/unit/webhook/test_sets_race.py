"""Two pods with several GPUs decided at once in one webhook process, against the real commit protocol
(KubeLedger over the fake API server): the second decision must count the first set, although its
commits have not started yet, or both would ride the same token chain onto the same GPUs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest_asyncio

from tests.unit.domain.builders import NOW, gpu
from tests.unit.fake_kube import FakeKube, add_idle_gpu
from tests.unit.webhook.fakes import request
from vramshare.domain import Accounting
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.resources import reservations_path
from vramshare_webhook.admission import Admitter
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.settings import WebhookSettings

GPUS = [gpu("GPU-a", index=0, total=16_384), gpu("GPU-b", index=1, total=16_384)]


@pytest_asyncio.fixture(loop_scope="function")
async def ledger() -> AsyncIterator[tuple[FakeKube, KubeLedger]]:
    kube = FakeKube()
    for g in GPUS:
        await add_idle_gpu(kube, g)
    await kube.create("/api/v1/namespaces", {"metadata": {"name": "airflow"}})
    running = KubeLedger(kube)  # type: ignore[arg-type]
    task = asyncio.create_task(running.run())
    await asyncio.wait_for(running.devices.synced.wait(), 2)
    await asyncio.wait_for(running.reservations.synced.wait(), 2)
    yield kube, running
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_sets_decided_at_once_in_one_process_never_share_gpus(
    ledger: tuple[FakeKube, KubeLedger],
) -> None:
    kube, kube_ledger = ledger
    admitter = Admitter(
        settings=WebhookSettings(accounting=Accounting(safety_margin_mib=0, max_sample_age_s=1e12)),
        ledger=kube_ledger,
        metrics=WebhookMetrics(),
        clock=lambda: NOW,
    )
    # Each GPU has room for one 10000 MiB booking: one set of two fits, not two.
    answers = await asyncio.gather(
        *(admitter.review(request("10000", uid=f"u{i}", annotations={"gpu-count": "2"})) for i in range(2))
    )
    assert sorted(a["response"]["allowed"] for a in answers) == [False, True]
    await asyncio.sleep(0.1)
    booked = [o for p, o in kube.objects.items() if p.startswith(reservations_path("airflow") + "/")]
    per_gpu = sorted(o["spec"]["gpuUUID"] for o in booked)
    assert per_gpu == ["GPU-a", "GPU-b"]
