"""One JSON log stream (vramshare's and the libraries'), and what every /metrics serves besides
vramshare's own series."""

from __future__ import annotations

import json
import logging

import pytest
import structlog
from prometheus_client import generate_latest

from vramshare import logs
from vramshare.controller.metrics import ControllerMetrics
from vramshare_webhook.metrics import WebhookMetrics


def test_library_logs_and_vramshare_logs_are_one_json_stream(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(level="info")
    try:
        structlog.get_logger("vramshare.test").info("decision", outcome="admitted")
        logging.getLogger("aiohttp.access").warning("client %s went away", "10.0.0.7")
        logging.getLogger("kopf.objects").info("handler done")
        logging.getLogger("asyncio").debug("below the level: not shown")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("kopf").exception("handler failed")
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers = []
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [
        ("decision", "info"),
        ("client 10.0.0.7 went away", "warning"),
        ("handler done", "info"),
        ("handler failed", "error"),
    ]
    assert lines[1]["logger"] == "aiohttp.access"
    assert "ValueError: boom" in lines[3]["exception"]
    assert all(line["timestamp"].endswith("Z") for line in lines)


def test_every_component_serves_process_metrics_and_its_build() -> None:
    for metrics, component in ((ControllerMetrics(), "controller"), (WebhookMetrics(), "webhook")):
        text = generate_latest(metrics.registry).decode()
        assert "process_resident_memory_bytes" in text
        assert "python_info" in text
        assert f'vramshare_build_info{{component="{component}"' in text


def test_a_controller_that_steps_down_stops_exporting_the_leaders_gauges() -> None:
    metrics = ControllerMetrics()
    metrics.leader.set(1)
    metrics.total.labels("node-a", "GPU-1").set(40960)
    metrics.state.labels("node-a", "GPU-1", "Ready").set(1)
    metrics.reservations.labels("Bound").set(3)
    metrics.step_down()
    text = generate_latest(metrics.registry).decode()
    assert "vramshare_controller_leader 0.0" in text
    assert 'uuid="GPU-1"' not in text
    assert 'vramshare_reservations{phase="Bound"}' not in text
