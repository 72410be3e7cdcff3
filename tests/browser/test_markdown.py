"""Model output is rendered as markdown and never runs: a stored reply full of HTML and script is shown as
text, and the renderer itself, called in the page, builds only safe nodes (tables and escapes included)."""

from __future__ import annotations

import json

from tests.browser.browser_utils import screenshot

HOSTILE = "\n".join([
    "Here is **bold**, *italic*, `inline <b>code</b>` and a [link](https://example.com/a?b=1&c=2).",
    "<script>window.__pwned = 1</script>",
    '<img src=x onerror="window.__pwned = 2">',
    "[click](javascript:window.__pwned=3) and [data](data:text/html,<script>1</script>)",
    '<a href="javascript:window.__pwned=4">raw anchor</a> <iframe src="javascript:1"></iframe>',
    "",
    "```html",
    "<script>window.__pwned = 5</script>",
    "```",
    "",
    "- one",
    "- two <svg onload=window.__pwned=6>",
    "",
    "> quoted <u>text</u>",
])


def test_hostile_reply_in_storage_is_shown_as_text(open_page, server):
    conversation = {"id": "c1", "title": "<b>title</b>", "created": "2026-01-01T00:00:00Z", "messages": [
        {"role": "user", "content": "<img src=x onerror=window.__pwned=7>"},
        {"role": "assistant", "content": HOSTILE}]}
    page = open_page(server.url + "/")
    page.evaluate("data => { localStorage.setItem('pagedserve.conversations.v1', data);"
                  " localStorage.setItem('pagedserve.current.v1', 'c1'); }", json.dumps([conversation]))
    page.reload()
    page.wait_for_selector(".message.assistant")
    messages = page.locator("#messages")
    assert page.evaluate("window.__pwned") is None
    for tag in ("script", "img", "iframe", "svg", "u", "b"):
        assert messages.locator(tag).count() == 0, tag
    text = messages.text_content()
    assert "<script>window.__pwned = 1</script>" in text and '<img src=x onerror="window.__pwned = 2">' in text
    assert "<img src=x onerror=window.__pwned=7>" in text
    assert page.locator(".conversation .title").text_content() == "<b>title</b>"
    reply = page.locator(".message.assistant .body")
    assert reply.locator("strong").text_content() == "bold" and reply.locator("em").text_content() == "italic"
    assert reply.locator("p code").first.text_content() == "inline <b>code</b>"
    assert reply.locator("pre code").text_content() == "<script>window.__pwned = 5</script>"
    assert reply.locator(".code-lang").text_content() == "html"
    hrefs = reply.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert hrefs == ["https://example.com/a?b=1&c=2"]  # javascript: and data: links stay text
    assert reply.locator("li").count() == 2 and reply.locator("blockquote").text_content() == "quoted <u>text</u>"
    screenshot(page, "markdown-hostile")


RENDER = """inputs => inputs.map(text => {
    const box = document.createElement('div');
    box.append(PagedServe.renderMarkdown(text));
    return box.innerHTML;
})"""


