"""10000 hostile AdmissionReviews against the webhook's HTTP server (aiohttp's, in process, with the
in-memory ledger): every answer is a review echoing the UID or a 400, never a 500, and the server keeps
serving. The same strategies drive a real replica over TLS in the reliability tests."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings

from tests import hostile_reviews
from tests.unit.webhook.fakes import MemoryLedger, admitter
from vramshare_webhook.app import create_app

CASES = int(os.environ.get("VRAMSHARE_FUZZ_CASES", "10000"))


@pytest.mark.slow
def test_hostile_reviews_get_a_review_or_a_400_never_a_500() -> None:
    loop = asyncio.new_event_loop()
    app = create_app(admitter=admitter(MemoryLedger()), ready=lambda: True)
    http = TestClient(TestServer(app), loop=loop)
    loop.run_until_complete(http.start_server())
    statuses: Counter[int] = Counter()
    started = time.monotonic()

    async def post(data: bytes, content_type: str) -> tuple[int, bytes]:
        resp = await http.post("/mutate", data=data, headers={"Content-Type": content_type})
        return resp.status, await resp.read()

    @settings(
        max_examples=CASES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=hostile_reviews.reviews, content_type=hostile_reviews.content_types)
    def check(body: Any, content_type: str) -> None:
        status, payload = loop.run_until_complete(post(hostile_reviews.encode(body), content_type))
        statuses[status] += 1
        hostile_reviews.check_answer(body, status, payload)

    try:
        check()
        status, _ = loop.run_until_complete(post(b"{}", "application/json"))
        assert status == 400  # still serving
    finally:
        loop.run_until_complete(http.close())
        loop.close()
    assert sum(statuses.values()) >= CASES
    took = time.monotonic() - started
    print(f"fuzzing: {sum(statuses.values())} hostile reviews in {took:.0f} s, answers {dict(statuses)}")
