"""The README's settings tables say what the code does: every variable they name exists, with the
default they give, and every variable the code reads is in its component's table."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path

import pytest

from tests.unit.settings_defaults import defaults
from vramshare.controller.settings import ControllerSettings
from vramshare_webhook.settings import WebhookSettings

README = Path(__file__).resolve().parents[2] / "README.md"


def table(heading: str) -> list[tuple[list[str], str]]:
    """(variables, default cell) of each row of the first table under `heading`."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if line.startswith("#"):
            break
        if not line.startswith("| `VRAMSHARE_"):
            if rows and not line.startswith("|"):
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((re.findall(r"`(VRAMSHARE_[A-Z0-9_]+)`", cells[0]), cells[1]))
    return rows


def same(value: object, written: str) -> bool:
    if isinstance(value, bool):
        return written == str(value).lower()
    if isinstance(value, StrEnum):
        return written == value.value
    if isinstance(value, int | float):
        try:
            return float(written.replace("_", "")) == float(value)
        except ValueError:
            return False
    return written == str(value)


@pytest.mark.parametrize(
    ("heading", "settings"),
    [("### Webhook settings", WebhookSettings()), ("### Controller settings", ControllerSettings())],
)
def test_the_readme_tables_give_the_codes_defaults(heading: str, settings: object) -> None:
    code = defaults(settings)
    rows = table(heading)
    assert rows, heading
    wrong, unknown, documented = [], [], set()
    for names, cell in rows:
        written = re.findall(r"`([^`]*)`", cell)
        for i, name in enumerate(names):
            documented.add(name)
            if name not in code:
                unknown.append(name)
            elif len(written) == len(names) and not same(code[name], written[i]):
                wrong.append(f"{name}: README {written[i]!r}, code {code[name]!r}")
    assert not unknown, f"{heading} names variables the code does not read: {unknown}"
    assert not wrong, f"{heading} gives defaults the code does not have: {wrong}"
    # Shared settings (accounting, policy) may be documented in either table.
    elsewhere = {
        n for h in ("### Webhook settings", "### Controller settings") for names, _ in table(h) for n in names
    }
    missing = sorted(set(code) - documented - elsewhere)
    assert not missing, f"{heading}: variables the code reads that no table names: {missing}"
