"""A replica's grants on the ledger (`vramshare.kube.ledger.grants`): taken under a pod's bump, pods
booked inside with a create alone, the holder's clock, renewals, giving back, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.unit.fake_kube import FakeKube
from tests.unit.kube.ledger_harness import DEVICE, GPU, booking, cluster, commit_elsewhere, fed, settle
from vramshare.domain import ReservationPhase
from vramshare.domain.grants import GrantTerms
from vramshare.domain.snapshot import CommitConflictError
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.ledger.grants import Grants
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import (
    ANNOTATION_GRANT_RENEWED,
    ANNOTATION_LEDGER,
    LABEL_GRANTED_TO,
    reservations_path,
)

TERMS = GrantTerms(pods=3, lasts_s=15, margin_s=2, idle_s=10)
ROOM = 16_384


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture(loop_scope="function")
async def granting() -> AsyncIterator[tuple[FakeKube, KubeLedger, Clock]]:
    kube = await cluster()
    clock = Clock()
    ledger = KubeLedger(kube, clock=clock)  # type: ignore[arg-type]
    ledger.grants = Grants(
        kube,  # type: ignore[arg-type]
        terms=TERMS,
        namespace="vramshare",
        holder="webhook-0",
        index=lambda: ledger.index,
        clock=clock,
    )
    async with fed(ledger):
        yield kube, ledger, clock
        ledger.grants._keeper and ledger.grants._keeper.cancel()


async def record(kube: FakeKube, grant: GpuReservation, phase: str, *, reason: str | None = None) -> None:
    """The controller's part: it writes the grant's phase (Granted when it records it, Expired when it
    ends it), and the replica's watch takes it in."""
    status = {"phase": phase, **({"reason": reason} if reason else {})}
    await kube.merge_patch(reservations_path(grant.namespace, grant.name) + "/status", {"status": status})
    await settle()


def bumps(kube: FakeKube) -> int:
    return sum(op == "merge_patch" and path == DEVICE for op, path in kube.calls)


def grants_in(kube: FakeKube) -> list[dict[str, Any]]:
    prefix = reservations_path("vramshare") + "/"
    return [o for p, o in kube.objects.items() if p.startswith(prefix)]


async def take_one(
    kube: FakeKube, ledger: KubeLedger, *, mib: int = 1024, recorded: bool = True
) -> GpuReservation:
    """A first pod on the GPU, which takes a grant with it; returns the grant as committed. With
    `recorded`, the controller's part: it records the grant Granted."""
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await ledger.commit(reservation=booking("first", mib), token=token, live=True, grant_room_mib=ROOM - mib)
    await settle()
    assert ledger.grants is not None
    [held] = ledger.grants.held()
    if recorded:
        await record(kube, held.reservation, "Granted")
    return held.reservation


async def test_a_grant_is_taken_under_the_bump_of_the_pod_it_comes_with(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, _ = granting
    grant = await take_one(kube, ledger, recorded=False)
    assert bumps(kube) == 1
    [stored] = grants_in(kube)
    assert stored["metadata"]["labels"][LABEL_GRANTED_TO]
    assert stored["spec"]["memoryMiB"] == 3 * 1024  # three more such pods (a quarter of the room left: 3840)
    assert grant.phase is ReservationPhase.GRANTED
    # The bump names the newer of the two creates, so a view that waits for it holds both.
    versions = [
        int(stored["metadata"]["resourceVersion"]),
        int(kube.objects[reservations_path("jobs", "first")]["metadata"]["resourceVersion"]),
    ]
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER].endswith(f"@{max(versions)}")


