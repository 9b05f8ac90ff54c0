"""`vramshare status`: the GPUs and reservations of a cluster, as tables with memory bars, or JSON.

Also installed as the kubectl plugin `kubectl-vramshare` (`kubectl vramshare status`). Rendering is
pure (`render()`), fetching is a thin use of the kubernetes client with the current kubeconfig.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import yaml

from vramshare.domain import PodSighting, ReservationPhase, with_its_pod
from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.domain.models import mig_summary
from vramshare.kube.client import ApiError, Connection, KubeClient, list_all
from vramshare.kube.heartbeat import lease_heartbeat
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import (
    LABEL_HEARTBEAT_LEASE,
    LABEL_RESERVATION,
    devices_path,
    pods_path,
    reservations_path,
)
from vramshare.kube.sightings import PodsByLabel

BAR_WIDTH = 24


@dataclass(frozen=True, kw_only=True)
class GpuRow:
    node: str
    index: int
    uuid: str
    model: str
    state: str
    total_mib: int
    used_mib: int
    reserved_mib: int
    headroom_mib: int
    sample_age_s: float | None
    mig: str = ""
    """A MIG-enabled GPU's instances, e.g. "2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)"."""
    delivery: str = ""
    """The delivery preflight's result for the configured mode (Delivers, CannotDeliver, Unknown)."""
    delivery_mode: str = ""
    delivery_message: str = ""
    not_shared: str = ""
    """Why the GPU is not vramshare's to share (state NotShared): who else hands it out."""


@dataclass(frozen=True, kw_only=True)
class ReservationRow:
    namespace: str
    name: str
    pod: str
    mib: int
    node: str
    gpu_uuid: str
    gpu_index: int
    phase: str
    age_s: float
    queue_position: int | None = None
    more_gpus: tuple[tuple[str, int], ...] = ()
    """A pod with several GPUs is one row: its other GPUs' (UUID, index)."""


@dataclass(frozen=True, kw_only=True)
class Status:
    gpus: list[GpuRow]
    reservations: list[ReservationRow]


def from_objects(
    devices: list[dict[str, Any]],
    reservations: list[dict[str, Any]],
    *,
    now: float,
    heartbeat: InventoryHeartbeat | None = None,
    pods: list[dict[str, Any]] | None = None,
) -> Status:
    """`heartbeat`: the controller's, read before the devices (it dates the GPUs whose figures did not
    change, as the webhook does; see vramshare.domain.freshness). `pods`: the pods carrying vramshare's
    reservation label, if this user may list them: a booking whose pod exists is shown Bound
    (`shown_phase`); without them, phases as written."""
    by_label = PodsByLabel.of_pods(pods or [])
    gpus = []
    for device in (GpuDevice.from_wire(d) for d in devices):
        st = device.status
        sampled_at = None if st is None else st.sampled_at
        if st is not None and heartbeat is not None and heartbeat.confirms(device.spec.uuid):
            sampled_at = max(st.sampled_at, heartbeat.sampled_at)
        gpus.append(
            GpuRow(
                node=device.spec.node_name,
                index=device.spec.index,
                uuid=device.spec.uuid,
                model=device.spec.model,
                state=st.state if st is not None and st.state else "Unknown",
                total_mib=st.total_mib if st else 0,
                used_mib=st.used_mib if st else 0,
                reserved_mib=st.reserved_mib if st else 0,
                headroom_mib=st.headroom_mib if st else 0,
                sample_age_s=None if sampled_at is None else max(0.0, now - sampled_at),
                mig=mig_summary(st.mig) if st is not None and st.mig else "",
                delivery=st.delivery.result if st is not None and st.delivery else "",
                delivery_mode=st.delivery.mode if st is not None and st.delivery else "",
                delivery_message=st.delivery.message if st is not None and st.delivery else "",
                not_shared=device.not_shared_reason,
            )
        )
    rows = []
    sets: dict[tuple[str, str], list[GpuReservation]] = {}
    for res in (GpuReservation.from_wire(r) for r in reservations):
        if res.spec.gpu_count > 1:
            sets.setdefault((res.namespace, res.pod_label), []).append(res)
            continue
        rows.append(_row(res, now=now, pods=by_label.of(res.namespace, res.pod_label)))
    for members in sets.values():
        members.sort(key=lambda r: (r.name != r.pod_label, r.spec.gpu_index, r.name))
        first = _row(members[0], now=now, pods=by_label.of(members[0].namespace, members[0].pod_label))
        more = tuple((m.spec.gpu_uuid, m.spec.gpu_index) for m in members[1:])
        rows.append(replace(first, more_gpus=more))
    gpus.sort(key=lambda g: (g.node, g.index, g.uuid))
    rows.sort(
        key=lambda r: (
            {"Reserved": 0, "Bound": 0, "Queued": 1}.get(r.phase, 2),
            r.queue_position or 0,
            r.node,
            r.gpu_index,
            r.namespace,
            r.name,
        )
    )
    return Status(gpus=gpus, reservations=rows)


