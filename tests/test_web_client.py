"""The browser client in a real Chromium (Debian's, driven by Playwright) against a ``pocketllm host``.

Screenshots go to ``$POCKETLLM_TEST_ARTIFACTS`` (default ``build/test-artifacts``) under ``web-client/``.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from harness_utils import HostProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
TOKEN = "web-test-token"
WEB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pocketllm", "harness", "web")
WAIT_MS = 90_000
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script> **bold** [bad](javascript:window.__xss=3)'

if not os.path.exists(CHROMIUM):
    pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (apt-get install -y chromium); "
                "the browser test needs it", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")


@pytest.fixture(scope="module")
def artifacts() -> str:
    root = os.environ.get("POCKETLLM_TEST_ARTIFACTS") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "test-artifacts")
    path = os.path.join(root, "web-client")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


def start_host(model: str, port: int | None = None) -> HostProcess:
    host = HostProcess("--model", model, "--ctx", "1024", token=TOKEN, port=port)
    host.wait_ready()
    return host


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
        }
        for source, expected in cases.items():
            assert page.evaluate("s => PocketMarkdown.renderMarkdown(s)", source) == expected, source
    finally:
        page.close()


def test_browser_client_end_to_end(browser, model, artifacts):
    host = start_host(model)
    context = browser.new_context()
    page = context.new_page()
    frames: list[dict] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    try:
        # --- token prompt: a wrong token is refused, the right one opens the app ---------------------
        page.goto(f"http://127.0.0.1:{host.port}/")
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
        port = host.port
        assert host.stop() == 0
        sync_api.expect(page.locator("#status")).not_to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        host = start_host(model, port=port)
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        send(page, "Still there?", n=5)
        assert wait_finished(page, 1) == "budget"
        assert assistant_messages(page).nth(0).inner_text() == first_answer
        diag = json.loads(page.locator("#diag-body").inner_text())
        # The new host got the conversation so far from the browser: the prompt holds both turns.
        assert diag["usage"]["prompt_tokens"] > 30
        page.screenshot(path=os.path.join(artifacts, "05-after-restart.png"))

        # --- model text with markup is shown, never run ----------------------------------------------------
        inject = {"armed": True}

        def relay(route):
            server = route.connect_to_server()

            def to_page(message):
                if isinstance(message, str) and inject["armed"]:
                    data = json.loads(message)
                    if "chunk" in data:
                        inject["armed"] = False
                        message = json.dumps({**data, "chunk": XSS + data["chunk"]})
                route.send(message)

            route.on_message(lambda message: server.send(message))
            server.on_message(to_page)

        page.route_web_socket(re.compile(".*"), relay)
        page.reload()
        sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
        send(page, "Show me some markup", n=4)
        wait_finished(page, 2)
        assert not inject["armed"]
        body = assistant_messages(page).nth(2).locator(".body")
        assert "<img src=x" in body.inner_text() and "<script>" in body.inner_text()
        assert body.locator("strong").inner_text() == "bold"
        assert page.locator("#messages img, #messages script, #messages a[href^='javascript']").count() == 0
        assert page.evaluate("window.__xss") is None
        page.screenshot(path=os.path.join(artifacts, "06-markup-escaped.png"))
    finally:
        context.close()
        host.stop()
