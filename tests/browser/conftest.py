"""Real headless Chromium (Debian's `chromium`, driven by playwright's sync API) against live servers.

Each page a test opens records console errors and uncaught page errors; the test fails on any the test
did not declare (a 503 while the server starts, a 401 before the key is entered: the browser logs every
failed response). A screenshot of every page is saved under tests/browser/artifacts/ (git-ignored).
"""

from __future__ import annotations

import pytest

from tests.browser.browser_utils import (CHROMIUM_ARGS, SERVER_FLAGS, PageErrors, browser_model, chromium_path,
                                         screenshot)
from tests.server.server_utils import module_server


@pytest.fixture(scope="package")
def browser():
    """Package-scoped: playwright's sync API keeps an asyncio loop running on this thread while it is open,
    which would break asyncio.run() in the tests that come after these."""
    from playwright.sync_api import sync_playwright  # the `test` extra installs it

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser, request):
    """open_page(url, allow_statuses=(), **context options) -> a page; it must end with no console errors. The page's
    Content-Security-Policy is bypassed (playwright's wait_for_function evaluates strings, which it forbids) but
    where a test gives bypass_csp=False (test_chat.py runs the chat under it)."""
    opened = []

    def open_(url: str, allow_statuses: tuple[int, ...] = (), **options):
        context = browser.new_context(**{"viewport": {"width": 1280, "height": 800}, "bypass_csp": True, **options})
        page = context.new_page()
        errors = PageErrors(set(allow_statuses))
        page.on("console", errors.on_console)
        page.on("pageerror", errors.on_page_error)
        page.errors = errors
        opened.append((context, page))
        page.goto(url)
        return page

    yield open_
    failures = []
    for index, (context, page) in enumerate(opened):
        screenshot(page, f"{request.node.name}-end{index}")
        failures += page.errors.errors
        context.close()
    assert not failures, failures


@pytest.fixture(scope="package")
def server(tiny_model_dir, tmp_path_factory):
    """One plain server for the chat and dashboard modules."""
    yield from module_server(browser_model(tiny_model_dir), *SERVER_FLAGS, tmp_path_factory=tmp_path_factory)

