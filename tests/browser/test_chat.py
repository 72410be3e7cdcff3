"""The chat page in a real browser against a live server on a tiny random model."""

from __future__ import annotations

import json
import time

from tests.browser.browser_utils import metric, screenshot

LONG_REPLY = {"max_tokens": "3500", "extra": '{"ignore_eos": true}'}  # 3-10 s on the tiny model (~1100 tok/s here)


def ready_page(open_page, server, **options):
    page = open_page(server.url + "/", **options)
    page.wait_for_selector("#status.ready")
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny'")
    return page


def set_settings(page, **values):
    for name, value in values.items():
        page.fill(f"[data-setting={name}]", value)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_reply_done(page, timeout=60_000):
    page.wait_for_selector("#stop", state="hidden", timeout=timeout)
    return page.locator(".message.assistant").last


def stored_conversations(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('pagedserve.conversations.v1'))")


def test_reply_streams_into_the_page_and_survives_reload(open_page, server):
    page = ready_page(open_page, server)
    set_settings(page, max_tokens="1000", extra='{"ignore_eos": true}', temperature="0")
    send(page, "Hello there")
    # Streaming: the reply is on the page while the request still runs, then grows to its full length. The partial
    # length is read in the same check that sees the reply pending (a second round trip could come after the end).
    partial = page.wait_for_function("""() => {
        const m = document.querySelector('.message.assistant.pending .body');
        return m && m.textContent.length > 0 ? m.textContent.length : null; }""").json_value()
    reply = wait_reply_done(page)
    text = reply.locator(".body").text_content()
    assert len(text) > partial > 0
    stats = reply.locator(".stats").text_content()
    assert "TTFT" in stats and "tok/s" in stats and "1000 tokens" in stats and "finish: length" in stats, stats
    assert page.locator(".conversation .title[aria-current=true]").text_content() == "Hello there"
    screenshot(page, "chat-reply")

    page.reload()
    page.wait_for_selector("#status.ready")
    messages = page.locator(".message")
    assert messages.count() == 2
    assert messages.nth(0).locator(".body").text_content() == "Hello there"
    assert messages.nth(1).locator(".body").text_content() == text
    assert "1000 tokens" in messages.nth(1).locator(".stats").text_content()


def test_stop_aborts_the_request_and_frees_its_kv_blocks(open_page, server):
    page = ready_page(open_page, server)
    set_settings(page, **LONG_REPLY)
    send(page, "Tell me a long story")
    page.wait_for_function("document.querySelector('.message.assistant.pending .body').textContent.length > 200")
    assert metric(server, "vllm:num_requests_running") == 1
    assert metric(server, "vllm:kv_cache_usage_perc") > 0
    # In another conversation the reply has no Stop (it stopped this one's reply) and Send waits for it.
    page.click("#new-chat")
    assert page.locator("#stop").is_hidden() and page.locator("#send").is_disabled()
    page.click(".conversation .title:has-text('Tell me a long story')")
    assert page.locator(".message.assistant.pending").count() == 1
    page.click("#stop")
    reply = wait_reply_done(page, timeout=10_000)
    assert "stopped" in reply.locator(".stats").text_content()
    deadline = time.monotonic() + 10
    while metric(server, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, 'vllm:request_success_total') >= 1
    stopped_at = len(reply.locator(".body").text_content())
    time.sleep(0.5)
    assert len(reply.locator(".body").text_content()) == stopped_at  # nothing arrives after Stop
    # Escape in the message box stops a reply too. A new conversation, so the prompt does not carry the stopped
    # reply: how long that got depends on the machine's speed, and with it 3500 more tokens may not fit.
    page.click("#new-chat")
    send(page, "Another long one")
    page.wait_for_function("document.querySelector('.message.assistant.pending .body').textContent.length > 50")
    page.press("#prompt", "Escape")
    assert "stopped" in wait_reply_done(page, timeout=10_000).locator(".stats").text_content()
    # ... and wherever the focus is: sent with the mouse, the focus left with the hidden Send button
    page.fill("#prompt", "A third long one")
    page.click("#send")
    page.wait_for_function("document.querySelector('.message.assistant.pending .body').textContent.length > 50")
    page.keyboard.press("Escape")
    assert "stopped" in wait_reply_done(page, timeout=10_000).locator(".stats").text_content()


