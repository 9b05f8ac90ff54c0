"""GPU memory as a Kubernetes resource: the request vramshare adds to the pods it admits, and the
namespace quotas read from ResourceQuota objects (see `vramshare.domain.tenancy` for the policy).

Each admitted (or queued) pod requests the extended resource `vramshare.io/gpu-mem-mib` (its MiB, all
GPUs together) in its first container, requests and limits alike (Kubernetes requires both to be
equal for an extended resource). The controller advertises the same resource in each GPU node's
capacity, so:

- a ResourceQuota `requests.vramshare.io/gpu-mem-mib: "<MiB>"` bounds a namespace's GPU memory,
  enforced exactly by the API server for pods and shown by `kubectl describe quota`;
- the scheduler's node fit sees GPU memory (a node's capacity is the sum of its GPUs');
- Kueue's ClusterQueues can list it among their covered resources.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from typing import Any

from vramshare.domain.tenancy import Quota
from vramshare_webhook.patching import Obj, Operation, containers, pointer

_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[KMGTPE]i|[kMGTPE]|m)?", re.ASCII
)


def quantity(value: object) -> Decimal | None:
    """A Kubernetes resource quantity ("40000", "40k", "1e3", "2Ki"), or None when it is not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    match = _QUANTITY.fullmatch(str(value).strip())
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number + suffix)
        return Decimal(number) * _SUFFIXES[suffix]
    except (InvalidOperation, KeyError):
        return None


def quotas_in(objects: Iterable[Obj], *, resource: str) -> list[Quota]:
    """The GPU-memory quotas among a namespace's ResourceQuota objects: each one's hard
    `requests.<resource>` (MiB, rounded down). Quotas with scopes or a scope selector are left to
    the API server (it applies them to the pods they select); vramshare cannot tell which of its
    bookings they would cover."""
    out = []
    key = f"requests.{resource}"
    for obj in objects:
        spec = obj.get("spec") or {}
        if spec.get("scopes") or spec.get("scopeSelector"):
            continue
        hard = quantity((spec.get("hard") or {}).get(key))
        if hard is None:
            continue
        used = quantity(((obj.get("status") or {}).get("used") or {}).get(key))
        out.append(
            Quota(
                name=str(obj.get("metadata", {}).get("name", "?")),
                hard_mib=int(hard),
                used_mib=int(used) if used is not None else None,
            )
        )
    return out


def _without(resources: Any, resource: str) -> Obj:
    """A container's resources with `resource` taken out of requests and limits."""
    out: Obj = dict(resources) if isinstance(resources, dict) else {}
    for section in ("requests", "limits"):
        values = out.get(section)
        if isinstance(values, dict) and resource in values:
            out[section] = {k: v for k, v in values.items() if k != resource}
    return out


def containers_requesting(pod: Obj, resource: str) -> list[str]:
    """Which containers request or limit `resource` (as `containers[0]`)."""
    found = []
    for key, i, c in containers(pod):
        resources = c.get("resources")
        if isinstance(resources, dict) and any(
            isinstance(resources.get(s), dict) and resource in resources[s] for s in ("requests", "limits")
        ):
            found.append(f"{key}[{i}]")
    return found


def memory_resource_patch(pod: Obj, *, resource: str, mib: int) -> list[Operation]:
    """The JSON Patch that makes the pod request `mib` of `resource` (in its first container, requests
    equal to limits) and no other container any of it: a user's own value is replaced."""
    ops: list[Operation] = []
    for key, i, c in containers(pod):
        current = c.get("resources")
        wanted = _without(current, resource)
        if key == "containers" and i == 0:
            wanted["requests"] = {**(wanted.get("requests") or {}), resource: str(mib)}
            wanted["limits"] = {**(wanted.get("limits") or {}), resource: str(mib)}
        if wanted != (current if isinstance(current, dict) else {}):
            ops.append({"op": "add", "path": pointer("spec", key, i, "resources"), "value": wanted})
    return ops