def test_renderer_builds_only_safe_nodes(open_page, server):
    page = open_page(server.url + "/")
    cases = {
        "<script>alert(1)</script>": "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>",
        "a & b < c": "<p>a &amp; b &lt; c</p>",
        "**<i>x</i>**": "<p><strong>&lt;i&gt;x&lt;/i&gt;</strong></p>",
        '[x](https://e.com/"onmouseover="alert(1))': '<p><a href="https://e.com/&quot;onmouseover=&quot;alert(1)" '
                                                    'rel="noopener noreferrer nofollow" target="_blank">x</a></p>',
        # balanced parentheses in a URL (they cut it at the "(", a stray ")" after); an image is a link named by its
        # alt text (was "!" and a link); a URL in a link's text is text (was an <a> inside the <a>)
        "[ok](https://e.com/a_(b))": '<p><a href="https://e.com/a_(b)" rel="noopener noreferrer nofollow" '
                                     'target="_blank">ok</a></p>',
        "![a cat](https://e.com/c.png)": '<p><a href="https://e.com/c.png" rel="noopener noreferrer nofollow" '
                                         'target="_blank">image: a cat</a></p>',
        "[see https://a.e/ **here**](https://b.e/)": '<p><a href="https://b.e/" rel="noopener noreferrer nofollow" '
                                                      'target="_blank">see https://a.e/ <strong>here</strong></a></p>',
        "[x](JavaScript:alert(1))": "<p>[x](JavaScript:alert(1))</p>",
        "see https://e.com/x.": '<p>see <a href="https://e.com/x" rel="noopener noreferrer nofollow" '
                                'target="_blank">https://e.com/x</a>.</p>',
        "## Title <b>": "<h2>Title &lt;b&gt;</h2>",
        "# closed #  ": "<h1>closed</h1>", "## a## ": "<h2>a##</h2>", "### ###": "<h3></h3>",  # closing #s
        "1. one\n2. two": "<ol><li>one</li><li>two</li></ol>",
        "- a\n  - b": "<ul><li><p>a</p><ul><li>b</li></ul></li></ul>",
        "line 1\nline 2": "<p>line 1<br>line 2</p>",
        "---": "<hr>",
        "| a | b |\n|:--|--:|\n| 1 | **2** |": '<div class="table-wrap"><table><thead><tr><th class="align-left">a</th>'
                                               '<th class="align-right">b</th></tr></thead><tbody><tr>'
                                               '<td class="align-left">1</td><td class="align-right"><strong>2'
                                               '</strong></td></tr></tbody></table></div>',
        # no outer pipes, a long row cut and a short one padded to the header's columns, an escaped pipe, the
        # table ended by a line without pipes, which follows as a paragraph
        "x \\| y | z\n:-: | ---\n1 | 2 | 3\n4\nafter": '<div class="table-wrap"><table><thead><tr>'
                                                    '<th class="align-center">x | y</th><th>z</th></tr></thead>'
                                                    '<tbody><tr><td class="align-center">1</td><td>2</td></tr>'
                                                    '</tbody></table></div><p>4<br>after</p>',
        "Columns:\n| a |\n|---|\n| <b> |": '<p>Columns:</p><div class="table-wrap"><table><thead><tr><th>a</th>'
                                           '</tr></thead><tbody><tr><td>&lt;b&gt;</td></tr></tbody></table></div>',
        "a | b\n---": "<p>a | b</p><hr>",  # one delimiter cell for two header cells: no table
        "\\*not italic\\* and \\`not code\\` \\\\ \\q": "<p>*not italic* and `not code` \\ \\q</p>",
        "```\nunclosed <b>": None,  # streaming: an open fence runs to the end
    }
    rendered = page.evaluate(RENDER, list(cases))
    for (source, expected), html in zip(cases.items(), rendered):
        if expected is not None:
            assert html == expected, source
    assert "<pre><code>unclosed &lt;b&gt;</code></pre>" in rendered[-1]
    # Whatever the text, no element that can run code or load anything comes out.
    fuzz = ["<", "<<script>>", "`<img src=x onerror=alert(1)>`", "[a](<javascript:1>)", "*" * 50, "_a_b_",
            "```js\n</code></pre><script>1</script>\n```", "> > <svg/onload=1>", "<style>*{}</style>",
            "| <img src=x onerror=alert(1)> |\n|---|\n| [a](javascript:1) |", "\\<script\\>"]
    counts = page.evaluate("""inputs => inputs.map(text => {
        const box = document.createElement('div');
        box.append(PagedServe.renderMarkdown(text));
        const attrs = [...box.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name));
        return box.querySelectorAll('script,img,iframe,svg,style,object,embed').length
            + attrs.filter(a => a.startsWith('on') || a === 'src' || a === 'style').length;
    })""", fuzz)
    assert counts == [0] * len(fuzz)
    assert page.evaluate("window.__pwned") is None


def test_table_inputs_that_once_hung_or_flooded_the_page(open_page, server):
    """Long runs of spaces under a header line made the delimiter-row regex backtrack quadratically (minutes for
    100k spaces), and a 2000-column header over 5000 short rows built 10 million cells (11 GB in Chromium); the
    heading regex's lazy text before its closing #s backtracked cubically over a run of spaces or tabs in a
    heading (8 s for 4000 spaces, QA-W). The bound below is a hang check (each input renders in milliseconds
    now), not a speed measurement."""
    page = open_page(server.url + "/")
    cases = ["a|b\n" + " " * 100000 + "x", "a|b\n|-" + "\t" * 100000 + "x",
             "|".join(["h"] * 2000) + "\n" + "|".join(["-"] * 2000) + "\n" + "a|\n" * 5000,
             "|".join(["h"] * 64) + "\n" + "|".join(["-"] * 64) + "\n" + "a|\n" * 100,
             "# a" + " " * 20000 + "x", "## Name" + "\t" * 20000 + "Value"]
    results = page.evaluate("""inputs => inputs.map(text => {
        const start = performance.now();
        const box = document.createElement('div');
        box.append(PagedServe.renderMarkdown(text));
        return {ms: performance.now() - start, cells: box.querySelectorAll('td, th').length,
                tables: box.querySelectorAll('table').length};
    })""", cases)
    assert all(r["ms"] < 5000 for r in results), results
    assert [r["tables"] for r in results] == [0, 0, 0, 1, 0, 0]  # 2000 columns: text; 64 columns: a table
    assert results[3]["cells"] == 64 * 101
