"""The pod's memory budget, told to the frameworks inside it.

vramshare books memory but nothing stops a task from taking the whole GPU: TensorFlow and JAX
preallocate most of it, PyTorch caches. The webhook therefore gives each container the variables the
frameworks read, computed from the booked MiB and the GPU's total:

- `TF_FORCE_GPU_ALLOW_GROWTH=true`: TensorFlow allocates as it goes instead of taking the GPU;
- `XLA_PYTHON_CLIENT_MEM_FRACTION`: JAX's preallocation, booked/total rounded down to 0.01;
- `VRAMSHARE_GPU_MEMORY_MIB` and `VRAMSHARE_GPU_MEMORY_FRACTION`: the budget for user code, e.g.
  `torch.cuda.set_per_process_memory_fraction(float(os.environ["VRAMSHARE_GPU_MEMORY_FRACTION"]))`;
- on nodes running the CUDA MPS control daemon, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`, which the
  driver enforces for each visible device.

A value the user set is kept when it is lower (a tighter budget does no harm) and replaced when it is
higher or unreadable; `TF_FORCE_GPU_ALLOW_GROWTH` is always `true`, since `false` takes the whole GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

TF_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
XLA_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
BUDGET_MIB = "VRAMSHARE_GPU_MEMORY_MIB"
BUDGET_FRACTION = "VRAMSHARE_GPU_MEMORY_FRACTION"
MPS_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
GUARDRAIL_VARIABLES = (TF_GROWTH, XLA_FRACTION, BUDGET_MIB, BUDGET_FRACTION, MPS_LIMIT)


def fraction_of(mib: int, total_mib: int) -> float:
    """booked/total rounded down to 0.01 (at least 0.01, at most 1)."""
    if total_mib <= 0:
        return 1.0
    return max(0.01, min(1.0, math.floor(mib * 100 / total_mib) / 100))


def _mps_mib(value: str) -> float | None:
    """The MiB of a `0=<n>M` / `0=<n>G` limit for device 0 (None when unreadable)."""
    for part in value.split(","):
        device, _, limit = part.strip().partition("=")
        if device.strip() != "0" or not limit:
            continue
        limit = limit.strip().upper()
        scale = {"M": 1.0, "G": 1024.0}.get(limit[-1:], 1.0)
        digits = limit[:-1] if limit[-1:] in ("M", "G") else limit
        try:
            return float(digits) * scale
        except ValueError:
            return None
    return None


def _number(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def guardrail_env(
    *, mib: int, total_mib: int, mps: bool, user: Mapping[str, str], devices: int = 1
) -> dict[str, str]:
    """The guardrail variables for one container, given the values it already sets (`user`). With
    several `devices` (a pod with several GPUs) the budget is per GPU, and `total_mib` the smallest."""
    fraction = f"{fraction_of(mib, total_mib):.2f}"
    ours = {
        TF_GROWTH: "true",
        BUDGET_MIB: str(mib),
        BUDGET_FRACTION: fraction,
        XLA_FRACTION: fraction,
    }
    if mps:
        ours[MPS_LIMIT] = ",".join(f"{i}={mib}M" for i in range(devices))
    out = {}
    for name, value in ours.items():
        theirs = user.get(name)
        if theirs is not None and name != TF_GROWTH:
            read = _mps_mib if name == MPS_LIMIT else _number
            have, want = read(theirs), read(value)
            if have is not None and want is not None and 0 < have <= want:
                value = theirs  # lower: kept
        out[name] = value
    return out