def test_a_reply_that_cannot_fit_shows_the_servers_error_and_keeps_the_conversation(open_page, server):
    page = ready_page(open_page, server, allow_statuses=(400,))  # the browser logs the refused request
    set_settings(page, max_tokens="5000", extra="")  # more than --max-model-len 4096
    send(page, "Too long a reply")
    reply = wait_reply_done(page)
    error = reply.locator(".error-text").text_content()
    # the page says what to do: here max_tokens is the cause (it blamed the conversation)
    assert "the conversation leaves" in error and "lower max_tokens to at most" in error, error
    assert "start a new chat" not in error
    assert metric(server, "vllm:num_requests_running") == 0
    # The user can lower max_tokens and go on in the same conversation.
    set_settings(page, max_tokens="8")
    send(page, "A short one")
    assert not wait_reply_done(page).locator(".error-text").count()
    assert page.locator(".message.user").count() == 2


def test_regenerate_and_edit_and_resend(open_page, server):
    page = ready_page(open_page, server)
    set_settings(page, max_tokens="24", temperature="0", extra="")
    send(page, "The quick brown fox")
    first = wait_reply_done(page).locator(".body").text_content()
    page.click(".message.assistant .regenerate")
    wait_reply_done(page)
    assert page.locator(".message").count() == 2  # the reply was replaced, not appended
    assert page.locator(".message.assistant .body").text_content() == first  # greedy: the same reply again

    page.click(".message.user button:has-text('Edit')")
    page.fill(".message.user textarea.edit", "Paris is the capital of")
    page.press(".message.user textarea.edit", "Enter")
    wait_reply_done(page)
    assert page.locator(".message").count() == 2
    assert page.locator(".message.user .body").text_content() == "Paris is the capital of"
    stored = stored_conversations(page)[0]["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored[0]["content"] == "Paris is the capital of"
    assert stored[1]["content"] and stored[1]["stats"]["completion_tokens"] <= 24


def test_settings_go_into_the_request(open_page, server):
    page = ready_page(open_page, server)
    page.fill("#set-system", "You answer in JSON.")
    set_settings(page, temperature="0.5", top_p="0.9", max_tokens="16", seed="7", extra='{"top_k": 5}')
    page.check("#set-json")
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "A user record")
    body = json.loads(request.value.post_data)
    assert body["messages"] == [{"role": "system", "content": "You answer in JSON."},
                                {"role": "user", "content": "A user record"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.5, 0.9, 16, 7)
    assert body["response_format"] == {"type": "json_object"} and body["top_k"] == 5
    assert body["stream"] is True and body["model"] == "tiny"
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}  # each choice's count
    reply = wait_reply_done(page)
    assert not reply.locator(".error-text").count(), reply.inner_text()
    assert reply.locator(".body").text_content().lstrip().startswith("{")  # the server's JSON mode
    page.reload()
    assert page.input_value("[data-setting=seed]") == "7" and page.is_checked("#set-json")  # settings are kept


def test_a_fresh_page_leaves_max_tokens_to_the_server(open_page, server):
    """It sent 512, refused outright by a server whose context is 512 tokens."""
    page = ready_page(open_page, server)
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Hi")
    assert "max_tokens" not in json.loads(request.value.post_data)
    page.keyboard.press("Escape")  # stops the reply where it still runs
    wait_reply_done(page)


def test_extra_fields_that_do_not_parse_keep_the_message_in_the_box(open_page, server):
    """The message was taken from the box and dropped (then sent again with the next one, two user turns in a
    row); it now waits there until the fields parse, and the settings say why."""
    page = ready_page(open_page, server)
    set_settings(page, max_tokens="4", extra="{bad")
    send(page, "first")
    assert page.input_value("#prompt") == "first" and page.locator(".message.user").count() == 0
    assert "Extra request fields" in page.text_content("#settings-error")
    set_settings(page, extra="")
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#prompt", "Enter")
    assert json.loads(request.value.post_data)["messages"] == [{"role": "user", "content": "first"}]
    wait_reply_done(page)
    assert page.text_content("#settings-error") == ""
    # not an object ([1, 2] went out as "0": 1, "1": 2), or a field the page's stream needs
    for extra, says in (("[1, 2]", "they must be one JSON object"), ('{"stream": false}', "stream is set by the page")):
        set_settings(page, extra=extra)
        send(page, "third")
        assert page.input_value("#prompt") == "third" and says in page.text_content("#settings-error")
    assert page.locator(".message.user").count() == 1
    # Regenerate and edit-and-resend check the fields before they change anything: they popped the reply or cut
    # the turns after the edited one first, then refused, and the next save kept the loss (QA-W).
    page.fill("#prompt", "")
    page.click(".message.assistant .regenerate")
    page.click(".message.user button:has-text('Edit')")
    page.fill(".message.user textarea.edit", "changed")
    page.press(".message.user textarea.edit", "Enter")
    assert "Extra request fields" in page.text_content("#settings-error")
    page.click(".message.user button:has-text('Cancel')")  # redrawn from the conversation as it is now
    assert page.locator(".message").count() == 2 and page.text_content(".message.user .body") == "first"


