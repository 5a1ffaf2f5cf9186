"""The browser client in a real Chromium (Debian's, driven by Playwright) against a ``pocketllm host``.

Screenshots go to each test's ``tmp_path``, or under ``$POCKETLLM_TEST_ARTIFACTS/web-client/<test>/`` when that
is set. The layout test runs at a desktop (1280x800) and a phone (390x844) size.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import threading

import pytest
from harness_utils import HostProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "web-test-token"
WEB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pocketllm", "harness", "web")
WAIT_MS = 90_000
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script> **bold** [bad](javascript:window.__xss=3)'
SIZES = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}
# An answer with the markup people meet first: a table (with markup and HTML in cells), a quote, nested lists and
# a code block.
MARKDOWN = """Here is a summary:

| Model | Size | Speed |
|:------|-----:|:-----:|
| **Smol** | 135M | fast |
| `big` \\| model | 7B | slow <img src=x onerror="window.__xss=4"> |

> A quote with *emphasis*
> - and a list in it

1. First step
   - detail a
   - detail b
2. Second step

```python
print("<b>hi</b>")
```
"""
CODE = 'print("<b>hi</b>")'
# navigator.clipboard as the copy button sees it; the text written is kept for the test.
CLIPBOARD_STUB = """Object.defineProperty(navigator, "clipboard", {configurable: true, value: {
    writeText: (text) => { window.__copied = text; return Promise.resolve(); }}});"""
# Elements and attributes the renderer may write (see markdown.js); anything else in its output is a bug.
ALLOWED_TAGS = {"p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "strong", "em", "del", "code", "pre",
                "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td"}
HOSTILE = [
    XSS,
    '| a | b |\n|---|---|\n| <script>window.__xss=5</script> | [x](javascript:window.__xss=6) |',
    '> <svg onload="window.__xss=7">\n> - <iframe src="javascript:window.__xss=8">',
    '1. [a](http://x/"onclick="window.__xss=9)\n   - <a href="javascript:window.__xss=10">b</a>',
    '```"><img src=x onerror="window.__xss=11">\n<style>*{display:none}</style>\n```',
    '**<b onmouseover="window.__xss=12">bold</b>** `<img src=x>` _[y](data:text/html,<script>)_',
    '![img](http://x/a.png) <http://x/> &lt;script&gt; &amp;lt;',
]

if not os.path.exists(CHROMIUM):
    pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (apt-get install -y chromium); "
                "the browser test needs it", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")


@pytest.fixture
def artifacts(request, tmp_path) -> str:
    root = os.environ.get("POCKETLLM_TEST_ARTIFACTS")
    if not root:
        return str(tmp_path)
    path = os.path.join(root, "web-client", re.sub(r"[^\w.-]+", "_", request.node.name))
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


def start_host(model: str, port: int | None = None) -> HostProcess:
    host = HostProcess("--model", model, "--ctx", "1024", token=TOKEN, port=port)
    try:
        host.wait_ready()
    except BaseException:
        host.stop()
        raise
    return host


class SharedHost:
    """One host for the module's tests; a test may restart it (on the same port)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.process = start_host(model)

    @property
    def port(self) -> int:
        return self.process.port

    def restart(self) -> None:
        self.process = start_host(self.model, port=self.process.port)


@pytest.fixture(scope="module")
def host(model):
    shared = SharedHost(model)
    try:
        yield shared
    finally:
        shared.process.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def assistant_messages(page):
    return page.locator("#messages .message.assistant")


def wait_finished(page, index: int) -> str:
    """Wait until assistant message ``index`` of the open conversation has a finish; returns it."""
    message = assistant_messages(page).nth(index)
    sync_api.expect(message).not_to_have_attribute("data-finish", "", timeout=WAIT_MS)
    return message.get_attribute("data-finish")


def send(page, text: str, n: int | None = None) -> None:
    page.fill("#opt-n", "" if n is None else str(n))
    page.fill("#input", text)
    page.press("#input", "Enter")


