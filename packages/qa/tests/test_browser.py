"""A real browser (Debian's headless Chromium driven by Playwright, no browser download) uses the page:
asks a question, sees the answer stream in with a citation, uploads a file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def live_server(make_pipeline: Callable[..., object], serve_app: Callable[[object], str]) -> str:
    from megalith_qa.server import create_app

    return serve_app(create_app(make_pipeline()))


def test_page_asks_streams_cites_and_uploads(live_server: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    upload = tmp_path / "volcano.md"
    upload.write_text("# Volcanoes\n\nMagma rises through the crater of a volcano.", encoding="utf-8")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            page.goto(live_server + "/")
            page.fill("#question", "What does the pass statement do?")
            page.click("#ask")
            page.wait_for_function("document.getElementById('status').textContent === 'done'")
            assert "The pass statement does nothing." in page.text_content("#answer")
            first_citation = page.locator("#citations li").first.text_content()
            assert first_citation is not None and first_citation.startswith("python.md [")
            page.set_input_files("#file", str(upload))
            page.click("#upload")
            page.wait_for_function(
                "document.getElementById('upload-result').textContent.includes('volcano.md')"
            )
            assert "added" in page.text_content("#upload-result")
            page.wait_for_function("document.getElementById('documents').textContent.includes('volcano.md')")
        finally:
            browser.close()