def test_a_reply_with_n_choices_shows_the_first_one(open_page, server):
    """extra {"n": 2}: the bubble is choice 0's text (both choices' deltas were interleaved into it)."""
    page = ready_page(open_page, server)
    set_settings(page, max_tokens="12", temperature="0", extra='{"ignore_eos": true}')
    send(page, "Count")
    single = wait_reply_done(page).locator(".body").text_content()
    page.click("#new-chat")
    set_settings(page, extra='{"ignore_eos": true, "n": 2}')
    send(page, "Count")
    reply = wait_reply_done(page)
    assert reply.locator(".body").text_content() == single
    assert "12 tokens" in reply.locator(".stats").text_content()  # the first choice's, not 24 (both choices')


def test_conversations_new_rename_delete_export(open_page, server):
    page = ready_page(open_page, server)
    set_settings(page, max_tokens="8", extra="")
    send(page, "first conversation")
    wait_reply_done(page)
    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.locator(".conversation").count() == 2
    send(page, "second conversation")
    wait_reply_done(page)
    # Rename the current one (the first in the list): Enter keeps the new title.
    page.click(".conversation >> nth=0 >> .rename")
    page.fill(".rename-input", "Renamed 聊天")
    page.press(".rename-input", "Enter")
    assert page.locator(".conversation .title").all_text_contents() == ["Renamed 聊天", "first conversation"]
    assert page.evaluate("document.activeElement.textContent") == "Renamed 聊天"  # not the page's body
    page.click(".conversation >> nth=0 >> .rename")  # Esc keeps the old title (the input's blur saved the new)
    page.fill(".rename-input", "Not this")
    page.press(".rename-input", "Escape")
    assert page.locator(".conversation .title").all_text_contents() == ["Renamed 聊天", "first conversation"]
    with page.expect_download() as download:
        page.click("#export-chat")
    exported = json.loads(open(download.value.path()).read())
    assert exported["title"] == "Renamed 聊天"
    assert download.value.suggested_filename == "Renamed_聊天.json"  # any script's letters kept (was "Renamed_.json")
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][0]["content"] == "second conversation"
    page.click(".conversation >> nth=0 >> .delete")
    assert page.locator(".conversation .title").all_text_contents() == ["first conversation"]
    assert page.locator(".message.user .body").text_content() == "first conversation"
    assert [c["title"] for c in stored_conversations(page)] == ["first conversation"]