def inject_into_next_answer(page) -> dict:
    """Relay the page's WebSocket; ``inject["text"]``, once set, goes before the next chunk the host sends."""
    inject: dict = {"text": None}

    def relay(route):
        server = route.connect_to_server()

        def to_page(message):
            if isinstance(message, str) and inject["text"] is not None:
                data = json.loads(message)
                if "chunk" in data:
                    message = json.dumps({**data, "chunk": inject["text"] + "\n\n" + data["chunk"]})
                    inject["text"] = None
            route.send(message)

        route.on_message(lambda message: server.send(message))
        server.on_message(to_page)

    page.route_web_socket(re.compile(".*"), relay)
    return inject


def box_of(page, selector: str) -> dict:
    box = page.locator(selector).bounding_box()
    assert box is not None, f"{selector} is not laid out"
    return box


def assert_within(page, selector: str, width: int) -> None:
    box = box_of(page, selector)
    assert box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5, (selector, box)


def test_markdown_renderer_escapes_before_formatting(browser):
    page = browser.new_page()
    try:
        page.set_content("<!doctype html><title>renderer</title>")
        page.add_script_tag(path=os.path.join(WEB_DIR, "markdown.js"))
        cases = {
            "**bold** and *it* and `a<b>`": "<p><strong>bold</strong> and <em>it</em> and <code>a&lt;b&gt;</code></p>",
            "<img src=x onerror=alert(1)>": "<p>&lt;img src=x onerror=alert(1)&gt;</p>",
            "[x](javascript:alert`1`)": "<p>x</p>",
            "[x](JavaScript:alert(1))": "<p>[x](JavaScript:alert(1))</p>",
            '[x](http://a.example/"onmouseover="alert)': '<p><a href="http://a.example/&quot;onmouseover=&quot;alert" '
                                                         'rel="noopener noreferrer nofollow" target="_blank">x</a></p>',
            "[ok](https://example.org/a?b=1&c=2)": '<p><a href="https://example.org/a?b=1&amp;c=2" '
                                                   'rel="noopener noreferrer nofollow" target="_blank">ok</a></p>',
            "```html\n<script>alert(1)</script>\n```": '<pre><code class="lang-html">&lt;script&gt;alert(1)'
                                                       "&lt;/script&gt;</code></pre>",
            "# Title\n- one\n- two": "<h1>Title</h1>\n<ul><li>one</li><li>two</li></ul>",
            "a __b__ c snake__case__name": "<p>a <strong>b</strong> c snake__case__name</p>",
            "| a | b |\n|:--|--:|\n| **x** | `y|z` |\n| 1 \\| 2 | <i>3</i> |\n\nafter":
                '<table><thead><tr><th class="align-left">a</th><th class="align-right">b</th></tr></thead>'
                '<tbody><tr><td class="align-left"><strong>x</strong></td><td class="align-right"><code>y|z</code>'
                '</td></tr><tr><td class="align-left">1 | 2</td><td class="align-right">&lt;i&gt;3&lt;/i&gt;</td>'
                "</tr></tbody></table>\n<p>after</p>",
            "a | b\nnot a table": "<p>a | b<br>not a table</p>",
            "> quote *it*\n> > nested\n> - item\n\nout": "<blockquote><p>quote <em>it</em></p>\n<blockquote><p>nested"
                                                       "</p></blockquote>\n<ul><li>item</li></ul></blockquote>\n<p>out</p>",
            "1. first\n   - sub a\n   - sub b\n     1. deep\n2. second\n\n3. third":
                "<ol><li>first\n<ul><li>sub a</li><li>sub b\n<ol><li>deep</li></ol></li></ul></li><li>second</li>"
                "<li>third</li></ol>",
            "3. three\n4. four": '<ol start="3"><li>three</li><li>four</li></ol>',
            "- a\n\n  more of a\n- b": "<ul><li><p>a</p>\n<p>more of a</p></li><li>b</li></ul>",
            "1. Run:\n   ```sh\n   ls\n   ```\n2. Done": '<ol><li>Run:\n<pre><code class="lang-sh">ls</code></pre></li>'
                                                   "<li>Done</li></ol>",
            "***a*** *a **b** c* 2*3*4 ~~d~~ \\*e\\*": "<p><em><strong>a</strong></em> <em>a <strong>b</strong> c</em> "
                                                   "2*3*4 <del>d</del> *e*</p>",
        }
        for source, expected in cases.items():
            assert page.evaluate("s => PocketMarkdown.renderMarkdown(s)", source) == expected, source
        # The renderer builds nodes; whatever the input, only its own elements and attributes come out.
        found = page.evaluate("""sources => sources.map((source) => {
            const fragment = PocketMarkdown.render(source);
            const box = document.createElement("div");
            box.append(fragment);
            return {fragment: fragment instanceof DocumentFragment,
                    elements: [...box.querySelectorAll("*")].map((el) => [el.localName,
                               [...el.attributes].map((a) => [a.name, a.value])])};
        })""", HOSTILE)
        for source, result in zip(HOSTILE, found):
            assert result["fragment"], source
            for tag, attributes in result["elements"]:
                assert tag in ALLOWED_TAGS, (source, tag)
                for name, value in attributes:
                    if name == "href":
                        assert tag == "a" and re.match(r"(https?://|mailto:)\S+$", value, re.I), (source, value)
                    elif name == "class":
                        assert re.fullmatch(r"lang-[\w+-]+|align-(left|right|center)", value), (source, value)
                    elif name == "start":
                        assert tag == "ol" and value.isdigit(), (source, value)
                    else:
                        assert (tag, name) in {("a", "rel"), ("a", "target")}, (source, tag, name)
        assert page.evaluate("window.__xss") is None
        # Answers are rendered again on every chunk: a line of unmatched openers must not cost quadratic time
        # (60 kB of them took 20 s before the renderer remembered failed searches).
        elapsed_ms = page.evaluate("""() => {
            const started = performance.now();
            for (const piece of ["*a ", "_a ", "**a ", "~~a ", "`a ", "[a "]) {
                PocketMarkdown.render(piece.repeat(20000));
            }
            return performance.now() - started;
        }""")
        assert elapsed_ms < 5000, elapsed_ms
    finally:
        page.close()


