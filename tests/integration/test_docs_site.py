"""The manual as a reader gets it: built strict by MkDocs, served over HTTP on loopback, opened in Debian's
Chromium driven by Playwright. The landing page renders with its diagram, the navigation leads to the
pages it names, and the search finds what a reader types. Two screenshots are written next to the built
site (site/screenshots/) for a person to look at."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from vramshare_e2e import docs_site

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site"
# As root, without a sandbox; no background traffic (this machine reaches no outside address).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site_url() -> Iterator[str]:
    seconds = docs_site.build(SITE)
    print(f"[docs] strict build of the manual: {seconds:.1f} s")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = shutil.which("chromium")
    assert executable, "Debian's chromium is not installed: make browser"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    opened = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    requests_out: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.on(
        "request",
        lambda request: requests_out.append(request.url) if "127.0.0.1" not in request.url else None,
    )
    yield opened
    opened.close()
    # A script error (a diagram that does not parse, say) fails the page; the site asks nothing of the
    # outside world (no CDN, no fonts, no repository API), so it reads the same offline.
    assert errors == []
    assert requests_out == []


def h1(page: Page) -> str:
    """The page's title as a reader sees it, without the permalink sign."""
    return page.locator("article h1").first.inner_text().rstrip("¶").strip()


def test_the_landing_page_renders_with_its_diagram(site_url: str, page: Page) -> None:
    page.goto(site_url)
    assert page.title().startswith("vramshare")
    assert h1(page) == "vramshare"
    # Material swaps each rendered Mermaid block for a div holding the drawing (in a closed shadow root).
    page.wait_for_function(
        "() => [...document.querySelectorAll('.mermaid')].every(e => e.tagName === 'DIV')"
        " && document.querySelectorAll('div.mermaid').length > 0",
        timeout=20_000,
    )
    assert page.locator("div.mermaid").first.bounding_box()["height"] > 150  # type: ignore[index]
    shots = SITE / "screenshots"
    shots.mkdir(exist_ok=True)
    page.screenshot(path=str(shots / "landing.png"), full_page=True)


@pytest.mark.parametrize(
    ("link", "path", "heading"),
    [
        ("Quick start", "install/quickstart/", "Quick start"),
        ("The annotation", "airflow/", "Airflow: asking for GPU memory"),
        ("Settings", "reference/settings/", "Settings"),
        ("Security model", "concepts/security/", "The security model"),
    ],
)
def test_the_navigation_leads_to_each_section(
    site_url: str, page: Page, link: str, path: str, heading: str
) -> None:
    page.goto(site_url)
    page.locator("nav.md-nav--primary").get_by_role("link", name=link, exact=True).first.click()
    page.wait_for_url(site_url + path)
    assert h1(page) == heading


def test_the_search_finds_a_page_by_what_a_reader_types(site_url: str, page: Page) -> None:
    page.goto(site_url)
    page.locator("label.md-search__icon, .md-search__input").first.click()
    box = page.locator("input.md-search__input")
    # Typed key by key, as a reader does (the search answers key events, not a value set at once). The
    # index is built by a web worker after the page loads, and a query typed before it is ready shows
    # nothing (slow on a loaded machine); the worker also answers each prefix as it is typed, and on a
    # loaded machine the list on screen can be a prefix's ("retry-a") for a while after the last key.
    # So the typing is repeated until the list holds the page, and the test fails if it never does.
    refusals = page.locator(".md-search-result__item", has_text="Refusals and retries").first
    deadline = time.monotonic() + 90
    while True:
        box.fill("")
        box.press_sequentially("retry-after", delay=30)
        try:
            refusals.wait_for(timeout=5_000)
            break
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                raise
    assert box.input_value() == "retry-after"
    # The page a reader is after is the first answer to the whole query, not one of many.
    page.wait_for_function(
        "() => document.querySelector('.md-search-result__item')?.innerText.startsWith('Refusals')",
        timeout=10_000,
    )
    refusals.locator("a").first.click()
    page.wait_for_url("**/airflow/refusals/**")
    page.screenshot(path=str(SITE / "screenshots" / "search-to-refusals.png"))


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    with (copy / "docs" / "comparison.md").open("a") as page:
        page.write("\nSee [the lifecycle](concepts/lifecycle.md#no-such-section).\n")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=copy,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "does not contain an anchor '#no-such-section'" in result.stderr