def test_keyboard_shift_enter_adds_a_line_and_phone_width(open_page, server):
    page = ready_page(open_page, server, viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    set_settings_closed = not page.evaluate("document.getElementById('settings').open")
    assert set_settings_closed  # on a phone the settings start folded
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")  # no sideways scrolling
    page.click("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two" and page.locator(".message").count() == 0
    page.click("#toggle-sidebar")
    assert page.is_visible("#new-chat")
    page.click("#toggle-sidebar")
    page.focus("#prompt")
    page.keyboard.press("Enter")
    page.wait_for_selector(".message.user")
    assert page.locator(".message.user .body").text_content() == "line one\nline two"
    wait_reply_done(page)
    screenshot(page, "chat-phone")


def test_the_chat_runs_under_the_page_s_own_content_security_policy(open_page, server):
    """No inline script, eval or other origin: under its CSP (no bypass) the page loads, streams a reply and
    renders it, with no console error (the fixture fails on any)."""
    page = open_page(server.url + "/", bypass_csp=False)
    page.wait_for_selector("#status.ready")
    page.locator("#model-name", has_text="tiny").wait_for()
    set_settings(page, max_tokens="40", temperature="0", extra='{"ignore_eos": true}')
    send(page, "Hello under CSP")
    reply = wait_reply_done(page)
    assert reply.locator(".body").text_content() and "40 tokens" in reply.locator(".stats").text_content()


def test_a_reply_nested_past_the_renderer_s_depth_and_a_full_storage_leave_the_page_working(open_page, server):
    """">" x 12000 overflowed the markdown renderer's stack and left the reply pending for good; a full localStorage
    threw out of the reply and froze it. Now deep nesting renders as text and a full storage is said."""
    page = ready_page(open_page, server)
    fragment = page.evaluate("PagedServe.renderMarkdown('>'.repeat(12000) + ' deep').textContent")
    assert fragment.endswith("deep")
    page.evaluate("""() => {  // leave no room in localStorage (Chromium: ~5 M characters per origin)
        let size = 1 << 22;
        for (let i = 0; size > 16; i++) {
            try { localStorage.setItem('filler' + i, 'x'.repeat(size)); } catch (_) { size >>= 1; i--; }
        } }""")
    set_settings(page, max_tokens="20", temperature="0")
    send(page, "still working?")
    reply = wait_reply_done(page)
    assert "20 tokens" in reply.locator(".stats").text_content()
    assert "storage is full" in page.locator("#chat-error").text_content()
    page.evaluate("Object.keys(localStorage).filter(k => k.startsWith('filler'))"
                  ".forEach(k => localStorage.removeItem(k))")


def test_stored_data_of_another_shape_is_left_out_and_said(open_page, server):
    """Valid JSON of the wrong shape in storage (an object, null entries, a conversation without messages; a null
    system prompt, a number for the extra fields) threw at start-up, or blocked every send, with nothing shown."""
    page = open_page(server.url + "/")
    page.evaluate("""() => {
        localStorage.setItem('pagedserve.conversations.v1', JSON.stringify(
            [null, {id: 'x', title: 't'}, {id: 'ok', title: 5, messages: [{role: 'user', content: 'kept'}]}]));
        localStorage.setItem('pagedserve.settings.v1', JSON.stringify({system: null, extra: 5, max_tokens: '6'}));
    }""")
    page.reload()
    page.wait_for_selector("#status.ready")
    assert "2 stored conversations could not be read" in page.text_content("#chat-error")
    assert page.locator(".conversation").count() == 1 and page.text_content(".conversation .title") == "Untitled"
    assert page.input_value("[data-setting=max_tokens]") == "6" and page.input_value("[data-setting=extra]") == ""
    page.click("#new-chat")
    send(page, "still works")
    assert "6 tokens" in wait_reply_done(page).locator(".stats").text_content()
    page.evaluate("localStorage.setItem('pagedserve.conversations.v1', '{\"a\": 1}')")
    page.reload()
    page.wait_for_selector("#status.ready")
    assert "A stored conversation could not be read" in page.text_content("#chat-error")
    send(page, "and again")
    wait_reply_done(page)
    assert [c["title"] for c in stored_conversations(page)] == ["and again"]


def test_new_chat_opens_an_empty_conversation_beside_another_tab_s(open_page, server):
    """A tab on an empty conversation took the first in the list for "+ New chat", which was the other tab's
    conversation (another tab's come first): its next message went into that one (QA-W)."""
    page = ready_page(open_page, server)
    other = second_tab(page)
    set_settings(page, max_tokens="4", temperature="0")
    send(page, "from tab A")
    wait_reply_done(page)
    other.wait_for_selector(".conversation .title:has-text('from tab A')")
    other.click("#new-chat")
    assert other.locator(".message").count() == 0
    send(other, "from tab B")
    wait_reply_done(other)
    titles = {c["title"]: len(c["messages"]) for c in stored_conversations(other)}
    assert titles == {"from tab A": 2, "from tab B": 2}
    other.close()


def test_a_failed_turn_does_not_spoil_the_conversation(open_page, server):
    """A failed reply leaves its user message; the next one goes out joined to it, so the roles still alternate (a
    template that requires it refused every later turn)."""
    page = ready_page(open_page, server, allow_statuses=(400,))
    set_settings(page, max_tokens="5", temperature="-1")  # a 400
    send(page, "first")
    wait_reply_done(page)
    set_settings(page, temperature="0")
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "second")
    wait_reply_done(page)
    assert json.loads(request.value.post_data)["messages"] == [{"role": "user", "content": "first\n\nsecond"}]


def second_tab(page):
    """Another tab of the same browser (the same localStorage), its console errors recorded with the first's."""
    other = page.context.new_page()
    other.on("console", page.errors.on_console)
    other.on("pageerror", page.errors.on_page_error)
    other.goto(page.url)
    other.wait_for_selector("#status.ready")
    return other


def test_two_tabs_on_one_conversation_keep_the_reply_and_the_settings(open_page, server):
    """Each tab wrote its whole copy of the conversations: a reply streaming in one tab was saved empty by the other,
    which sent its own turn under it, and both stayed pending for good; settings changed in one tab were written
    back over by the other."""
    page = ready_page(open_page, server)
    other = second_tab(page)
    set_settings(page, max_tokens="2000", extra='{"ignore_eos": true}')  # room left for one more turn
    assert other.input_value("[data-setting=max_tokens]") == "2000"
    send(page, "from tab A")
    other.click(".conversation .title:has-text('from tab A')")  # the conversation comes over, and is opened
    other.wait_for_selector(".message.assistant.pending")  # shown as being written elsewhere
    send(other, "from tab B")  # refused while the other tab writes in this conversation, and said why
    assert other.input_value("#prompt") == "from tab B" and "Another tab" in other.text_content("#chat-error")
    reply = wait_reply_done(page).locator(".body").text_content()
    other.wait_for_selector(".message.assistant.pending", state="detached", timeout=10_000)
    assert other.locator(".message.assistant .body").text_content() == reply  # the whole reply, in both tabs
    stored = next(c for c in stored_conversations(page) if c["title"] == "from tab A")["messages"]
    assert page.evaluate("text => PagedServe.renderMarkdown(text).textContent", stored[1]["content"]) == reply
    assert not stored[1].get("pending") and "note" not in stored[1]
    set_settings(other, max_tokens="7", extra="")  # settings follow from tab to tab
    page.wait_for_function("document.querySelector('[data-setting=max_tokens]').value === '7'")
    send(other, "from tab B")
    wait_reply_done(other)
    page.wait_for_function("document.querySelectorAll('.message').length === 4")
    other.close()


def test_a_reload_mid_reply_keeps_what_was_shown(open_page, server):
    """The reply was saved once a second, so a reload lost up to a second of text already on the page."""
    page = ready_page(open_page, server)
    set_settings(page, **LONG_REPLY)
    send(page, "Keep me")
    shown = page.wait_for_function("""() => {
        const m = document.querySelector('.message.assistant.pending .body');
        return m && m.textContent.length > 300 ? m.textContent : null; }""").json_value()
    page.reload()
    page.wait_for_selector("#status.ready")
    kept = page.locator(".message.assistant .body").text_content()
    assert kept.startswith(shown) or len(kept) >= len(shown), (len(shown), len(kept))
    assert "interrupted" in page.locator(".message.assistant .stats").text_content()


def test_a_stream_cut_before_its_end_and_a_lost_connection_are_said(open_page, server):
    """A stream closed without [DONE] or a finish_reason looked like a whole reply; a dropped connection said
    only "network error"."""
    page = ready_page(open_page, server)
    chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "The answer is forty"}}]})
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=f"data: {chunk}\n\n"))
    send(page, "cut")
    reply = wait_reply_done(page)
    assert reply.locator(".body").text_content() == "The answer is forty"
    assert "incomplete: the connection closed before the reply ended" in reply.locator(".stats").text_content()
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))
    send(page, "dropped")
    error = wait_reply_done(page).locator(".error-text").text_content()
    assert error.startswith("The connection to the server was lost"), error
    page.errors.errors = [e for e in page.errors.errors if "ERR_CONNECTION_RESET" not in e]


