"""A minimal headless-Chromium driver over the DevTools protocol (tornado's websocket client).

Chromium's one-shot ``--screenshot`` fires at page load, before a Bokeh page has pulled its document
over its websocket; this driver waits until the page shows what the test expects, then shoots.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tornado.ioloop import IOLoop
from tornado.websocket import websocket_connect

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1100", "--remote-debugging-port=0", "about:blank"]


# Bokeh 3 renders into shadow roots, which innerText does not enter: walk them too
DEEP_TEXT = """(function text(n) {
  let s = n.shadowRoot ? text(n.shadowRoot) : '';
  for (const c of n.childNodes) s += c.nodeType === 3 ? c.textContent + ' ' : text(c);
  return s;
})(document.body || document)"""


def screenshot_when(url: str, expected: list[str], out: Path, timeout_s: float = 60.0) -> str:
    """Open ``url``; once its text contains every ``expected`` string, save a PNG; return the text."""
    # chromium's helper processes may still write to the profile right after the browser is killed
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        # TMPDIR: its singleton socket's folder (org.chromium.Chromium.*) goes with the profile; killed, the
        # browser would leave it in /tmp
        proc = subprocess.Popen(["chromium", f"--user-data-dir={profile}", *FLAGS], stderr=subprocess.PIPE,
                                text=True, start_new_session=True, env={**os.environ, "TMPDIR": profile})
        try:
            ws_url = _devtools_url(proc, timeout_s)
            return IOLoop.current().run_sync(lambda: _drive(ws_url, url, expected, out, timeout_s))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the browser and its helpers
            except ProcessLookupError:
                pass
            proc.wait()


def _devtools_url(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stderr.readline()
        if m := re.search(r"DevTools listening on (ws://\S+)", line):
            return m.group(1)
        if not line and proc.poll() is not None:
            break
    raise RuntimeError("chromium did not start its DevTools endpoint")


async def _drive(browser_ws: str, url: str, expected: list[str], out: Path, timeout_s: float) -> str:
    import asyncio

    conn = await websocket_connect(browser_ws, max_message_size=64 * 2**20)
    ids = itertools.count(1)
    console: list[str] = []  # the page's console messages and exceptions, for the error message

    async def call(method: str, session: str | None = None, **params):
        msg_id = next(ids)
        msg = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        await conn.write_message(json.dumps(msg))
        while True:
            reply = json.loads(await conn.read_message())
            if reply.get("method") in ("Runtime.consoleAPICalled", "Runtime.exceptionThrown"):
                console.append(json.dumps(reply["params"])[:300])
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    target = (await call("Target.createTarget", url="about:blank"))["targetId"]
    session = (await call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
    await call("Runtime.enable", session)
    await call("Page.navigate", session, url=url)
    deadline, text = time.time() + timeout_s, ""
    while time.time() < deadline:
        res = await call("Runtime.evaluate", session, expression=DEEP_TEXT, returnByValue=True)
        text = res["result"].get("value") or ""
        if all(e in text for e in expected):
            await asyncio.sleep(1.0)  # let the plots draw their first data
            size = (await call("Page.getLayoutMetrics", session))["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            png = await call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                             clip=clip)  # the whole page, not only the window
            out.write_bytes(base64.b64decode(png["data"]))
            conn.close()
            return text
        await asyncio.sleep(0.5)
    conn.close()
    raise TimeoutError(f"{url} never showed {expected}; its text was: {text[:500]!r}; console: {console[-8:]}")
