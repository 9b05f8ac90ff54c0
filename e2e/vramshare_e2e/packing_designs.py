"""The admission designs the packing benchmark compares: vramshare (its policies, with fairness and
the queue), an ideal packer, Kaapana-like refresh queues, whole GPUs and time-slicing."""

from __future__ import annotations

import math

from vramshare.domain import (
    Accounting,
    AllocationRequest,
    AllocationSettings,
    Choice,
    FairnessSettings,
    Gpu,
    Hold,
    Policy,
    QueueSettings,
    Refusal,
    ReleaseLog,
    Reservation,
    ReservationPhase,
    Waiting,
    choose,
    gpu_to_hold,
    missing_mib,
    plan_queue,
    retry_after_s,
)
from vramshare_e2e.packing_model import CLIENTS, Card, Job, Model, Running


class Design:
    name = ""
    waits = False
    """Pods that do not fit wait (a queue, or the scheduler's pending pods) instead of being refused."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        raise NotImplementedError

    def released(self, card: Card, job: Job, now: float) -> None:
        """A job ended on `card` (designs that learn from releases listen)."""

    def retry_after_s(self, job: Job, now: float) -> float | None:
        """The Retry-After this design answers a refused `job` with (None: the client's fixed one)."""
        return None

    def admit(self, due: list[Job], cards: list[Card], now: float) -> list[tuple[Job, Card]]:
        """Decide the due jobs, oldest first; each placement counts for the next."""
        placed = []
        for job in due:
            card = self.place(job, cards, now)
            if card is not None:
                card.running.append(Running(job=job, started_s=now))
                placed.append((job, card))
        return placed


def observed_used(card: Card, now: float, model: Model) -> tuple[int, float]:
    """The used memory the scheduler sees at `now`: the newest sample older than the scrape lag."""
    visible = [s for s in card.samples if s[0] <= now - model.scrape_lag_s]
    return (visible[-1][1], visible[-1][0]) if visible else (0, 0.0)


class Vramshare(Design):
    def __init__(self, model: Model, policy: Policy) -> None:
        super().__init__(model)
        self.name = f"vramshare-{policy.value}"
        self.settings = AllocationSettings(
            policy=policy,
            accounting=Accounting(
                safety_margin_mib=model.safety_margin_mib, settle_s=model.settle_s, max_sample_age_s=1e9
            ),
        )

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        decision = self.decide(job, cards, now)
        return next(c for c in cards if c.uuid == decision.gpu.uuid) if isinstance(decision, Choice) else None

    def decide(
        self,
        job: Job,
        cards: list[Card],
        now: float,
        *,
        extra: list[Reservation] | None = None,
        credit: dict[str, int] | None = None,
    ) -> Choice | Refusal:
        """The webhook's `choose` over what vramshare sees, plus `extra` bookings (holds)."""
        gpus, reservations = vramshare_view(cards, now, self.model)
        return choose(
            AllocationRequest(mib=job.asked_mib, namespace="sim", pod=job.name),
            gpus,
            reservations + (extra or []),
            settings=self.settings,
            now=now,
            credit=credit,
        )


def vramshare_view(cards: list[Card], now: float, model: Model) -> tuple[list[Gpu], list[Reservation]]:
    """The inventory (lagging samples) and the ledger (every running job's booking) vramshare sees."""
    gpus, reservations = [], []
    for c in cards:
        used, at = observed_used(c, now, model)
        gpus.append(
            Gpu(
                uuid=c.uuid,
                node=c.node,
                index=c.index,
                model="sim",
                total_mib=c.total_mib,
                used_mib=used,
                free_mib=c.total_mib - used,
                sampled_at=at,
            )
        )
        reservations += [
            Reservation(
                name=r.job.name,
                namespace="sim",
                pod=r.job.name,
                mib=r.job.asked_mib,
                node=c.node,
                gpu_uuid=c.uuid,
                gpu_index=c.index,
                phase=ReservationPhase.BOUND,
                reserved_at=r.started_s,
                pod_running_since=r.started_s,
            )
            for r in c.running
        ]
    return gpus, reservations


class VramshareFair(Vramshare):
    """Refuse mode with holds: a refused large request keeps memory on the GPU closest to fitting it
    for its next try (`gpu_to_hold`, credited by `choose`; at most `max_holds` at once), and 429
    answers carry a Retry-After from the release rate (`retry_after_s`), as the webhook does."""

    def __init__(self, model: Model, policy: Policy) -> None:
        super().__init__(model, policy)
        self.name = f"vramshare-{policy.value}-fair"
        self.fairness = FairnessSettings(hold_min_mib=model.hold_min_mib, hold_limit_s=model.hold_limit_s)
        self.holds: dict[str, tuple[str, float, int]] = {}
        """Job -> (GPU held for it, since, MiB)."""
        self.deficits: dict[str, int] = {}
        self.releases = ReleaseLog()

    def released(self, card: Card, job: Job, now: float) -> None:
        self.releases.add(at=now, gpu_uuid=card.uuid, mib=job.asked_mib)

    def retry_after_s(self, job: Job, now: float) -> float | None:
        held = self.holds.get(job.name)
        return retry_after_s(
            deficit_mib=self.deficits.get(job.name, job.asked_mib),
            rate_mib_per_s=self.releases.rate_mib_per_s(now=now, gpu_uuid=held[0] if held else None),
            floor_s=5,
            ceiling_s=int(CLIENTS["429"].retry_after_s),
        )

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        self.holds = {k: h for k, h in self.holds.items() if now - h[1] < self.fairness.hold_limit_s}
        holds = [
            Reservation(
                name=f"hold-{name}",
                namespace="sim",
                pod=name,
                mib=mib,
                node="",
                gpu_uuid=uuid,
                gpu_index=0,
                phase=ReservationPhase.HELD,
                reserved_at=since,
                held_for=name,
            )
            for name, (uuid, since, mib) in self.holds.items()
        ]
        own = self.holds.get(job.name)
        decision = self.decide(job, cards, now, extra=holds, credit={own[0]: job.asked_mib} if own else None)
        if isinstance(decision, Choice):
            self.holds.pop(job.name, None)
            return next(c for c in cards if c.uuid == decision.gpu.uuid)
        self.deficits[job.name] = missing_mib(decision)
        if own is None and len(self.holds) < self.model.max_holds:
            gpu = gpu_to_hold(
                decision,
                held={uuid for uuid, _, _ in self.holds.values()},
                settings=self.settings,
                fairness=self.fairness,
            )
            if gpu is not None:
                self.holds[job.name] = (gpu.uuid, now, job.asked_mib)
        return None


class VramshareQueue(Design):
    """Queue mode: each arrival meets the webhook's decision first (admitted where it fits now), the
    rest waits for the controller's planner, run every second, with the webhook's default policy. With
    `hold_in_ledger` off, admissions do not see the head's hold (as before it was a booking)."""

    waits = True

    def __init__(self, model: Model, *, hold_in_ledger: bool = True) -> None:
        super().__init__(model)
        self.name = "vramshare-queue" if hold_in_ledger else "vramshare-queue-hold-unseen"
        self.hold_in_ledger = hold_in_ledger
        self.queued: set[str] = set()
        """Jobs the webhook queued (the others are new arrivals, decided by the webhook first)."""
        self.settings = AllocationSettings(
            policy=Policy.SPREAD,
            accounting=Accounting(
                safety_margin_mib=model.safety_margin_mib, settle_s=model.settle_s, max_sample_age_s=1e9
            ),
        )
        self.queue = QueueSettings(hold_limit_s=model.hold_limit_s)
        self.hold: Hold | None = None

    def _hold_booking(self, by_name: dict[str, Job]) -> list[Reservation]:
        """The head's hold as the ledger holds it (a booking of its size on the held GPU)."""
        hold = self.hold
        if not self.hold_in_ledger or hold is None or hold.key not in by_name:
            return []
        return [
            Reservation(
                name="queue-hold",
                namespace="sim",
                pod=hold.key,
                mib=by_name[hold.key].asked_mib,
                node="",
                gpu_uuid=hold.gpu_uuid,
                gpu_index=0,
                phase=ReservationPhase.HELD,
                reserved_at=hold.since,
                held_for=hold.key,
                queue_entry=True,
            )
        ]

    def admit(self, due: list[Job], cards: list[Card], now: float) -> list[tuple[Job, Card]]:
        by_name = {j.name: j for j in due}
        placed = []
        for job in due:
            if job.name in self.queued:
                continue
            gpus, reservations = vramshare_view(cards, now, self.model)
            decision = choose(
                AllocationRequest(mib=job.asked_mib, namespace="sim", pod=job.name),
                gpus,
                reservations + self._hold_booking(by_name),
                settings=self.settings,
                now=now,
            )
            if isinstance(decision, Choice):
                card = next(c for c in cards if c.uuid == decision.gpu.uuid)
                card.running.append(Running(job=job, started_s=now))
                placed.append((job, card))
            else:
                self.queued.add(job.name)
        gpus, reservations = vramshare_view(cards, now, self.model)
        plan = plan_queue(
            [
                Waiting(key=j.name, namespace="sim", pod=j.name, mib=j.asked_mib, queued_at=j.arrival_s)
                for j in due
                if j.name in self.queued
            ],
            gpus,
            reservations,
            settings=self.settings,
            queue=self.queue,
            hold=self.hold,
            now=now,
        )
        self.hold = plan.hold
        for waiting, choice in plan.placements:
            card = next(c for c in cards if c.uuid == choice.gpu.uuid)
            job = by_name[waiting.key]
            card.running.append(Running(job=job, started_s=now))
            placed.append((job, card))
            self.queued.discard(job.name)
        return placed


class Ideal(Design):
    """The reference: exact bookings by asked memory, no lag, oldest first with backfill, no margin."""

    name = "ideal"
    waits = True

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        rooms = [(c.total_mib - sum(r.job.asked_mib for r in c.running), c) for c in cards]
        fitting = [(room, c) for room, c in rooms if room >= job.asked_mib]
        return min(fitting, key=lambda t: (t[0], t[1].uuid))[1] if fitting else None


class KaapanaLike(Design):
    name = "kaapana-like"
    waits = True  # its check runs before the pod is created: a task waits in Airflow, no try spent

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.queued: dict[str, int] = {}
        self.refreshed_at = -math.inf

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        if now - self.refreshed_at >= self.model.kaapana_refresh_s:
            self.queued.clear()  # the in-memory queue is wiped at every refresh
            self.refreshed_at = now
        rooms = {}
        for c in cards:
            used, _ = observed_used(c, now, self.model)
            rooms[c.uuid] = c.total_mib - used - self.queued.get(c.uuid, 0)
        fitting = [c for c in cards if rooms[c.uuid] >= job.asked_mib]
        if fitting:
            chosen = max(fitting, key=lambda c: rooms[c.uuid])
        else:
            # The fallback pass ignores free memory: any GPU big enough, least queued first.
            big = [c for c in cards if c.total_mib >= job.asked_mib]
            if not big:
                return None
            chosen = min(big, key=lambda c: self.queued.get(c.uuid, 0))
        self.queued[chosen.uuid] = self.queued.get(chosen.uuid, 0) + job.asked_mib
        return chosen


class WholeGpu(Design):
    name = "whole-gpu"
    waits = True

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        idle = [c for c in cards if not c.running and c.total_mib >= job.asked_mib]
        return min(idle, key=lambda c: c.total_mib) if idle else None


class TimeSlicing(Design):
    name = "time-slicing"
    waits = True

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        open_ = [c for c in cards if len(c.running) < self.model.time_slices]
        return min(open_, key=lambda c: (len(c.running), c.uuid)) if open_ else None