def test_a_thinking_model_s_reasoning_is_folded_above_the_reply(open_page, server):
    """A server with --reasoning-parser streams `reasoning` deltas before the content (tests/server/
    test_reasoning_api.py); here the server's stream is replaced by such a one, as the page reads it."""
    page = ready_page(open_page, server)
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
    deltas = [{"role": "assistant", "content": ""}, {"reasoning": "Let me", "reasoning_content": "Let me"},
              {"reasoning": " think.\nFrance", "reasoning_content": " think.\nFrance"}, {"content": "**Paris**"}]
    events = [{**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events.append({**chunk, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=body))
    send(page, "The capital of France?")
    reply = wait_reply_done(page)
    assert reply.locator("details.reasoning summary").text_content() == "Reasoning"
    assert reply.locator("details.reasoning .reasoning-text").text_content() == "Let me think.\nFrance"
    assert reply.locator(".body strong").text_content() == "Paris"  # the content, as markdown, after the fold
    assert "finish: stop" in reply.locator(".stats").text_content()
    screenshot(page, "chat-reasoning")
    page.reload()
    page.wait_for_selector("#status.ready")
    stored = page.locator(".message.assistant").last
    assert stored.locator("details.reasoning").get_attribute("open") is None  # a finished reply's is folded
    assert stored.locator(".reasoning-text").text_content() == "Let me think.\nFrance"
    assert stored_conversations(page)[0]["messages"][1]["reasoning"] == "Let me think.\nFrance"
    with page.expect_download() as download:
        page.click("#export-chat")
    exported = json.loads(open(download.value.path()).read())
    assert exported["messages"][1]["reasoning"] == "Let me think.\nFrance"
    assert "reasoning" not in exported["messages"][0]  # JSON.stringify leaves out what a message has not