async def test_pods_the_grant_takes_are_booked_inside_it_with_a_create_alone(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, _ = granting
    grant = await take_one(kube, ledger)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    before = ledger.index.booked(GPU, settle_s=30)
    made = [
        await ledger.commit(reservation=booking(f"in{i}", 1024), token=token, live=True, grant_room_mib=0)
        for i in range(3)
    ]
    assert bumps(kube) == 1  # none of them moved the token
    assert {m.spec.grant for m in made} == {grant.key}
    assert ledger.index.booked(GPU, settle_s=30) == before  # the remainder gave up what they took
    assert ledger.index.grant_remainder(grant.key, GPU.uuid) == 0
    # The fifth does not fit the remainder: an ordinary commit, with a bump, and a grant of its own.
    outside = await ledger.commit(
        reservation=booking("out", 1024), token=token, live=True, grant_room_mib=4096
    )
    assert outside.spec.grant == ""
    assert bumps(kube) == 2


async def test_a_grant_past_its_usable_time_takes_no_booking(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, clock = granting
    await take_one(kube, ledger)
    clock.now += TERMS.usable_for_s  # no renewal since it was taken
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    made = await ledger.commit(reservation=booking("late", 1024), token=token, live=True)
    assert made.spec.grant == ""
    assert bumps(kube) == 2


async def test_a_create_that_came_back_after_the_grant_stopped_being_usable_is_withdrawn(
    granting: tuple[FakeKube, KubeLedger, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server may have stored it after the controller ended the grant: it must not stand."""
    kube, ledger, clock = granting
    await take_one(kube, ledger)
    create = kube.create

    async def slow_create(path: str, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
        clock.now += TERMS.usable_for_s
        return await create(path, obj, **kw)

    monkeypatch.setattr(kube, "create", slow_create)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking("slow", 1024), token=token, live=True)
    assert reservations_path("jobs", "slow") not in kube.objects
    assert ledger.index.get("jobs/slow") is None


async def test_renewals_keep_a_grant_usable_and_one_the_controller_ended_is_dropped(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, clock = granting
    grant = await take_one(kube, ledger)
    assert ledger.grants is not None
    [held] = ledger.grants.held()
    clock.now += 10
    await ledger.grants._renew(held)
    stored = kube.objects[reservations_path("vramshare", grant.name)]
    assert stored["metadata"]["annotations"][ANNOTATION_GRANT_RENEWED] == "1"
    assert held.usable_until == clock.now + TERMS.usable_for_s
    # The controller ended it (it saw no renewal in time): the next renewal drops it.
    await kube.merge_patch(
        reservations_path("vramshare", grant.name) + "/status",
        {"status": {"phase": "Expired", "reason": "GrantLapsed"}},
    )
    await ledger.grants._renew(held)
    assert ledger.grants.held() == []


async def test_an_idle_grant_is_given_back_and_its_bookings_then_count_on_their_own(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, clock = granting
    grant = await take_one(kube, ledger)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await ledger.commit(reservation=booking("in", 1024), token=token, live=True)
    assert ledger.index.booked(GPU, settle_s=30)[0] == 1024 + 3072  # the first pod, and the grant
    assert ledger.grants is not None
    [held] = ledger.grants.held()
    clock.now += TERMS.idle_s
    await ledger.grants.give_back(held)
    await settle()
    assert grants_in(kube) == []
    assert ledger.index.grant_remainder(grant.key, GPU.uuid) is None
    assert ledger.index.booked(GPU, settle_s=30)[0] == 1024 + 1024


async def test_shutdown_gives_every_grant_back(granting: tuple[FakeKube, KubeLedger, Clock]) -> None:
    kube, ledger, _ = granting
    await take_one(kube, ledger)
    await ledger.drain(timeout_s=1)
    assert grants_in(kube) == []
    assert ledger.grants is not None
    assert ledger.grants.held() == []
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    made = await ledger.commit(
        reservation=booking("after", 1024), token=token, live=True, grant_room_mib=8192
    )
    assert made.spec.grant == ""
    await settle()
    assert grants_in(kube) == []  # no new grant while shutting down


async def test_a_grant_whose_commit_lost_its_race_is_never_used(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, _ = granting
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    other = await kube.create(reservations_path("jobs"), booking("winner", 12_288).to_wire())
    mark = f"jobs/winner@{other['metadata']['resourceVersion']}"
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {ANNOTATION_LEDGER: mark}}})
    with pytest.raises(CommitConflictError):
        await ledger.commit(
            reservation=booking("loser", 1024), token=token, live=True, grant_room_mib=ROOM - 1024
        )
    await asyncio.sleep(0.05)
    assert ledger.grants is not None
    assert ledger.grants.held() == []
    assert grants_in(kube) == []


async def test_a_grant_the_controller_has_not_recorded_takes_no_booking(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    """An older controller would end it as a booking whose pod never came, while its holder may still
    book inside it: it is used only once the controller recorded it Granted."""
    kube, ledger, _ = granting
    grant = await take_one(kube, ledger, recorded=False)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    made = await ledger.commit(reservation=booking("early", 1024), token=token, live=True)
    assert made.spec.grant == ""
    await record(kube, grant, "Granted")
    made = await ledger.commit(reservation=booking("recorded", 1024), token=token, live=True)
    assert made.spec.grant == grant.key


async def test_a_grant_this_view_shows_ended_takes_no_booking_at_once(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    """Not at the next renewal: the moment the replica's watch shows the controller ended it."""
    kube, ledger, _ = granting
    grant = await take_one(kube, ledger)
    await record(kube, grant, "Expired", reason="GrantLapsed")
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    made = await ledger.commit(reservation=booking("after", 1024), token=token, live=True)
    assert made.spec.grant == ""


async def test_each_round_renews_what_is_due_and_gives_back_what_is_idle(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    kube, ledger, clock = granting
    grant = await take_one(kube, ledger)
    assert ledger.grants is not None
    path = reservations_path(grant.namespace, grant.name)
    await ledger.grants.keep_once()
    assert ANNOTATION_GRANT_RENEWED not in kube.objects[path]["metadata"].get("annotations", {})  # not due
    clock.now += TERMS.renew_every_s
    await ledger.grants.keep_once()
    assert kube.objects[path]["metadata"]["annotations"][ANNOTATION_GRANT_RENEWED] == "1"
    clock.now += TERMS.idle_s
    await ledger.grants.keep_once()
    assert path not in kube.objects  # idle: given back
    assert ledger.grants.held() == []


async def test_a_grant_the_controller_never_records_is_given_back_and_grants_pause(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    """An older controller or CRD: grants would only cost a create per commit, so none is taken for
    a while."""
    kube, ledger, clock = granting
    grant = await take_one(kube, ledger, recorded=False)
    assert ledger.grants is not None
    clock.now += TERMS.renew_every_s
    await ledger.grants.keep_once()
    assert reservations_path(grant.namespace, grant.name) not in kube.objects
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await ledger.commit(reservation=booking("next", 1024), token=token, live=True, grant_room_mib=8192)
    await settle()
    assert grants_in(kube) == []  # paused
    clock.now += 300
    await ledger.commit(reservation=booking("later", 1024), token=token, live=True, grant_room_mib=8192)
    await settle()
    assert len(grants_in(kube)) == 1


async def test_a_grant_holding_more_than_its_gpu_has_left_for_others_is_given_back(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    """As a GPU fills up, grants give their room back rather than hold it while others refuse pods."""
    kube, ledger, _ = granting
    grant = await take_one(kube, ledger)
    assert ledger.grants is not None
    figures = ledger.index.figures_by(settle_s=30, safety_margin_mib=0)

    def room(uuid: str) -> int | None:
        return figures(GPU, False)[2] if uuid == GPU.uuid else None

    assert ledger.grants.relieve(room) == []  # 12 GiB left for others, the grant holds 3
    await commit_elsewhere(kube, "other-replicas-pod", 12_000)
    await settle()
    assert room(GPU.uuid) == ROOM - 1024 - 3072 - 12_000
    [relieved] = ledger.grants.relieve(room)
    assert relieved.key == grant.key
    await settle()
    assert grants_in(kube) == []
    assert room(GPU.uuid) == ROOM - 1024 - 12_000  # its room is everyone's again


async def test_a_burst_decided_while_a_grant_is_on_its_way_takes_no_second_one(
    granting: tuple[FakeKube, KubeLedger, Clock],
) -> None:
    """Pods decided before the first grant is committed and recorded go outside it, each with the
    bump they would have had anyway, but do not each take a grant of their own."""
    kube, ledger, _ = granting
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await asyncio.gather(
        *(
            ledger.commit(reservation=booking(f"b{i}", 256), token=token, live=True, grant_room_mib=8192)
            for i in range(6)
        )
    )
    await settle()
    assert len(grants_in(kube)) == 1  # not recorded yet: nothing more is taken
    [grant] = grants_in(kube)
    path = reservations_path("vramshare", grant["metadata"]["name"])
    await kube.merge_patch(f"{path}/status", {"status": {"phase": "Granted"}})
    await settle()
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    made = await ledger.commit(
        reservation=booking("inside", 256), token=token, live=True, grant_room_mib=8192
    )
    assert made.spec.grant.endswith(grant["metadata"]["name"])


async def test_a_booking_whose_grant_was_given_back_while_it_was_created_is_withdrawn(
    granting: tuple[FakeKube, KubeLedger, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that saw the grant go before the booking came would count neither: the booking must
    not stand, and its pod decides again."""
    kube, ledger, _ = granting
    await take_one(kube, ledger)
    assert ledger.grants is not None
    [held] = ledger.grants.held()
    create = kube.create

    async def create_after_the_give_back(path: str, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
        assert ledger.grants is not None
        await ledger.grants.give_back(held)
        return await create(path, obj, **kw)

    monkeypatch.setattr(kube, "create", create_after_the_give_back)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking("late", 1024), token=token, live=True)
    assert reservations_path("jobs", "late") not in kube.objects