_BOOKING_FIELDS = ("namespace", "name", "pod", "mib", "node", "gpu_uuid", "gpu_index")
"""What a row shows of the booking, read from the domain's view of it (`GpuReservation.to_domain`)."""


def shown_phase(res: GpuReservation, pods: Iterable[PodSighting]) -> ReservationPhase:
    """The phase people are shown: as written, but Bound where the booking's pod exists (among `pods`,
    those carrying its label) though nothing wrote it: the controller writes nothing when a booking's
    pod appears or starts (issue #45), so its object says Reserved until the booking ends."""
    return with_its_pod(res.to_domain(), pods).phase


def _row(res: GpuReservation, *, now: float, pods: Iterable[PodSighting]) -> ReservationRow:
    booking = replace(res.to_domain(), phase=shown_phase(res, pods))
    return ReservationRow(
        **{f: getattr(booking, f) for f in _BOOKING_FIELDS},
        phase=booking.phase.value,
        age_s=max(0.0, now - (booking.reserved_at or now)),
        queue_position=res.status.queue_position if booking.phase is ReservationPhase.QUEUED else None,
    )


def bar(gpu: GpuRow, width: int = BAR_WIDTH) -> str:
    """'#' used, '+' reserved but not (yet) in use, '.' free; scaled to the GPU's total."""
    if gpu.total_mib <= 0:
        return " " * width
    used = round(width * min(gpu.used_mib, gpu.total_mib) / gpu.total_mib)
    booked = round(width * min(max(gpu.reserved_mib, gpu.used_mib), gpu.total_mib) / gpu.total_mib)
    return "#" * used + "+" * (booked - used) + "." * (width - booked)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def short_uuid(uuid: str) -> str:
    return uuid[:12] + "…" if len(uuid) > 13 else uuid


def render(status: Status, *, all_phases: bool = True, wide: bool = False) -> str:
    """Two tables; `wide` adds the reservation's name and writes UUIDs in full."""
    uuid_of = (lambda u: u) if wide else short_uuid
    gpu_rows = [
        [
            g.node,
            str(g.index),
            g.model,
            uuid_of(g.uuid),
            str(g.total_mib),
            str(g.used_mib),
            str(g.reserved_mib),
            str(max(g.headroom_mib, 0)),
            f"{g.state}, MIG" if g.mig else g.state,
            age(g.sample_age_s),
            g.delivery or "-",
            f"[{bar(g)}]",
        ]
        for g in status.gpus
    ]
    # Why a node's GPUs would not reach pods, once per node and reason.
    problems = sorted(
        {(g.node, g.delivery_mode, g.delivery_message) for g in status.gpus if g.delivery == "CannotDeliver"}
    )
    cannot = "".join(
        f"\n  {node}: delivery mode {mode} cannot deliver: {why}" for node, mode, why in problems
    )
    # Not shared, once per reason; a booked one first: its hold went while tasks ran (GpuHoldLost).
    reasons: dict[str, list[GpuRow]] = {}
    for g in status.gpus:
        if g.not_shared:
            reasons.setdefault(g.not_shared, []).append(g)
    lost = [g for g in status.gpus if g.not_shared and g.reserved_mib > 0]
    cannot += "".join(
        f"\n  {g.node} GPU {g.index}: not shared yet {g.reserved_mib} MiB booked on it (its hold lost? see "
        "its GpuHoldLost event): the tasks keep it until they end, nothing new goes there"
        for g in lost
    )
    cannot += "".join(
        f"\n  not shared ({len(gs)} GPU{'s' if len(gs) > 1 else ''}: "
        f"{', '.join(f'{g.node}/{g.index}' for g in gs[:4])}{' ...' if len(gs) > 4 else ''}): {why}"
        for why, gs in sorted(reasons.items())
    )
    res = [r for r in status.reservations if all_phases or r.phase in ("Queued", "Reserved", "Bound")]
    res_rows = [
        [
            r.namespace,
            *([r.name] if wide else []),
            r.pod,
            f"{1 + len(r.more_gpus)}x{r.mib}" if r.more_gpus else str(r.mib),
            r.node or "-",
            ",".join(str(i) for i in (r.gpu_index, *(i for _, i in r.more_gpus))) if r.gpu_uuid else "-",
            ",".join(uuid_of(u) for u in (r.gpu_uuid, *(u for u, _ in r.more_gpus))) or "-",
            f"{r.phase} #{r.queue_position}" if r.queue_position else r.phase,
            age(r.age_s),
        ]
        for r in res
    ]
    gpus = (
        _table(
            [
                "NODE",
                "IDX",
                "MODEL",
                "UUID",
                "TOTAL",
                "USED",
                "RESERVED",
                "HEADROOM",
                "STATE",
                "SAMPLED",
                "DELIVERY",
                "MEMORY (#used +reserved .free)",
            ],
            gpu_rows,
        )
        if gpu_rows
        else "No GPUs known (is the controller running?)"
    )
    reservations = (
        _table(
            [
                "NAMESPACE",
                *(["RESERVATION"] if wide else []),
                "POD",
                "MIB",
                "NODE",
                "IDX",
                "GPU",
                "PHASE",
                "AGE",
            ],
            res_rows,
        )
        if res_rows
        else "No reservations."
    )
    return f"GPUs\n{gpus}{cannot}\n\nReservations\n{reservations}"


