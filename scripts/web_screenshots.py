"""Screenshots of the web pages for the README (docs/img/playground.png, docs/img/dashboard.png).

Starts `lmserve serve` with the bundled model on a loopback port, drives a burst of requests that share a system
prompt (so the block map shows shared prefix blocks), and photographs both pages with Playwright and the system
Chromium (the `web-test` extra; Debian's `chromium`):

    python scripts/web_screenshots.py [--chromium /usr/bin/chromium] [--out docs/img]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "KING HENRY: Once more unto the breach, dear friends, once more; or close the wall up with our English dead."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def burst(url: str, n: int) -> list[threading.Thread]:
    def one(i: int) -> None:
        body = {"prompt": f"{SYSTEM}\n{['HAMLET', 'OPHELIA', 'ROMEO', 'JULIET'][i % 4]}:", "max_tokens": 160 + 8 * i,
                "ignore_eos": True, "temperature": 0.8, "seed": i, "n": 1 + i % 2}  # fmt: skip
        httpx.post(url + "/v1/completions", json=body, timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--out", default=str(REPO / "docs" / "img"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "--port", str(port), "--no-access-log",
           "--max-num-seqs", "8", "--num-kv-blocks", "192", "--served-model-name", "lmserve-default"]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url + "/dashboard")
            page.wait_for_function("Number(document.body.dataset.updates || 0) >= 2")
            threads = burst(url, 12)
            time.sleep(2.5)
            page.wait_for_function("Number(document.getElementById('blockmap').dataset.shared || 0) > 0")
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            for t in threads:
                t.join()
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(url + "/")
            page.fill("#system", "You are a player in a Shakespeare company.")
            page.fill("#prompt", "Speak the prologue, good friend.")
            page.fill("#max_tokens", "90")
            page.fill("#seed", "3")
            page.click("#send")
            page.wait_for_function("!document.getElementById('send').disabled && "
                                   "document.querySelectorAll('.message.assistant .tok').length > 10")  # fmt: skip
            page.hover(".message.assistant .tok >> nth=8")
            page.screenshot(path=str(out / "playground.png"))
            browser.close()
    finally:
        server.terminate()
        server.wait(15)
    print(f"wrote {out / 'dashboard.png'} and {out / 'playground.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
