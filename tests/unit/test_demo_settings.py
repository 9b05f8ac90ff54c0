"""The demo runs vramshare as shipped: the webhook and the controller get the same value of every
setting both read, and only what the demo names (with the product's default and why) is shortened."""

from __future__ import annotations

from tests.unit.settings_defaults import defaults
from vramshare.controller.settings import ControllerSettings
from vramshare.settings import from_env, variables
from vramshare_e2e.demo import SHORTENED_CONTROLLER, SHORTENED_SHARED, demo_env, shortened_note
from vramshare_webhook.settings import WebhookSettings


def test_both_components_get_the_same_shared_settings() -> None:
    webhook, controller = demo_env()
    shared = variables(WebhookSettings()) & variables(ControllerSettings())
    for name in shared:
        assert webhook.get(name) == controller.get(name), name
    # Each component's own settings are set only for it, and only where they are its own.
    assert set(webhook) <= variables(WebhookSettings())
    assert set(controller) <= variables(ControllerSettings())


def test_what_is_shortened_is_named_with_its_default_and_nothing_else_differs() -> None:
    webhook, controller = demo_env()
    for env, settings in ((webhook, WebhookSettings()), (controller, ControllerSettings())):
        shipped, demo = defaults(settings), defaults(from_env(settings, env))
        changed = {k for k in shipped if shipped[k] != demo[k]} - {"VRAMSHARE_LOG_LEVEL"}
        assert changed <= set(SHORTENED_SHARED) | set(SHORTENED_CONTROLLER)
        for name in changed:
            _, default, _ = {**SHORTENED_SHARED, **SHORTENED_CONTROLLER}[name]
            assert float(default) == float(shipped[name]), name  # the note states the real default
    note = shortened_note()
    assert "VRAMSHARE_SETTLE_S=3 (default 60" in note