def to_json(status: Status) -> str:
    return json.dumps(
        {"gpus": [asdict(g) for g in status.gpus], "reservations": [asdict(r) for r in status.reservations]},
        indent=2,
    )


async def fetch(
    *, kubeconfig: str | None, context: str | None = None, namespace: str | None = None
) -> Status:
    async with KubeClient(
        Connection.load(kubeconfig=kubeconfig, context=context), user_agent="vramshare-status"
    ) as kube:
        heartbeat = await _heartbeat(kube)  # before the devices: they then hold what it confirms
        devices = (await list_all(kube, devices_path())).get("items", [])
        reservations = (await list_all(kube, reservations_path(namespace))).get("items", [])
        pods = await _labelled_pods(kube, namespace)
    return from_objects(devices, reservations, now=time.time(), heartbeat=heartbeat, pods=pods)


async def _labelled_pods(kube: KubeClient, namespace: str | None) -> list[dict[str, Any]] | None:
    """The pods carrying vramshare's reservation label, if this user may list them (else None: phases
    are shown as written)."""
    path = pods_path(namespace) if namespace else "/api/v1/pods"
    try:
        return (await list_all(kube, path, label_selector=LABEL_RESERVATION)).get("items", [])  # type: ignore[no-any-return]
    except ApiError:
        return None


async def _heartbeat(kube: KubeClient) -> InventoryHeartbeat | None:
    """The newest heartbeat on a controller Lease (found by its label), if this user may read Leases;
    otherwise stored sample times are shown."""
    try:
        leases = await list_all(
            kube, "/apis/coordination.k8s.io/v1/leases", label_selector=LABEL_HEARTBEAT_LEASE
        )
    except ApiError:
        return None
    return newest_heartbeat(leases.get("items", []))


def newest_heartbeat(leases: list[dict[str, Any]]) -> InventoryHeartbeat | None:
    found = [h for h in (lease_heartbeat(lease) for lease in leases) if h is not None]
    return max(found, key=lambda h: h.sampled_at, default=None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kubectl vramshare",
        description="vramshare: GPUs shared by memory. Reservations of all namespaces unless -n is given.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="GPUs and reservations of the current cluster")
    status.add_argument("-o", "--output", choices=["table", "wide", "json", "yaml"], default="table")
    status.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    status.add_argument("--context", help="the kubeconfig context to use (default: its current one)")
    scope = status.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="only this namespace's reservations")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace (the default)")
    status.add_argument("--active", action="store_true", help="only Queued, Reserved and Bound reservations")
    status.add_argument("-w", "--watch", action="store_true", help="print again whenever something changed")
    status.add_argument("--interval", type=float, default=2.0, help="with -w: seconds between reads")
    args = parser.parse_args(argv)
    # -w ends with Ctrl-C (SIGINT), even when started where SIGINT was ignored (a background job of a
    # script): Python then installs no handler of its own, and the watch would never end.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_show(args))


async def _show(args: argparse.Namespace) -> None:
    last = None
    while True:
        try:
            current = await fetch(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
        except Exception as exc:  # a CLI: say what went wrong in one line
            print(f"vramshare status: cannot read the cluster: {exc}", file=sys.stderr)
            sys.exit(1)
        text = output(current, fmt=args.output, all_phases=not args.active)
        if text != last:
            print(text, flush=True)
            last = text
        if not args.watch:
            return
        await asyncio.sleep(args.interval)


def output(status: Status, *, fmt: str, all_phases: bool = True) -> str:
    if fmt == "json":
        return to_json(status)
    if fmt == "yaml":
        return yaml.safe_dump(json.loads(to_json(status)), sort_keys=False).rstrip("\n")
    return render(status, all_phases=all_phases, wide=fmt == "wide")


if __name__ == "__main__":
    main()
