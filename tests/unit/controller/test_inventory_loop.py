"""The inventory loop against a fake client and a fixed DCGM reading: GpuDevices created and kept,
writes only on change, one overuse event per episode, presence handed to the reconciler."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from tests.unit.domain.builders import NOW
from tests.unit.fake_kube import FakeKube, fed_state
from vramshare.controller.devices import InventoryLoop, refresh_after, refresh_budget
from vramshare.controller.devices.write_policy import (
    BOOKING_FIGURES_LAG_S,
    Write,
    defer_booking_figures,
    why_write,
)
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.dcgm_series import DcgmReading
from vramshare.domain import Accounting, freshness
from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.domain.inventory import Sample
from vramshare.kube.objects import DeviceStatus, GpuDevice
from vramshare.kube.resources import ANNOTATION_LEDGER, devices_path, format_time, reservations_path
from vramshare.prometheus import PrometheusUnavailableError

SAMPLE = Sample(
    uuid="GPU-A",
    node="node-a",
    index=0,
    model="A100",
    free_mib=16_000,
    used_mib=0,
    driver_reserved_mib=384,
    sampled_at=NOW,
)


class Source:
    url = "http://prometheus.test"

    def __init__(self, *samples: Sample) -> None:
        self.samples = list(samples)
        self.down = False

    async def read(self) -> DcgmReading:
        if self.down:
            raise PrometheusUnavailableError("connection refused")
        return DcgmReading(samples=self.samples)


@contextlib.asynccontextmanager
async def loop(
    source: Source,
    now: list[float],
    *,
    on_heartbeat: Callable[[InventoryHeartbeat], None] = lambda heartbeat: None,
) -> AsyncIterator[tuple[FakeKube, InventoryLoop]]:
    kube = FakeKube()
    await kube.create("/api/v1/nodes", {"metadata": {"name": "node-a"}})
    async with fed_state(kube) as state:
        settings = ControllerSettings(accounting=Accounting(safety_margin_mib=512), identity="test")
        inventory = InventoryLoop(
            kube=kube,  # type: ignore[arg-type]
            source=source,  # type: ignore[arg-type]
            settings=settings,
            metrics=ControllerMetrics(),
            state=state,
            clock=lambda: now[0],
            on_heartbeat=on_heartbeat,
        )
        yield kube, inventory


def status_writes(kube: FakeKube) -> int:
    return sum(
        op == "merge_patch" and path.endswith("/status") and "/nodes/" not in path for op, path in kube.calls
    )


async def test_a_new_gpu_gets_a_device_with_figures_and_conditions() -> None:
    now = [NOW + 1]
    async with loop(Source(SAMPLE), now) as (kube, inventory):
        await inventory.poll()
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.spec.uuid == "GPU-A"
        assert device.status is not None
        assert (device.status.total_mib, device.status.driver_reserved_mib, device.status.state) == (
            16_384,
            384,
            "Ready",
        )
        assert device.status.headroom_mib == 16_000 - 512
        ready = device.status.condition("Ready")
        assert ready is not None
        assert ready.status
        assert inventory.presence.known == frozenset({"GPU-A"})
        assert not inventory.presence.is_missing("GPU-A")
        assert inventory.presence.is_missing("GPU-gone")  # no GpuDevice at all once the inventory ran


async def test_an_unchanged_status_is_not_written_again() -> None:
    now = [NOW + 1]
    source = Source(SAMPLE)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        writes = status_writes(kube)
        source.down = True  # Prometheus away: the last inventory stands, nothing about the GPU changed
        now[0] += 5
        await inventory.poll()
        assert status_writes(kube) == writes
        assert inventory.outage is not None
        assert inventory.metrics.prometheus_errors._value.get() == 1


async def test_overuse_posts_one_warning_per_episode() -> None:
    now = [NOW + 1]
    source = Source(replace(SAMPLE, used_mib=4_000, free_mib=12_000))
    async with loop(source, now) as (kube, inventory):
        # A booking of 1000 MiB on it, whose pod the warning names; another GPU's is not named.
        for name, uuid in (("task-1", "GPU-A"), ("other-1", "GPU-B")):
            await kube.create(
                reservations_path("jobs"),
                {
                    "metadata": {
                        "name": name,
                        "namespace": "jobs",
                        "creationTimestamp": format_time(NOW - 60),
                    },
                    "spec": {
                        "podName": name,
                        "memoryMiB": 1_000,
                        "nodeName": "node-a",
                        "gpuUUID": uuid,
                        "gpuIndex": 0,
                    },
                    "status": {"phase": "Bound", "podUID": f"uid-{name}"},
                },
            )
        assert await inventory.state.reservations.wait_for(kube.version, timeout_s=2)
        await inventory.poll()
        await inventory.poll()
        events = [o for p, o in kube.objects.items() if "/events/" in p]
        assert len(events) == 1
        assert events[0]["reason"] == "MemoryOverused"
        assert "4000 MiB" in events[0]["message"]
        assert "(1000 MiB) plus the margin; pods on it: jobs/task-1" in events[0]["message"]
        assert "other-1" not in events[0]["message"]
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.status is not None
        over = device.status.condition("MemoryOverused")
        assert over is not None
        assert over.status


async def test_a_stale_sample_flips_the_conditions_and_keeps_transition_times() -> None:
    now = [NOW + 1]
    async with loop(Source(SAMPLE), now) as (kube, inventory):
        await inventory.poll()
        now[0] = NOW + 500  # the sample is now older than max_sample_age_s (120 s)
        await inventory.poll()
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.status is not None
        assert device.status.state == "Stale"
        stale, missing = device.status.condition("Stale"), device.status.condition("Missing")
        assert stale is not None
        assert missing is not None
        assert (stale.status, stale.last_transition) == (True, NOW + 500)
        assert (missing.status, missing.last_transition) == (False, NOW + 1)


async def test_a_new_sample_with_the_same_figures_is_dated_by_the_heartbeat_not_written() -> None:
    """Issue #31: an unchanged GPU's new sample time goes out in the poll's heartbeat (on the Lease),
    not in a status write (each write also moves the GPU's ledger token, failing commits in flight)."""
    now = [NOW + 1]
    source = Source(SAMPLE)
    published: list[InventoryHeartbeat] = []
    async with loop(source, now, on_heartbeat=published.append) as (kube, inventory):
        await inventory.poll()
        writes = status_writes(kube)
        for later in (5, 10, 20, 31, 200):  # fresh samples, same figures, past any refresh interval
            source.samples = [replace(SAMPLE, sampled_at=NOW + later)]
            now[0] = NOW + later + 1
            await inventory.poll()
            assert published[-1].sampled_at == NOW + later
            assert published[-1].confirms("GPU-A")
        assert status_writes(kube) == writes
        assert inventory.metrics.device_status_writes.labels("refresh")._value.get() == 0
        # The heartbeat vouches for the figures as stored at its devices_version or later.
        assert published[-1].devices_version >= int(
            kube.objects[devices_path("gpu-a")]["metadata"]["resourceVersion"]
        )
        source.samples = [replace(SAMPLE, sampled_at=NOW + 205, used_mib=1_000, free_mib=15_000)]
        now[0] = NOW + 206
        await inventory.poll()  # new figures: written at once, and the heartbeat covers that write
        assert status_writes(kube) == writes + 1
        device = kube.objects[devices_path("gpu-a")]
        assert published[-1].devices_version >= int(device["metadata"]["resourceVersion"])


async def test_without_a_heartbeat_unchanged_gpus_are_refreshed_by_writes(monkeypatch: Any) -> None:
    """When a heartbeat cannot be published (too many GPUs unconfirmed), sample times are kept current
    by status writes, every refresh interval, as before heartbeats."""
    monkeypatch.setattr(freshness, "MAX_UNCONFIRMED", -1)
    now = [NOW + 1]
    source = Source(SAMPLE)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        assert inventory.heartbeat is None
        writes = status_writes(kube)
        for later in (5, 10, 20):  # within a quarter of the 120 s max age: no write
            source.samples = [replace(SAMPLE, sampled_at=NOW + later)]
            now[0] = NOW + later + 1
            await inventory.poll()
        assert status_writes(kube) == writes
        source.samples = [replace(SAMPLE, sampled_at=NOW + 31)]
        now[0] = NOW + 32
        await inventory.poll()
        assert status_writes(kube) == writes + 1


async def test_the_heartbeat_leaves_out_stale_and_lagging_gpus() -> None:
    """A GPU whose sample lags the others by more than a quarter of the maximum age, or that is not
    Ready, is unconfirmed: its stored time stands, and it is refreshed by writes."""
    lagging = replace(SAMPLE, uuid="GPU-B", index=1, sampled_at=NOW)
    now = [NOW + 1]
    source = Source(SAMPLE, lagging)
    published: list[InventoryHeartbeat] = []
    async with loop(source, now, on_heartbeat=published.append) as (kube, inventory):
        await inventory.poll()
        source.samples = [replace(SAMPLE, sampled_at=NOW + 40), lagging]
        now[0] = NOW + 41
        await inventory.poll()
        assert published[-1].sampled_at == NOW + 40
        assert published[-1].unconfirmed == frozenset({"GPU-B"})
        refreshed = GpuDevice.from_wire(kube.objects[devices_path("gpu-b")]).status
        assert refreshed is not None
        assert inventory.metrics.device_status_writes.labels("refresh")._value.get() == 1  # GPU-B's lastSeen
        source.samples = [replace(SAMPLE, sampled_at=NOW + 300)]  # GPU-B gone long enough to be stale
        now[0] = NOW + 301
        await inventory.poll()
        assert "GPU-B" in published[-1].unconfirmed
        assert published[-1].confirms("GPU-A")


async def test_status_and_conditions_say_which_generation_they_describe() -> None:
    now = [NOW + 1]
    async with loop(Source(SAMPLE), now) as (kube, inventory):
        await inventory.poll()
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.meta.generation == 1
        assert device.status is not None
        assert device.status.observed_generation == 1
        assert {c.observed_generation for c in device.status.conditions} == {1}
        # The card moves to another index: a spec change, a new generation, a status that says so.
        inventory.source.samples = [replace(SAMPLE, index=1, sampled_at=NOW + 2)]  # type: ignore[attr-defined]
        now[0] = NOW + 3
        await inventory.poll()
        await inventory.poll()
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.meta.generation == 2
        assert device.status is not None
        assert device.status.observed_generation == 2


def unusable_count(inventory: InventoryLoop, cause: str) -> float:
    return float(inventory.metrics.unusable_series.labels(cause)._value.get())


async def test_a_gpu_on_a_node_that_does_not_exist_is_left_out_and_counted() -> None:
    now = [NOW + 1]
    phantom = replace(SAMPLE, uuid="GPU-P", node="nvidia-dcgm-exporter-x7k2p")
    async with loop(Source(SAMPLE, phantom), now) as (kube, inventory):
        await inventory.poll()
        assert devices_path("gpu-p") not in kube.objects  # not created on a phantom node
        assert devices_path("gpu-a") in kube.objects
        assert unusable_count(inventory, "unknown-node") == 1
        assert unusable_count(inventory, "incomplete") == 0


async def test_a_known_gpu_whose_label_turns_to_a_phantom_node_is_not_moved_there() -> None:
    now = [NOW + 1]
    source = Source(SAMPLE)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        source.samples = [replace(SAMPLE, node="nvidia-dcgm-exporter-x7k2p", sampled_at=NOW + 5)]
        now[0] = NOW + 6
        await inventory.poll()
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.spec.node_name == "node-a"
        assert device.status is not None
        assert device.status.sampled_at == NOW  # the phantom sample was not taken
        assert unusable_count(inventory, "unknown-node") == 1


async def test_a_drifting_total_is_rejected_counted_and_taken_after_three_readings() -> None:
    now = [NOW + 1]
    source = Source(SAMPLE)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        grown = replace(SAMPLE, free_mib=26_000, sampled_at=NOW + 2)  # sums to 26 384, not 16 384
        source.samples = [grown]
        for n in (1, 2):
            now[0] = NOW + 2 + n
            await inventory.poll()
            device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
            assert device.status is not None
            assert device.status.total_mib == 16_384
            assert unusable_count(inventory, "total-drift") == 1
        now[0] = NOW + 5
        await inventory.poll()
        device = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")])
        assert device.status is not None
        assert device.status.total_mib == 26_384
        assert unusable_count(inventory, "total-drift") == 0


async def test_a_poll_writes_only_the_gpus_whose_figures_changed() -> None:
    """Issue #31: writes per poll follow the GPUs that changed, not the fleet (here 64 GPUs, 3 move)."""
    fleet = [
        replace(SAMPLE, uuid=f"GPU-{i:02d}", index=i % 8, node="node-a", free_mib=16_000) for i in range(64)
    ]
    now = [NOW + 1]
    source = Source(*fleet)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        assert status_writes(kube) == 64  # each new GPU's first status
        before = status_writes(kube)
        now[0] += 5
        changed = {"GPU-03", "GPU-17", "GPU-42"}
        source.samples = [
            replace(
                s,
                sampled_at=NOW + 5,
                **({"used_mib": 2_000, "free_mib": 14_000} if s.uuid in changed else {}),
            )
            for s in fleet
        ]
        await inventory.poll()
        assert status_writes(kube) - before == 3
        writes = inventory.metrics.device_status_writes
        assert writes.labels("changed")._value.get() == 67
        assert writes.labels("refresh")._value.get() == 0


async def test_a_poll_refreshes_unchanged_gpus_oldest_first_within_its_budget(monkeypatch: Any) -> None:
    """A fleet whose every sample time is due (a poll came late) and that no heartbeat dates is
    refreshed a share per poll, the oldest first, not all at once: 64 GPUs at 5 s polls and a 120 s
    maximum age: 15 a poll."""
    monkeypatch.setattr(freshness, "MAX_UNCONFIRMED", -1)
    fleet = [replace(SAMPLE, uuid=f"GPU-{i:02d}", index=i % 8, free_mib=16_000) for i in range(64)]
    now = [NOW + 1]
    source = Source(*fleet)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        before = status_writes(kube)
        now[0] += 40  # past every GPU's refresh interval (22.5 to 30 s)
        source.samples = [replace(s, sampled_at=NOW + 40) for s in fleet]
        await inventory.poll()
        assert refresh_budget(64, poll_interval_s=5, max_sample_age_s=120) == 15
        assert status_writes(kube) - before == 15
        first = refreshed_since(kube, NOW + 1)
        assert len(first) == 15
        now[0] += 5
        await inventory.poll()  # the next 15, none of the first again: the oldest go first
        assert status_writes(kube) - before == 30
        assert len(refreshed_since(kube, NOW + 1)) == 30
        assert inventory.metrics.device_status_writes.labels("refresh")._value.get() == 30


def refreshed_since(kube: FakeKube, sampled_at: float) -> set[str]:
    """The GPUs whose stored sample is newer than `sampled_at`."""
    devices = [GpuDevice.from_wire(o) for p, o in kube.objects.items() if "/gpudevices/" in p]
    return {d.spec.uuid for d in devices if d.status is not None and d.status.sampled_at > sampled_at}


def test_unchanged_gpus_refresh_their_sample_time_spread_over_a_window() -> None:
    """GPUs found together must not all refresh on one poll: each waits its own share of the window."""
    waits = [refresh_after(f"GPU-{i}", max_sample_age_s=120) for i in range(1_000)]
    assert all(22.5 <= w <= 30 for w in waits)
    assert max(waits) - min(waits) > 7  # spread across the window
    assert len({round(w, 1) for w in waits}) > 50
    assert refresh_after("GPU-7", max_sample_age_s=120) == waits[7]  # the same GPU, the same wait


async def test_booking_figures_wait_while_commits_land_on_the_gpu() -> None:
    """Issue #45: a write of a GPU's booking figures alone (reservedMiB, headroomMiB) moves its ledger
    token under the commits in flight on it. While webhooks commit on it (its ledger mark moved since
    the last poll) those figures wait, at most BOOKING_FIGURES_LAG_S; a quiet GPU's go at the next poll,
    and a new sample's figures are written at once, busy or not."""
    now = [NOW + 1]
    source = Source(SAMPLE)
    async with loop(source, now) as (kube, inventory):
        await inventory.poll()
        writes = status_writes(kube)
        booked = 0

        async def commit(name: str) -> None:
            """A booking of 1000 MiB on GPU-A and the bump of its ledger mark, as a webhook commits."""
            nonlocal booked
            await kube.create(
                reservations_path("jobs"),
                {
                    "metadata": {"name": name, "namespace": "jobs", "creationTimestamp": format_time(NOW)},
                    "spec": {
                        "podName": name,
                        "memoryMiB": 1_000,
                        "nodeName": "node-a",
                        "gpuUUID": "GPU-A",
                        "gpuIndex": 0,
                    },
                },
            )
            version = kube.version
            assert await inventory.state.reservations.wait_for(version, timeout_s=2)
            mark = {ANNOTATION_LEDGER: f"jobs/{name}@{version}"}
            await kube.merge_patch(devices_path("gpu-a"), {"metadata": {"annotations": mark}})
            booked += 1_000
            assert await inventory.state.devices.wait_for(kube.version, timeout_s=2)

        def reserved() -> int:
            status = GpuDevice.from_wire(kube.objects[devices_path("gpu-a")]).status
            assert status is not None
            return status.reserved_mib

        for name in ("task-1", "task-2"):  # commits land between polls: the figures wait
            await commit(name)
            now[0] += 2
            await inventory.poll()
        assert status_writes(kube) == writes
        assert reserved() == 0
        now[0] += 2
        await inventory.poll()  # no commit since the last poll: written
        assert status_writes(kube) == writes + 1
        assert reserved() == booked == 2_000
        assert inventory.metrics.device_status_writes.labels("bookings")._value.get() == 1
        # Commits that never stop do not hold the figures back for longer than the lag.
        polls = int(BOOKING_FIGURES_LAG_S / 2)  # the first waits; the last is the lag after it
        for i in range(polls + 1):
            await commit(f"burst-{i}")
            now[0] += 2
            await inventory.poll()
            assert status_writes(kube) == writes + (2 if i == polls else 1)
        assert reserved() == booked
        # A new sample is written at once, with the booking figures, though commits go on.
        await commit("burst-last")
        source.samples = [replace(SAMPLE, used_mib=1_000, free_mib=15_000)]
        now[0] += 2
        await inventory.poll()
        assert status_writes(kube) == writes + 3
        assert reserved() == booked


def test_only_a_change_of_booking_figures_is_a_bookings_write() -> None:
    base = DeviceStatus(
        total_mib=16_384,
        used_mib=0,
        free_mib=16_000,
        driver_reserved_mib=384,
        reserved_mib=0,
        headroom_mib=15_488,
        sampled_at=NOW,
        last_seen_at=NOW,
        state="Ready",
    )
    booked = replace(base, reserved_mib=1_000, headroom_mib=14_488)
    assert why_write(booked, base, refresh_s=30) is Write.BOOKINGS
    assert why_write(replace(booked, used_mib=900, free_mib=15_100), base, refresh_s=30) is Write.CHANGED
    assert why_write(replace(booked, state="Stale"), base, refresh_s=30) is Write.CHANGED
    assert why_write(base, base, refresh_s=30) is None
    assert defer_booking_figures(committing=True, deferred_s=None)
    assert defer_booking_figures(committing=True, deferred_s=BOOKING_FIGURES_LAG_S - 0.1)
    assert not defer_booking_figures(committing=True, deferred_s=BOOKING_FIGURES_LAG_S)
    assert not defer_booking_figures(committing=False, deferred_s=None)
