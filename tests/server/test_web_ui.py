"""The web pages in a real browser: Playwright driving Debian's Chromium (/usr/bin/chromium, never a downloaded
one) against a live `lmserve serve --api-key`. The playground streams visibly token by token, the dashboard's
counters and block map move during a burst, model output is text (never HTML), and no page logs an error."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import require_extra
from tests.server.test_server import MODEL_NAME, LiveServer

require_extra("web-test", "playwright.sync_api")
from playwright.sync_api import Browser, Page, sync_playwright  # noqa: E402

pytestmark = pytest.mark.slow  # a browser against the server: in `-m slow` (CI runs it), out of the default run

CHROMIUM = os.environ.get("LMSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
KEY = "sk-web"
if not Path(CHROMIUM).exists():
    if os.environ.get("LMSERVE_REQUIRE_EXTRAS") == "1":
        raise RuntimeError(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("web")
    srv = LiveServer(llama_dir, root / "server.log", "--api-key", KEY, "--max-num-seqs", "4")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page whose session already holds the API key, failing the test on any console error or page error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(f"sessionStorage.setItem('lmserve-api-key', {json.dumps(KEY)})")
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert errors == [], errors


def _burst(server: LiveServer, n: int, max_tokens: int, until: threading.Event | None = None) -> threading.Thread:
    """n concurrent streams of max_tokens each; with `until`, each stream starts again until it is set (a tiny
    model finishes a fixed burst faster than the dashboard's feed ticks)."""
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": max_tokens, "ignore_eos": True}

    def worker(c: httpx.Client) -> None:
        c.post(server.url + "/v1/completions", json=body)
        while until is not None and not until.is_set():
            c.post(server.url + "/v1/completions", json=body)

    def run() -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            threads = [threading.Thread(target=worker, args=(c,)) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_playground_streams_token_by_token(server: LiveServer, page: Page) -> None:
    page.goto(server.url + "/")
    page.select_option("#mode", "completion")
    page.fill("#prompt", "The capital of France is")
    page.fill("#max_tokens", "120")
    page.fill("#temperature", "1.0")
    page.fill("#seed", "7")
    # record the number of token spans every time the transcript changes, with the time
    page.evaluate(
        """() => {
        window.__counts = [];
        new MutationObserver(() => {
          const n = document.querySelectorAll('.message.assistant .tok').length;
          window.__counts.push([performance.now(), n]);
        }).observe(document.getElementById('transcript'), {childList: true, subtree: true});
    }"""
    )
    # The tiny model streams 120 tokens in tens of ms, faster than the browser repaints; a throttled link (as a
    # slow network would) spreads the server's events over time, so the page's incremental rendering shows.
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions",
             {"offline": False, "latency": 0, "downloadThroughput": 40_000, "uploadThroughput": -1})  # fmt: skip
    page.click("#send")
    page.wait_for_function("!document.getElementById('send').disabled && window.__counts.length > 0", timeout=60_000)
    cdp.send("Network.emulateNetworkConditions",
             {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})  # fmt: skip
    counts = page.evaluate("window.__counts")
    distinct = sorted({n for _, n in counts})
    assert len(distinct) >= 5, counts  # the output grew in many separate steps, not in one piece
    growth = [t for t, n in counts if n > 0]
    assert growth[-1] - growth[0] > 20, counts  # spread over time (ms)
    stats = page.inner_text(".message.assistant .stats")
    assert "TTFT" in stats and "mean ITL" in stats and "tok/s" in stats and "prefix-cache hit" in stats
    assert "…" not in stats  # finished
    page.hover(".message.assistant .tok >> nth=2")
    tip = page.inner_text("#tooltip")
    assert "logprob" in tip and "%" in tip
    assert page.locator("#tooltip tr").count() >= 2  # the top alternatives


def test_chat_mode_sends_system_prompt_and_history(server: LiveServer, page: Page) -> None:
    seen: list[dict] = []
    page.on("request", lambda r: seen.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    page.goto(server.url + "/")

    def fake(route) -> None:  # the test model has no chat template: answer as the server would
        route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream"},
            body='data: {"choices":[{"index":0,"delta":{"content":"Paris"},"logprobs":null}]}\n\ndata: [DONE]\n\n',
        )

    page.route("**/v1/chat/completions", fake)
    page.fill("#system", "Be brief.")
    for text in ("Capital of France?", "And of Italy?"):
        page.fill("#prompt", text)
        page.click("#send")
        page.wait_for_function("!document.getElementById('send').disabled")
    assert seen[1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert seen[1]["stream"] and seen[1]["logprobs"] and seen[1]["stream_options"] == {"include_usage": True}
    assert "api_key" not in json.dumps(seen) and KEY not in page.url


def test_model_output_with_markup_stays_text(server: LiveServer, page: Page) -> None:
    evil = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold</b>'
    chunk = {
        "choices": [{
            "index": 0, "text": evil, "finish_reason": None,
            "logprobs": {"tokens": ["<script>"], "token_logprobs": [-0.5], "text_offset": [0],
                         "top_logprobs": [{"<script>": -0.5, "<img src=x onerror=alert(1)>": -1.5}]},
        }],
    }  # fmt: skip
    body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
    page.route(
        "**/v1/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body),
    )
    page.goto(server.url + "/")
    page.select_option("#mode", "completion")
    page.fill("#prompt", "say something nasty")
    page.click("#send")
    page.wait_for_function("!document.getElementById('send').disabled")
    text = page.inner_text(".message.assistant .text")
    assert text == evil
    assert page.locator("#transcript script, #transcript img, #transcript b").count() == 0
    page.hover(".message.assistant .tok")
    assert "<img src=x onerror=alert(1)>" in page.inner_text("#tooltip")
    assert page.locator("#tooltip img").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_dashboard_moves_during_a_burst(server: LiveServer, page: Page, tmp_path: Path) -> None:
    page.goto(server.url + "/dashboard")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 3", timeout=30_000)
    assert page.inner_text("#running") == "0"
    assert page.get_attribute("#blockmap", "data-used") == "0"
    assert "no bottleneck found" in page.inner_text("#diagnosis")
    stop = threading.Event()
    burst = _burst(server, 12, 200, until=stop)
    try:
        page.wait_for_function(
            "Number(document.getElementById('running').textContent) > 0 && "
            "Number(document.getElementById('blockmap').dataset.used) > 0",
            timeout=60_000,
        )
        assert int(page.inner_text("#waiting")) >= 0
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    finally:
        stop.set()
        burst.join()
    page.wait_for_function("Number(document.getElementById('blockmap').dataset.used) === 0", timeout=60_000)
    ttft_n = page.locator("#latency-rows tr >> nth=0").locator("td >> nth=0").inner_text()
    assert int(ttft_n) >= 12
    assert float(page.inner_text("#throughput")) > 0


def test_dashboard_asks_for_the_key(server: LiveServer, browser: Browser) -> None:
    context = browser.new_context()  # no key in this session
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/dashboard")
    pg.wait_for_function("document.getElementById('conn').textContent.includes('needs an API key')")
    assert "needs-key" in (pg.get_attribute("#key-form", "class") or "")
    pg.fill("#key-form input", KEY)
    pg.click("#key-form button")
    pg.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=30_000)
    assert "live" in pg.inner_text("#conn") and KEY not in pg.url
    assert pg.evaluate("sessionStorage.getItem('lmserve-api-key')") == KEY
    context.close()
    assert errors == []
