"""A real browser for the HTML report's tests: Debian's Chromium (``apt-get install chromium``; the Makefile's test
set-up installs it when missing) driven by Playwright with that executable (Playwright's own browser download is
not used). Also a script: the screenshot of a report page, as the README's picture is taken::

    .venv/bin/python tests/support/browser.py ckptaudit-demo/report.html docs/demo-report.png
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SIZE = {"width": 1150, "height": 1250}
"""The viewport of the screenshots (the README's picture)."""
REQUIRE = "CKPTAUDIT_REQUIRE_BROWSER"
"""Set to 1 where the browser must be there (CI): a missing one is then a failure, not a skip."""


def find_chromium() -> str | None:
    """The system's Chromium (``CHROMIUM`` in the environment first), or ``None``."""
    given = os.environ.get("CHROMIUM")
    if given and os.access(given, os.X_OK):
        return given
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def unavailable() -> str | None:
    """Why no browser can be driven here (for a skip), or ``None`` when one can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install '.[test]')"
    if find_chromium() is None:
        return "no Chromium on this machine (apt-get install chromium; `make test` installs it as root)"
    return None


@contextmanager
def page(html: Path) -> Iterator[tuple[Any, list[str]]]:
    """A Chromium page showing ``html`` (a file), and the console errors and page errors it reports."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox"])
        try:
            pg = browser.new_page(viewport=SIZE)
            errors: list[str] = []
            pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            pg.goto(html.resolve().as_uri())
            pg.wait_for_load_state("load")
            yield pg, errors
        finally:
            browser.close()


def screenshot(html: Path, png: Path) -> None:
    """The top of the page ``html`` at :data:`SIZE`, as PNG."""
    with page(html) as (pg, _):
        pg.screenshot(path=str(png))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: browser.py REPORT.html OUT.png")
    why = unavailable()
    if why:
        sys.exit(why)
    screenshot(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {sys.argv[2]}")
