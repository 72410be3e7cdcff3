"""The page while the server starts (held in its first phase by a test-only file), and a server behind an API
key and a --root-path prefix."""

from __future__ import annotations

import httpx
import pytest

from tests.browser.browser_utils import SERVER_FLAGS, browser_model, screenshot
from tests.server.server_utils import module_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def held_server(tiny_model_dir, tmp_path_factory):
    hold = tmp_path_factory.mktemp("hold") / "hold"
    hold.touch()
    for server in module_server(browser_model(tiny_model_dir), *SERVER_FLAGS, "--startup-hold-file", str(hold),
                                tmp_path_factory=tmp_path_factory, wait_for_ready=False):
        server.hold = hold
        yield server


def test_page_shows_the_start_up_phase_then_ready(open_page, held_server):
    assert httpx.get(f"{held_server.url}/health").status_code == 503
    page = open_page(held_server.url + "/", allow_statuses=(503,))  # /health answers 503 until ready
    page.wait_for_selector("#startup-banner:not([hidden])")
    assert page.inner_text("#startup-banner").split() == ["The", "server", "is", "starting", "Chat", "opens", "when",
                                                           "the", "model", "is", "ready."]  # not "starting: starting"
    assert page.text_content("#status") == "starting"
    assert page.is_disabled("#send")
    page.click("#tab-dashboard")
    page.wait_for_selector("#startup-card:not([hidden])")
    assert page.text_content("#dash-phase") == "starting" and "since process start" in page.text_content("#dash-elapsed")
    assert page.locator("#dash-phases li").first.text_content().startswith("starting")
    screenshot(page, "startup-held")

    held_server.hold.unlink()  # let the server load the model
    page.wait_for_selector("#status.ready", timeout=60_000)
    assert page.is_hidden("#startup-banner") and page.is_hidden("#startup-card")
    page.wait_for_function("document.getElementById('server-info').textContent.includes('LlamaForCausalLM')")
    page.click("#tab-chat")
    assert page.is_enabled("#send")


def test_progress_of_a_phase(open_page, held_server):
    """What a long weight load looks like: /health as the server answers it then, 43 % into loading_weights."""
    page = open_page(held_server.url + "/", allow_statuses=(503,))
    phases = [{"name": "starting", "started_at_s": 0.1, "duration_s": 1.2},
              {"name": "loading_weights", "started_at_s": 1.3, "duration_s": None}]
    body = {"status": "starting", "phase": "loading_weights", "progress": 0.43, "elapsed_s": 7.5, "phases": phases}
    page.route("**/health", lambda route: route.fulfill(status=503, json=body))
    page.wait_for_function("document.getElementById('startup-phase').textContent === 'loading_weights'")
    assert page.text_content("#startup-progress-text") == "43%"
    assert page.eval_on_selector("#startup-progress", "bar => bar.value") == pytest.approx(0.43)
    assert page.text_content("#status") == "starting: loading_weights 43%"
    page.click("#tab-dashboard")
    assert page.text_content("#dash-progress-text") == "43%"
    assert page.locator("#dash-phases li").all_text_contents() == ["starting 1.20 s", "loading_weights \u2026"]
    screenshot(page, "startup-progress")


@pytest.fixture(scope="module")
def key_server(tiny_model_dir, tmp_path_factory):
    yield from module_server(browser_model(tiny_model_dir), *SERVER_FLAGS, "--api-key", KEY, "--root-path", "/llm",
                             tmp_path_factory=tmp_path_factory)


def test_api_refuses_without_the_key(key_server):
    base = f"{key_server.url}/llm"
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and KEY not in page.text and '<base href="/llm/">' in page.text
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 401
    assert httpx.get(f"{base}/server_info").status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=wrong).status_code == 401
    right = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=right, timeout=30).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # open, as without the prefix
    assert httpx.get(f"{key_server.url}/v1/models", headers=right).status_code == 200  # a proxy that strips /llm


def test_page_asks_for_the_key_and_then_works(open_page, key_server):
    page = open_page(key_server.url + "/llm", allow_statuses=(401,))  # refused until the key is entered
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.evaluate("document.activeElement.id") == "api-key"
    assert page.is_disabled("#send")  # a message sent before the key came back as a 401 reply
    page.keyboard.type("wrong")
    page.keyboard.press("Enter")
    page.wait_for_function("document.getElementById('key-error').textContent.includes('refused')")
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny'")
    assert page.is_hidden("#key-form") and page.is_enabled("#send")
    page.fill("[data-setting=max_tokens]", "12")
    page.fill("#prompt", "Hello")
    with page.expect_request("**/llm/v1/chat/completions") as request:
        page.press("#prompt", "Enter")
    assert request.value.headers["authorization"] == f"Bearer {KEY}"
    page.wait_for_selector("#stop", state="hidden")
    assert "12 tokens" in page.text_content(".message.assistant .stats")
    page.click("#tab-dashboard")
    page.wait_for_function("document.getElementById('server-info').textContent.includes('LlamaForCausalLM')")
    screenshot(page, "api-key-dashboard")
    # The key lives in this tab only (not in localStorage unless asked): a reload keeps working.
    assert page.evaluate("localStorage.getItem('pagedserve.apiKey')") is None
    page.reload()
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny'")
    assert page.is_hidden("#key-form")
