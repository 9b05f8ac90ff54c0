"""Replicas dealing tied GPUs out among themselves (vramshare.domain.shards), and choose() using it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu, request
from vramshare.domain import Accounting, AllocationSettings, Choice, Policy, choose
from vramshare.domain.shards import ReplicaRoster, dealt_to

names = st.text(alphabet="abcdefghij-0123456789", min_size=1, max_size=12)


@pytest.mark.slow
@given(
    gpus=st.sets(names.map(lambda s: f"GPU-{s}"), min_size=1, max_size=40),
    replicas=st.sets(names, min_size=2, max_size=8),
)
def test_every_tied_gpu_is_dealt_and_shares_are_even_or_forced(gpus: set[str], replicas: set[str]) -> None:
    hands = {r: dealt_to(r, tied=gpus, replicas=sorted(replicas)) for r in replicas}
    if len(gpus) >= len(replicas):
        # A partition: no two replicas hold the same GPU, none is left out, shares differ by one at most.
        assert sum(len(h) for h in hands.values()) == len(gpus)
        assert set().union(*hands.values()) == gpus
        assert max(map(len, hands.values())) - min(map(len, hands.values())) <= 1
    else:
        # Fewer GPUs than replicas: one each, and each GPU held by as few replicas as can be.
        assert all(len(h) == 1 for h in hands.values())
        held = Counter(next(iter(h)) for h in hands.values())
        assert set(held) == gpus
        assert max(held.values()) - min(held.values()) <= 1


@given(gpus=st.sets(names, min_size=1, max_size=10), me=names, others=st.sets(names, max_size=4))
def test_a_replica_that_does_not_know_it_is_up_keeps_every_tie(
    gpus: set[str], me: str, others: set[str]
) -> None:
    others.discard(me)
    assert dealt_to(me, tied=gpus, replicas=sorted(others)) == gpus
    assert dealt_to(me, tied=gpus, replicas=[me]) == gpus


@given(
    gpus=st.sets(names, min_size=2, max_size=20),
    replicas=st.sets(names, min_size=2, max_size=6),
    order=st.randoms(use_true_random=False),
)
def test_the_deal_does_not_depend_on_the_order_anything_is_listed_in(
    gpus: set[str], replicas: set[str], order: object
) -> None:
    listed, people = sorted(gpus), sorted(replicas)
    order.shuffle(listed)  # type: ignore[attr-defined]
    order.shuffle(people)  # type: ignore[attr-defined]
    for r in replicas:
        assert dealt_to(r, tied=listed, replicas=people) == dealt_to(
            r, tied=sorted(gpus), replicas=sorted(replicas)
        )


SETTINGS = AllocationSettings(accounting=Accounting(safety_margin_mib=0), near_tie_mib=512)


@given(
    a=names,
    b=names,
    policy=st.sampled_from(list(Policy)),
    used=st.lists(st.integers(0, 511), min_size=2, max_size=6),
)
def test_two_replicas_deciding_on_the_same_view_take_different_gpus_when_ties_allow(
    a: str, b: str, policy: Policy, used: list[int]
) -> None:
    if a == b:
        return
    gpus = [gpu(f"GPU-{i}", index=i, total=40_960, used=u) for i, u in enumerate(used)]
    settings = AllocationSettings(accounting=SETTINGS.accounting, near_tie_mib=512, policy=policy)
    picks = []
    for me in (a, b):
        decision = choose(request(10), gpus, [], settings=settings, now=NOW, prefer=me, replicas=[a, b])
        assert isinstance(decision, Choice)
        picks.append(decision.gpu.uuid)
    assert picks[0] != picks[1]


def test_dealing_only_reorders_ties_never_takes_a_gpu_the_policy_would_not() -> None:
    best = [gpu("GPU-0", index=0, total=40_960), gpu("GPU-1", index=1, total=40_960, used=100)]
    far = gpu("GPU-far", index=2, total=16_384)  # far below the best: never tied
    for me in ("webhook-a", "webhook-b", "webhook-c"):
        decision = choose(
            request(10), [*best, far], [], settings=SETTINGS, now=NOW, prefer=me,
            replicas=["webhook-a", "webhook-b", "webhook-c"],
        )  # fmt: skip
        assert isinstance(decision, Choice)
        assert decision.gpu.uuid in {"GPU-0", "GPU-1"}
    # A GPU where this request's last commit conflicted still comes last among ties.
    mine = choose(
        request(10),
        best,
        [],
        settings=SETTINGS,
        now=NOW,
        prefer="webhook-a",
        replicas=["webhook-a", "webhook-b"],
    )
    other = "GPU-1" if mine.gpu.uuid == "GPU-0" else "GPU-0"  # type: ignore[union-attr]
    again = choose(
        request(10), best, [], settings=SETTINGS, now=NOW, prefer="webhook-a",
        replicas=["webhook-a", "webhook-b"], avoid={mine.gpu.uuid},  # type: ignore[union-attr]
    )  # fmt: skip
    assert isinstance(again, Choice)
    assert again.gpu.uuid == other


def test_the_roster_counts_a_replica_up_while_it_is_seen_renewing() -> None:
    roster = ReplicaRoster(lease_s=15)
    roster.observe({"a": "1", "b": "7"}, now=100)
    assert roster.up(now=100) == ("a", "b")
    roster.observe({"a": "2", "b": "7"}, now=110)  # a renewed, b did not
    assert roster.up(now=114.9) == ("a", "b")
    assert roster.up(now=115) == ("a",)  # b unseen renewing for 15 s: gone
    assert roster.long_gone(now=160, after_s=60) == ("b",)
    roster.observe({"a": "3", "b": "8"}, now=161)  # b is back
    assert roster.up(now=161) == ("a", "b")
    roster.observe({"a": "3"}, now=162)  # b's Lease deleted (a clean shutdown): gone at once
    assert roster.up(now=162) == ("a",)
