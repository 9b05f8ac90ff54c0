"""The memory budget a guarded pod is told (see `vramshare.domain.guardrails`), per container."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vramshare.domain import Gpu
from vramshare.domain.guardrails import BUDGET_MIB, TF_GROWTH, guardrail_env
from vramshare.domain.scheduling import NodeView
from vramshare.kube.pods import MPS_LABEL
from vramshare_webhook.pod import literal_env

ContainerEnv = Callable[[dict[str, Any]], dict[str, str]]
"""A container -> the budget variables it gets."""


def budget(mib: int, gpus: list[Gpu], *, nodes: Iterable[NodeView]) -> ContainerEnv:
    """Each container's budget variables on `gpus`: per GPU, as a fraction of the smallest."""
    node = gpus[0].node
    mps = any(n.name == node and n.labels.get(MPS_LABEL) == "true" for n in nodes)
    total = min(g.total_mib for g in gpus)
    return lambda container: guardrail_env(
        mib=mib, total_mib=total, mps=mps, user=literal_env(container), devices=len(gpus)
    )


def known_before_placement(mib: int) -> ContainerEnv:
    """A queued pod's budget: before its GPU is chosen only the booked MiB is known; the rest comes
    with the placement."""

    def env(container: dict[str, Any]) -> dict[str, str]:
        full = guardrail_env(mib=mib, total_mib=0, mps=False, user=literal_env(container))
        return {k: full[k] for k in (TF_GROWTH, BUDGET_MIB)}

    return env
