"""Headless Chromium from the distribution, driven over the DevTools protocol (a websocket).

Enough of the protocol for the web page's tests: open a page, evaluate JavaScript in it,
wait for a condition, take a screenshot. `chromium()` is None where the browser is not
installed (.ci/run installs it with apt-get).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import websocket

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
START_S = 60.0


def chromium() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class Page:
    def __init__(self, ws_url: str) -> None:
        # no Origin header: Chromium refuses websocket clients that send an origin it does not allow
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        sent = next(self.ids)
        self.ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:  # events come between the replies; none is needed here
            message = json.loads(self.ws.recv())
            if message.get("id") == sent:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message["result"])

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float) -> Any:
        """The expression's value once it is truthy; TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):  # mid-navigation: the page's globals are not there yet
                if value := self.evaluate(expression):
                    return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression} was not true within {timeout}s")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self.ws.close()


@contextlib.contextmanager
def browser(binary: str, profile: Path, width: int = 1280, height: int = 900) -> Iterator[Page]:
    """A headless Chromium with one blank page; the process ends with the block."""
    proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        page = Page(_page_url(_devtools_port(proc)))
        try:
            page.call("Page.enable")
            yield page
        finally:
            page.close()
    finally:
        proc.kill()
        proc.wait()


def _devtools_port(proc: subprocess.Popen[str]) -> int:
    """The port Chromium chose: it says `DevTools listening on ws://127.0.0.1:PORT/...` on stderr."""
    assert proc.stderr is not None
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        if line.startswith("DevTools listening on ws://"):
            return int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    raise TimeoutError("chromium did not open its DevTools port")


def _page_url(port: int) -> str:
    """The websocket of the blank page Chromium opened with."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
        pages = [t for t in targets if t.get("type") == "page"]
        if pages:
            return str(pages[0]["webSocketDebuggerUrl"])
        time.sleep(0.2)
    raise TimeoutError("chromium opened no page")
