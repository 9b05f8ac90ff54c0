"""Queue positions cost a bounded number of writes per placement (issue #31): only the first
`queue_positions_shown` entries have their place written; the others say how far back they are,
which a placement does not change."""

from __future__ import annotations

from typing import Any

from tests.unit.fake_kube import FakeKube, fed_state
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.queue import QueueLoop
from vramshare.controller.settings import ControllerSettings
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import reservations_path

WAITING = 40


def loop(kube: FakeKube, state: Any, *, shown: int) -> QueueLoop:
    return QueueLoop(
        kube=kube,  # type: ignore[arg-type]
        ledger=KubeLedger(kube),  # type: ignore[arg-type]
        state=state,
        settings=ControllerSettings(identity="l1", queue_positions_shown=shown),
        metrics=ControllerMetrics(),
    )


async def queue_of(kube: FakeKube, names: list[str]) -> dict[str, tuple[GpuReservation, dict[str, Any]]]:
    """The entries as the API server holds them now, each with a pod of its own."""
    out = {}
    for name in names:
        entry = GpuReservation.from_wire(await kube.get(reservations_path("jobs", name)))
        pod = {"metadata": {"name": name, "namespace": "jobs", "uid": f"uid-{name}"}}
        out[entry.key] = (entry, pod)
    return out


async def waiting(kube: FakeKube) -> list[str]:
    """WAITING queue entries, each as the webhook creates it; their names, in queue order."""
    names = [f"task-{i:02d}" for i in range(WAITING)]
    for name in names:
        entry = GpuReservation.queued(name=name, namespace="jobs", pod=name, mib=4096, admission_uid="u")
        await kube.create(reservations_path("jobs"), entry.to_wire())
    return names


def status_writes(kube: FakeKube) -> int:
    return sum(1 for op, path in kube.calls if op == "merge_patch" and path.endswith("/status"))


async def test_a_placement_rewrites_at_most_the_shown_positions_however_long_the_queue() -> None:
    kube = FakeKube()
    names = await waiting(kube)
    async with fed_state(kube) as state:
        queue = loop(kube, state, shown=10)
        queued = await queue_of(kube, names)
        await queue._write_positions(queued, {f"jobs/{n}": i + 1 for i, n in enumerate(names)}, now=0.0)
        assert status_writes(kube) == WAITING  # each entry once, as it joins the queue
        first = {key: r.status for key, (r, _) in (await queue_of(kube, names)).items()}
        assert [first[f"jobs/{n}"].queue_position for n in names[:12]] == [*range(1, 11), None, None]
        assert first["jobs/task-39"].message == (
            "waits for 4096 MiB of GPU memory: more than 10 pods are ahead of it in the queue"
        )
        assert first["jobs/task-00"].message == "waits for 4096 MiB of GPU memory: position 1 in the queue"
        joined = [e for e in kube.objects if "/events/" in e]
        assert len(joined) == WAITING  # every pod was told once that it waits

        # The head is placed: everyone moves up one place.
        before = status_writes(kube)
        rest = names[1:]
        await queue._write_positions(
            await queue_of(kube, rest), {f"jobs/{n}": i + 1 for i, n in enumerate(rest)}, now=1.0
        )
        assert status_writes(kube) - before == 10  # the new first ten; 29 entries further back unchanged
        assert len([e for e in kube.objects if "/events/" in e]) == WAITING  # nobody told twice
        after = {key: r.status for key, (r, _) in (await queue_of(kube, rest)).items()}
        assert after["jobs/task-10"].queue_position == 10  # it moved into the first ten
        assert after["jobs/task-11"].queue_position is None


async def test_with_every_position_shown_a_placement_rewrites_the_whole_queue() -> None:
    """The same placement with the limit above the queue's length: what the limit saves."""
    kube = FakeKube()
    names = await waiting(kube)
    async with fed_state(kube) as state:
        queue = loop(kube, state, shown=WAITING)
        await queue._write_positions(
            await queue_of(kube, names), {f"jobs/{n}": i + 1 for i, n in enumerate(names)}, now=0.0
        )
        before = status_writes(kube)
        rest = names[1:]
        await queue._write_positions(
            await queue_of(kube, rest), {f"jobs/{n}": i + 1 for i, n in enumerate(rest)}, now=1.0
        )
        assert status_writes(kube) - before == WAITING - 1


async def test_with_no_queue_a_wake_plans_nothing_and_an_entry_wakes_it_itself() -> None:
    """Every pod and booking event of the cluster woke a pass; with no queue a pass has nothing to do
    (issue #45). A queue entry coming, or going, wakes the pass on its own."""
    kube = FakeKube()
    async with fed_state(kube) as state:
        queue = loop(kube, state, shown=10)
        queue.wake()
        assert not queue._wake.is_set()
        entry = GpuReservation.queued(name="task", namespace="jobs", pod="task", mib=4096, admission_uid="u")
        await kube.create(reservations_path("jobs"), entry.to_wire())
        assert await state.reservations.wait_for(kube.version, timeout_s=2)
        assert queue._wake.is_set()
        queue._wake.clear()
        queue.wake()
        assert queue._wake.is_set()
        queue._wake.clear()
        await kube.delete(reservations_path("jobs", "task"))
        assert await state.reservations.wait_for(kube.version, timeout_s=2)
        assert queue._wake.is_set()
