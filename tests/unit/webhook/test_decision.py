"""answer(): every decision maps to one AdmissionReview answer and one pair of metric labels."""

from __future__ import annotations

import pytest

from vramshare_webhook.decision import (
    Admit,
    Contention,
    Decision,
    Errored,
    Hide,
    Invalid,
    Outcome,
    Reason,
    Refuse,
    Skip,
    answer,
)
from vramshare_webhook.pod import Placement
from vramshare_webhook.settings import WebhookSettings

PLACEMENT = Placement(reservation="task-1", gpu_uuid="GPU-a", gpu_index=0, node="node-a")
PATCH = [{"op": "add", "path": "/metadata/labels", "value": {}}]

CASES: list[tuple[Decision, Outcome, str, bool, int | None]] = [
    (Skip(reason=Reason.NOT_A_POD_CREATE), Outcome.SKIPPED, "not-a-pod-create", True, None),
    (Hide(patch=PATCH), Outcome.HIDDEN, "no-gpu-request", True, None),
    (
        Invalid(reason=Reason.INVALID_ANNOTATION, message="bad"),
        Outcome.INVALID,
        "invalid-annotation",
        False,
        400,
    ),
    (Admit(placement=PLACEMENT, patch=PATCH, reason=Reason.FITS), Outcome.ADMITTED, "fits", True, None),
    (Refuse(message="full"), Outcome.REFUSED, "no-gpu-fits", False, 403),
    (Contention(message="busy"), Outcome.REFUSED, "contention", False, 403),
    (Errored(message="boom", error_type="RuntimeError"), Outcome.ERROR, "RuntimeError", False, 500),
]


@pytest.mark.parametrize(("decision", "outcome", "reason", "allowed", "code"), CASES)
def test_each_decision_has_one_answer(
    decision: Decision, outcome: Outcome, reason: str, allowed: bool, code: int | None
) -> None:
    result = answer(decision, uid="u1", settings=WebhookSettings())
    assert (result.outcome, result.reason) == (outcome, reason)
    response = result.review["response"]
    assert response["uid"] == "u1"
    assert response["allowed"] is allowed
    assert response.get("status", {}).get("code") == code
    assert ("patch" in response) == isinstance(decision, Hide | Admit)


def test_refusals_follow_the_denial_code() -> None:
    settings = WebhookSettings(denial_code=429, retry_after_s=45)
    for decision in (Refuse(message="full"), Contention(message="busy")):
        status = answer(decision, uid="u", settings=settings).review["response"]["status"]
        assert (status["code"], status["reason"], status["details"]) == (
            429,
            "TooManyRequests",
            {"retryAfterSeconds": 45},
        )


def test_admissions_log_where_the_pod_went() -> None:
    result = answer(
        Admit(placement=PLACEMENT, patch=PATCH, reason=Reason.FITS, details={"mib": 4096}),
        uid="u",
        settings=WebhookSettings(),
    )
    assert result.log_fields == {"mib": 4096, "gpu": "GPU-a", "node": "node-a", "reservation": "task-1"}
