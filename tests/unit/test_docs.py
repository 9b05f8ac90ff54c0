"""The manual and the README say what the code does: the generated reference pages are current, every
setting has its meaning written next to it, every refusal reason and alert is documented, and the
README stays a front page whose links and quick start are the manual's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vramshare.controller.settings import ControllerSettings
from vramshare_e2e import reference_docs
from vramshare_webhook.decision import Reason
from vramshare_webhook.settings import WebhookSettings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_the_generated_reference_pages_are_current() -> None:
    assert reference_docs.stale() == [], "run make docs-reference"


@pytest.mark.parametrize("settings", [WebhookSettings(), ControllerSettings()], ids=type)
def test_every_setting_has_a_default_and_a_meaning_in_the_reference(settings: object) -> None:
    rows = list(reference_docs.setting_rows(settings))  # raises on a field without a docstring
    page = (DOCS / "reference" / "settings.md").read_text()
    assert rows
    for variable, default, _, meaning in rows:
        assert meaning.strip()
        assert f"| `{variable}`" in page, variable
        assert default in page


def test_a_field_without_a_docstring_is_refused_by_the_generator() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True, kw_only=True)
    class Undocumented:
        documented: int = 1
        """Has one."""
        bare: str = ""

    with pytest.raises(ValueError, match=r"Undocumented.bare has no docstring"):
        list(reference_docs.setting_rows(Undocumented()))


def test_every_decision_reason_is_in_the_events_and_refusals_page() -> None:
    page = (DOCS / "reference" / "events.md").read_text()
    missing = [r.value for r in Reason if f"`{r.value}`" not in page]
    assert not missing, f"docs/reference/events.md does not explain: {missing}"


def test_every_alert_the_chart_installs_is_explained() -> None:
    rules = (ROOT / "charts" / "vramshare" / "templates" / "prometheusrule.yaml").read_text()
    alerts = re.findall(r"- alert: (\w+)", rules)
    page = (DOCS / "install" / "observability.md").read_text()
    assert alerts
    assert [a for a in alerts if f"`{a}`" not in page] == []


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_readmes_links_into_the_repository_resolve() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into the manual"
    assert [link for link in relative if not (ROOT / link).exists()] == []


def _first_bash_block(text: str) -> str:
    match = re.search(r"```bash\n(.*?)```", text, re.S)
    assert match is not None
    return match.group(1)


def test_the_readmes_quick_start_is_the_manuals_which_a_test_runs() -> None:
    page = _first_bash_block((DOCS / "install" / "quickstart.md").read_text())
    assert "helm install" in page
    assert page in README.read_text()
