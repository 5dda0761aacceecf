"""A headless Chromium page (Playwright driving the system's ``chromium``)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Page, async_playwright


@contextlib.asynccontextmanager
async def chromium(width: int = 1440, height: int = 900) -> AsyncIterator[Page]:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail(
            "the dashboard test needs chromium (scripts/test installs it: apt-get install chromium)"
        )
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=exe, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            await browser.close()
