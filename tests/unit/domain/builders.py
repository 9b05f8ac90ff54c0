"""Small builders for domain values, so tests state only what they are about."""

from __future__ import annotations

from vramshare.domain import AllocationRequest, Gpu, Reservation, ReservationPhase
from vramshare.domain.headroom import headroom
from vramshare.domain.inventory import DeviceState, DeviceStatus

NOW = 1_800_000_000.0


def gpu(
    uuid: str = "GPU-a",
    *,
    node: str = "node-a",
    index: int = 0,
    total: int = 16_384,
    used: int = 0,
    free: int | None = None,
    sampled_at: float = NOW,
    healthy: bool = True,
    missing: bool = False,
) -> Gpu:
    return Gpu(
        uuid=uuid,
        node=node,
        index=index,
        model="NVIDIA A100",
        total_mib=total,
        used_mib=used,
        free_mib=total - used if free is None else free,
        sampled_at=sampled_at,
        healthy=healthy,
        missing=missing,
    )


def reservation(
    mib: int,
    *,
    gpu_uuid: str = "GPU-a",
    name: str | None = None,
    phase: ReservationPhase = ReservationPhase.BOUND,
    running_since: float | None = None,
    reserved_at: float = NOW - 600,
    pod: str = "task-1",
) -> Reservation:
    return Reservation(
        name=name or f"res-{mib}-{gpu_uuid}",
        namespace="airflow",
        pod=pod,
        mib=mib,
        node="node-a",
        gpu_uuid=gpu_uuid,
        gpu_index=0,
        phase=phase,
        reserved_at=reserved_at,
        pod_running_since=running_since,
    )


def request(mib: int, *, node: str | None = None, nodes: frozenset[str] | None = None) -> AllocationRequest:
    allowed = frozenset([node]) if node is not None else nodes
    return AllocationRequest(mib=mib, namespace="airflow", pod="train-model-x", nodes=allowed)


def judged(state: DeviceState, total: int = 40_960, used: int = 0, uuid: str = "GPU-a") -> DeviceStatus:
    g = gpu(uuid, total=total, used=used)
    return DeviceStatus(
        gpu=g,
        last_seen_at=g.sampled_at,
        state=state,
        message="",
        headroom=headroom(g, [], settle_s=0, safety_margin_mib=0),
        overused_mib=0,
    )