def test_model_text_is_never_parsed_as_html():
    """The client's scripts put no HTML into the page (model text goes through DOM nodes only)."""
    for name in ("app.js", "markdown.js"):
        with open(os.path.join(WEB_DIR, name), encoding="utf-8") as handle:
            source = handle.read()
        assert not re.search(r"(inner|outer)HTML\s*(\+?=)(?!=)|insertAdjacentHTML|document\.write|"
                             r"createContextualFragment|DOMParser|\beval\(|new Function", source), name


@pytest.mark.parametrize("size", list(SIZES))
def test_layout_and_rendering(browser, host, size, artifacts):
    """What a first visit looks like, on a desktop and on a phone: signed in by the link's token, the model's
    name in the header, the conversation list and the text box usable, an answer's markdown rendered (tables,
    quotes, nested lists, code with a copy button) and its timings in seconds and tokens per second."""
    phone = size == "phone"
    width = SIZES[size]["width"]
    context = browser.new_context(viewport=SIZES[size], is_mobile=phone, has_touch=phone)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.add_init_script(CLIPBOARD_STUB)
    inject = inject_into_next_answer(page)
    shot = 0

    def screenshot(name: str) -> None:
        nonlocal shot
        shot += 1
        page.screenshot(path=os.path.join(artifacts, f"{size}-{shot:02d}-{name}.png"))

    try:
        # --- the link the host prints signs in; the token leaves the address bar ----------------------------
        page.goto(f"http://127.0.0.1:{host.port}/#token={TOKEN}")
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        assert page.locator("#login").is_hidden()
        assert TOKEN not in page.url and page.evaluate("location.hash") == ""
        assert page.evaluate("localStorage.getItem('pocketllm.token')") == TOKEN   # a reload stays signed in

        # --- the header names the model, not its path ------------------------------------------------------
        model_name = page.locator("#model").inner_text()
        assert model_name == os.path.basename(host.model.rstrip("/")) and "/" not in model_name
        for selector in ("#sidebar-toggle", "#status", "#model", "#diag-toggle", "#forget-token"):
            assert_within(page, selector, width)
        page.fill("#opt-temp", "0")

        # --- the conversation list: a column on the desktop, a drawer on the phone -------------------------
        sidebar, toggle = page.locator("#sidebar"), page.locator("#sidebar-toggle")
        if phone:
            assert sidebar.is_hidden()
            sync_api.expect(toggle).to_have_attribute("aria-expanded", "false")
            screenshot("start")
            toggle.click()
            sync_api.expect(sidebar).to_be_visible()
            sync_api.expect(toggle).to_have_attribute("aria-expanded", "true")
            assert_within(page, "#sidebar", width)
            assert box_of(page, "#sidebar")["width"] <= 0.9 * width
            screenshot("drawer")
            page.click("#new-conv")
            sync_api.expect(sidebar).to_be_hidden()   # choosing closes the drawer
        else:
            sync_api.expect(sidebar).to_be_visible()
            sync_api.expect(toggle).to_have_attribute("aria-expanded", "true")
            toggle.click()
            sync_api.expect(sidebar).to_be_hidden()
            toggle.click()
            sync_api.expect(sidebar).to_be_visible()
            page.click("#new-conv")
            sync_api.expect(sidebar).to_be_visible()   # the column stays

        # --- the composer keeps a usable text box ------------------------------------------------------------
        assert box_of(page, "#input")["width"] >= (250 if phone else 600)
        for selector in ("#input", "#send", "#stop", "#opt-n", "#opt-temp"):
            assert_within(page, selector, width)
        assert page.evaluate("document.documentElement.scrollWidth") <= width

        # --- an answer with markdown ---------------------------------------------------------------------------
        inject["text"] = MARKDOWN
        send(page, "Show me a table", n=8)
        assert wait_finished(page, 0) == "budget"
        assert inject["text"] is None
        body = assistant_messages(page).nth(0).locator(".body")
        table = body.locator("table")
        sync_api.expect(table).to_have_count(1)
        assert table.locator("thead th").all_inner_texts() == ["Model", "Size", "Speed"]
        rows = [row.locator("td").all_inner_texts() for row in table.locator("tbody tr").all()]
        assert rows == [["Smol", "135M", "fast"], ["big | model", "7B", 'slow <img src=x onerror="window.__xss=4">']]
        assert table.locator("tbody tr").first.locator("td").first.locator("strong").inner_text() == "Smol"
        assert table.locator("tbody tr").first.locator("td").nth(1).evaluate("e => getComputedStyle(e).textAlign") \
            == "right"
        quote = body.locator("blockquote")
        assert quote.locator("em").inner_text() == "emphasis"
        assert quote.locator("li").all_inner_texts() == ["and a list in it"]
        steps = body.locator(":scope > ol > li")
        sync_api.expect(steps).to_have_count(2)
        assert steps.nth(0).locator(":scope > ul > li").all_inner_texts() == ["detail a", "detail b"]
        assert steps.nth(1).inner_text() == "Second step"
        assert body.locator("pre code").first.inner_text() == CODE
        assert page.locator("#messages img, #messages script, #messages a[href^='javascript']").count() == 0
        assert page.evaluate("window.__xss") is None

        # --- the code block's copy button ----------------------------------------------------------------------
        copy = body.locator(".codeblock button.copy")
        sync_api.expect(copy).to_have_count(1)
        assert_within(page, ".codeblock button.copy", width)
        copy.click()
        sync_api.expect(copy).to_have_text("Copied")
        assert page.evaluate("window.__copied") == CODE

        # --- timings in seconds and tokens per second ----------------------------------------------------------
        meta = assistant_messages(page).nth(0).locator(".meta").inner_text()
        assert re.search(r"\b\d+(\.\d+)? s\b", meta) and re.search(r"\b\d+(\.\d+)? tok/s\b", meta), meta
        assert " ms" not in meta and not re.search(r"\d\.\d{3}", meta), meta

        # --- nothing is wider than the screen --------------------------------------------------------------------
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        assert_within(page, "#messages .message.assistant", width)
        table_box, message_box = box_of(page, "#messages table"), box_of(page, "#messages .message.assistant")
        assert table_box["x"] + table_box["width"] <= message_box["x"] + message_box["width"] + 0.5
        screenshot("answer")
        if phone:   # the drawer lists the conversation; picking it closes the drawer
            toggle.click()
            sync_api.expect(page.locator("#conv-list li")).to_have_count(1)
            sync_api.expect(page.locator("#conv-list li .title")).to_have_text("Show me a table")
            screenshot("drawer-with-conversation")
            page.locator("#conv-list li .title").click()
            sync_api.expect(sidebar).to_be_hidden()
        page.check("#diag-toggle")   # the diagnostics panel: beside the chat, or under it on the phone
        send(page, "And now?", n=3)
        wait_finished(page, 1)
        sync_api.expect(page.locator("#diag-body")).to_contain_text('"route"')
        height = SIZES[size]["height"]
        diag, messages = box_of(page, "#diag"), box_of(page, "#messages")
        assert diag["height"] >= 150 and diag["y"] + diag["height"] <= height + 0.5, diag
        assert messages["height"] >= 200, messages
        assert box_of(page, "#input")["width"] >= (250 if phone else 400)
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        screenshot("diagnostics")
        assert errors == []
    finally:
        context.close()


