"""Words for people: the refusal an Airflow user reads in the task log, and one-line GPU summaries.

The refusal says what was asked, the best headroom available and why each GPU was passed over, and
that the task will be retried. With large fleets it lists the most useful GPUs and counts the rest, so
the message stays readable (and far below the API server's limits).
"""

from __future__ import annotations

from collections import Counter

from vramshare.domain.allocation import Exclusion, GpuVerdict, Refusal
from vramshare.domain.models import mig_summary

MAX_GPUS_LISTED = 8

_RANK = {
    Exclusion.TOO_SMALL: 0,
    Exclusion.STALE: 1,
    Exclusion.UNHEALTHY: 2,
    Exclusion.MISSING: 3,
    Exclusion.MIG_ENABLED: 4,
    Exclusion.OTHER_NODE: 5,
    Exclusion.OTHER_MODEL: 6,
}


def describe_verdict(verdict: GpuVerdict, *, max_sample_age_s: float) -> str:
    """One GPU's verdict, e.g. 'GPU-1 (node-a, index 0): 3584 MiB headroom (total 16384, ...)'."""
    gpu = verdict.gpu
    room = verdict.headroom
    match verdict.excluded:
        case Exclusion.MISSING:
            why = "missing from DCGM metrics"
        case Exclusion.UNHEALTHY:
            why = "unhealthy"
        case Exclusion.MIG_ENABLED:
            why = (
                f"MIG enabled ({mig_summary(gpu.mig)}); vramshare hands out whole GPUs by UUID and DCGM "
                "does not name the instances' MIG device UUIDs"
            )
        case Exclusion.NOT_SHARED:
            why = f"not shared: {gpu.not_shared}"
        case Exclusion.OTHER_MODEL:
            why = f"model {gpu.model} is not the one asked for"
        case Exclusion.OTHER_NODE:
            why = (
                f"node {gpu.node}: {verdict.detail}"
                if verdict.detail
                else "on another node than the pod is pinned to"
            )
        case Exclusion.STALE:
            why = f"metrics stale (last sample {verdict.sample_age_s:.0f} s old, max {max_sample_age_s:g} s)"
        case _ if room is not None:
            terms = f"total {room.total_mib}, reserved {room.reserved_mib}"
            if room.ledger_only:
                terms += ", metrics stale so counted by reservations only"
            else:
                terms += f", free {room.free_mib}"
                if room.unseen_mib:
                    terms += f", {room.unseen_mib} reserved but not yet in use"
            terms += f", margin {room.safety_margin_mib}"
            why = f"{max(room.headroom_mib, 0)} MiB headroom ({terms})"
        case _:
            why = "not usable"
    return f"{gpu.label}: {why}"


def refusal_message(refusal: Refusal, *, max_sample_age_s: float, retry_hint: str) -> str:
    """The denial message an Airflow user reads; `retry_hint` says how the task will be retried."""
    request = refusal.request
    nodes = sorted(request.nodes) if request.nodes is not None else None
    if nodes is None:
        where = ""
    elif not nodes:
        where = " on any node its node constraints allow (they allow none)"
    else:
        where = f" on node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}"
    head = f"no GPU{where} has {request.mib} MiB of headroom for pod {request.namespace}/{request.pod}"
    if request.count > 1:
        head = (
            f"no node{where} has {request.count} GPUs with {request.mib} MiB of headroom each for pod "
            f"{request.namespace}/{request.pod}"
        )
    if not refusal.verdicts:
        return (
            f"{head}: no GPUs are known (is the vramshare controller running and DCGM scraped?). {retry_hint}"
        )
    best = refusal.best_headroom_mib
    best_text = f"the most any GPU can give is {max(best, 0)} MiB" if best is not None else "no GPU is usable"
    if request.count > 1:
        best_text = _closest_node_text(refusal)

    def relevance(v: GpuVerdict) -> tuple[int, int]:
        room = v.headroom.headroom_mib if v.headroom is not None else 0
        return (_RANK.get(v.excluded, 0) if v.excluded else 0, -room)

    ranked = sorted(refusal.verdicts, key=relevance)
    listed = [describe_verdict(v, max_sample_age_s=max_sample_age_s) for v in ranked[:MAX_GPUS_LISTED]]
    rest = Counter(
        v.detail or (v.excluded.value if v.excluded else "fitting") for v in ranked[MAX_GPUS_LISTED:]
    )
    if rest:
        listed.append("and " + ", ".join(f"{n} more {why}" for why, n in sorted(rest.items())))
    return f"{head}; {best_text}. GPUs: " + "; ".join(listed) + f". {retry_hint}"


def _closest_node_text(refusal: Refusal) -> str:
    """For a request of several GPUs: which node came closest, and with which GPUs."""
    closest = refusal.closest_node
    if closest is None:
        return "no GPU on any node has that much headroom"
    node, verdicts = closest
    rooms = ", ".join(f"{v.gpu.uuid} (index {v.gpu.index}) {v.room_mib} MiB" for v in verdicts)
    have = len(verdicts)
    return (
        f"the closest is node {node}, where {have} of the {refusal.request.count} GPUs needed "
        f"{'has' if have == 1 else 'have'} room: {rooms}"
    )
