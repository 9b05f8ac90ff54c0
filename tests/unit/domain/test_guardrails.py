"""The memory budget told to the frameworks inside a pod."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vramshare.domain.guardrails import fraction_of, guardrail_env


def test_the_budget_from_the_booked_mib_and_the_gpu_total() -> None:
    env = guardrail_env(mib=8_000, total_mib=40_960, mps=False, user={})
    assert env == {
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "VRAMSHARE_GPU_MEMORY_MIB": "8000",
        "VRAMSHARE_GPU_MEMORY_FRACTION": "0.19",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.19",
    }
    assert guardrail_env(mib=8_000, total_mib=40_960, mps=True, user={})[
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
    ] == ("0=8000M")


def test_user_values_are_kept_when_lower_and_replaced_when_higher_or_unreadable() -> None:
    env = guardrail_env(
        mib=8_000,
        total_mib=40_960,
        mps=True,
        user={
            "XLA_PYTHON_CLIENT_MEM_FRACTION": ".10",
            "VRAMSHARE_GPU_MEMORY_FRACTION": "0.9",
            "VRAMSHARE_GPU_MEMORY_MIB": "lots",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G",
            "TF_FORCE_GPU_ALLOW_GROWTH": "false",
        },
    )
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".10"
    assert env["VRAMSHARE_GPU_MEMORY_FRACTION"] == "0.19"
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == "8000"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4G"  # 4096 MiB < 8000
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"  # false would take the whole GPU
    higher = guardrail_env(
        mib=8_000, total_mib=40_960, mps=True, user={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=9000M"}
    )
    assert higher["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8000M"


@given(mib=st.integers(1, 200_000), total=st.integers(1, 200_000))
def test_the_fraction_never_exceeds_what_was_booked(mib: int, total: int) -> None:
    fraction = fraction_of(mib, total)
    assert 0.01 <= fraction <= 1.0
    if mib <= total and mib * 100 >= total:
        assert fraction * total <= mib + 1e-6


def test_a_pod_with_several_gpus_gets_the_driver_limit_for_each() -> None:
    env = guardrail_env(mib=8_192, total_mib=40_960, mps=True, user={}, devices=3)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M,1=8192M,2=8192M"
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == "8192"  # per GPU
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.20"