def test_browser_client_end_to_end(browser, host, artifacts):
    context = browser.new_context()
    page = context.new_page()
    frames: list[dict] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    try:
        # --- a link with a wrong token shows the prompt and its error -----------------------------------------
        page.goto(f"http://127.0.0.1:{host.port}/#token=wrong")
        sync_api.expect(page.locator("#login-error")).to_contain_text("wrong token", timeout=WAIT_MS)
        assert page.evaluate("location.hash") == ""

        # --- token prompt: a wrong token is refused, the right one opens the app ---------------------
        sync_api.expect(page.locator("#login")).to_be_visible()
        page.fill("#token", "wrong")
        page.click("#login-button")
        sync_api.expect(page.locator("#login-error")).to_contain_text("wrong token", timeout=WAIT_MS)
        page.fill("#token", TOKEN)
        page.click("#login-button")
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        page.fill("#opt-temp", "0")

        # --- a first conversation: the answer streams in, chunk by chunk -------------------------------
        page.click("#new-conv")
        page.evaluate("""() => {
            window.__lengths = [];
            new MutationObserver(() => {
                const last = [...document.querySelectorAll('#messages .message.assistant .body')].pop();
                if (last) window.__lengths.push(last.textContent.length);
            }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
        }""")
        send(page, "Hello there", n=24)
        assert wait_finished(page, 0) == "budget"
        lengths = [x for x in page.evaluate("window.__lengths") if x > 0]
        assert len(set(lengths)) >= 3, lengths   # rendered progressively, not all at once
        assert sum(1 for f in frames if "chunk" in f) >= 3
        first_answer = assistant_messages(page).nth(0).inner_text()
        page.screenshot(path=os.path.join(artifacts, "01-streamed.png"))

        # --- a second conversation on its own session; stop a long answer ------------------------------
        page.click("#new-conv")
        send(page, "Tell me a long story", n=900)
        sync_api.expect(assistant_messages(page).nth(0).locator(".body")).not_to_be_empty(timeout=WAIT_MS)
        page.click("#stop")
        assert wait_finished(page, 0) == "cancel"
        page.screenshot(path=os.path.join(artifacts, "02-stopped.png"))
        assert [f["finish"] for f in frames if f.get("done")] == ["budget", "cancel"]

        # --- the diagnostics panel, opt-in --------------------------------------------------------------
        assert page.locator("#diag").is_hidden()
        page.check("#diag-toggle")
        send(page, "One more", n=6)
        wait_finished(page, 1)
        sync_api.expect(page.locator("#diag-body")).to_contain_text('"route"', timeout=WAIT_MS)
        sync_api.expect(page.locator("#diag-body")).to_contain_text('"prefill"')
        diag = json.loads(page.locator("#diag-body").inner_text())
        assert diag["diag"]["prefill"]["cached_tokens"] > 0   # the conversation's earlier turn was cached
        page.screenshot(path=os.path.join(artifacts, "03-diagnostics.png"))

        # --- a reload loses nothing ------------------------------------------------------------------------
        page.reload()
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        sync_api.expect(page.locator("#conv-list li")).to_have_count(2)
        page.locator("#conv-list li .title").nth(1).click()
        assert assistant_messages(page).nth(0).inner_text() == first_answer
        page.screenshot(path=os.path.join(artifacts, "04-reloaded.png"))

        # --- the host restarts; the client reconnects and the conversation goes on -------------------------
        assert host.process.stop() == 0
        sync_api.expect(page.locator("#status")).not_to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        host.restart()
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        send(page, "Still there?", n=5)
        assert wait_finished(page, 1) == "budget"
        assert assistant_messages(page).nth(0).inner_text() == first_answer
        diag = json.loads(page.locator("#diag-body").inner_text())
        # The new host got the conversation so far from the browser: the prompt holds both turns.
        assert diag["usage"]["prompt_tokens"] > 30
        page.screenshot(path=os.path.join(artifacts, "05-after-restart.png"))

        # --- model text with markup is shown, never run ----------------------------------------------------
        inject = inject_into_next_answer(page)
        page.reload()
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        inject["text"] = XSS
        send(page, "Show me some markup", n=4)
        wait_finished(page, 2)
        assert inject["text"] is None
        body = assistant_messages(page).nth(2).locator(".body")
        assert "<img src=x" in body.inner_text() and "<script>" in body.inner_text()
        assert body.locator("strong").inner_text() == "bold"
        assert page.locator("#messages img, #messages script, #messages a[href^='javascript']").count() == 0
        assert page.evaluate("window.__xss") is None
        page.screenshot(path=os.path.join(artifacts, "06-markup-escaped.png"))

        # --- signed out, a link with the token opened in the same tab signs in again, without a reload -------
        page.click("#forget-token")
        sync_api.expect(page.locator("#login")).to_be_visible()
        page.evaluate("token => { location.hash = 'token=' + encodeURIComponent(token); }", TOKEN)
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        assert page.locator("#login").is_hidden() and page.evaluate("location.hash") == ""
        sync_api.expect(page.locator("#conv-list li")).to_have_count(2)
    finally:
        context.close()


@pytest.fixture(scope="module")
def static_client():
    """The client's files over plain HTTP, no host behind them (its WebSocket finds no one: these tests look at
    what the page makes of its own localStorage)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=WEB_DIR))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


STORE_KEY = "pocketllm.conversations.v1"
KEPT = {"id": "wkept", "title": "kept", "created": 1,
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}


@contextlib.contextmanager
def _page_with_store(browser, url: str, stored: str):
    """(context, page): a page of a fresh context whose localStorage holds ``stored`` (and a token) before the
    client starts. On leaving, the page must have raised no error; the context is closed."""
    context = browser.new_context()
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.add_init_script(f"if (!sessionStorage.getItem('seeded')) {{ sessionStorage.setItem('seeded', '1'); "
                             f"localStorage.setItem({json.dumps(STORE_KEY)}, {json.dumps(stored)}); "
                             "localStorage.setItem('pocketllm.token', 't'); }")
        page.goto(url)
        yield context, page
        assert not errors, errors
    finally:
        context.close()


@pytest.mark.parametrize("bad", [
    {"id": "wnomsgs"},                                          # no message list
    None,                                                       # not a conversation
    {"id": "wnulls", "messages": [None, 5, {"role": "user"}]},  # messages that are not messages
    {"id": "wstring", "messages": "hello"},
    {"id": 7, "messages": []},                                  # an id that is no session id
    {**KEPT, "title": "the same id again"},                     # a second conversation with one id
], ids=["no-messages", "null", "bad-messages", "messages-string", "numeric-id", "duplicate-id"])
def test_a_bad_stored_conversation_costs_only_itself(browser, static_client, bad):
    """One conversation of the wrong shape in localStorage used to stop the client at start (nothing shown, no
    button working), taking every other conversation with it."""
    stored = json.dumps({"conversations": [KEPT, bad], "active": "wkept"})
    with _page_with_store(browser, static_client, stored) as (_, page):
        sync_api.expect(page.locator("#app")).to_be_visible(timeout=WAIT_MS)
        titles = page.locator("#conv-list li .title").all_inner_texts()
        assert titles[0] == "kept" and "the same id again" not in titles, titles
        sync_api.expect(page.locator("#messages .message")).to_have_count(2)


@pytest.mark.parametrize("stored", ["not json", "5", "{}", '{"conversations": {"a": 1}}'])
def test_a_stored_value_that_is_no_conversation_list_starts_empty(browser, static_client, stored):
    with _page_with_store(browser, static_client, stored) as (_, page):
        sync_api.expect(page.locator("#app")).to_be_visible(timeout=WAIT_MS)
        page.click("#new-conv")
        sync_api.expect(page.locator("#conv-list li")).to_have_count(1)


def test_another_tabs_bad_write_is_ignored(browser, static_client):
    """Another tab's write of something that is no conversation list used to throw in the storage event, or to
    leave the client without a conversation list (every later render throwing)."""
    stored = json.dumps({"conversations": [KEPT], "active": "wkept"})
    with _page_with_store(browser, static_client, stored) as (context, page):
        sync_api.expect(page.locator("#conv-list li")).to_have_count(1, timeout=WAIT_MS)
        other = context.new_page()
        other.goto(static_client + "nothing-here")
        for value in ("{}", "not json", '{"conversations": 3}'):
            other.evaluate("([key, value]) => localStorage.setItem(key, value)", [STORE_KEY, value])
            page.wait_for_timeout(200)
            assert page.locator("#conv-list li .title").all_inner_texts() == ["kept"]
        fresh = {"conversations": [None, {**KEPT, "id": "wother", "title": "from the other tab"}], "active": "wother"}
        other.evaluate("([key, value]) => localStorage.setItem(key, value)", [STORE_KEY, json.dumps(fresh)])
        # merged into ours: a conversation the other list lacks is not deleted without its tombstone
        sync_api.expect(page.locator("#conv-list li")).to_have_count(2)
        assert sorted(page.locator("#conv-list li .title").all_inner_texts()) == ["from the other tab", "kept"]
        page.click("#new-conv")
        sync_api.expect(page.locator("#conv-list li")).to_have_count(3)


def test_two_tabs_keep_each_others_conversations(browser, host):
    """Both tabs write the one stored list. A tab streaming an answer used to ignore the other tab's write and then
    save over it: a conversation made meanwhile in the other tab was lost from storage, and from that tab too once
    it took the streaming tab's copy. Deleting in one tab still deletes in the other."""
    context = browser.new_context()
    try:
        a, b = context.new_page(), context.new_page()
        for page in (a, b):
            page.goto(f"http://127.0.0.1:{host.port}/#token={TOKEN}")
            sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        a.fill("#opt-temp", "0")
        a.click("#new-conv")
        send(a, "Tell me a long story", n=400)
        b.click("#new-conv")   # while the first tab streams
        wait_finished(a, 0)
        a.wait_for_timeout(500)   # the last saves and storage events
        stored = json.loads(a.evaluate(f"localStorage.getItem({json.dumps(STORE_KEY)})"))
        assert len(stored["conversations"]) == 2, stored
        for page in (a, b):
            sync_api.expect(page.locator("#conv-list li")).to_have_count(2, timeout=WAIT_MS)
        b.locator("#conv-list li").first.locator(".delete").click()   # b's own (newest first)
        for page in (a, b):
            sync_api.expect(page.locator("#conv-list li")).to_have_count(1, timeout=WAIT_MS)
        sync_api.expect(a.locator("#conv-list li .title")).to_have_text(["Tell me a long story"])
    finally:
        context.close()
