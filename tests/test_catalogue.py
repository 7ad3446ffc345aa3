"""The finding catalogue: every code the source emits is catalogued, and the README's table is current."""

from __future__ import annotations

import re
from pathlib import Path

from ckptaudit.catalogue import CATALOGUE, markdown

ROOT = Path(__file__).resolve().parents[1]


def test_every_emitted_code_is_catalogued() -> None:
    emitted: set[str] = set()
    for path in (ROOT / "src" / "ckptaudit").rglob("*.py"):
        text = path.read_text()
        emitted |= set(re.findall(r'finding\(\s*"([a-z0-9-]+\.[a-z0-9-]+)"', text))
        emitted |= set(re.findall(r'Rule\(\s*"([a-z0-9-]+\.[a-z0-9-]+)"', text))
    assert emitted, "the pattern found no codes at all"
    assert emitted <= set(CATALOGUE), sorted(emitted - set(CATALOGUE))


def test_readme_lists_the_catalogue() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- catalogue:start -->")[1].split("<!-- catalogue:end -->")[0].strip()
    assert block == markdown(), "README catalogue is stale: run python -m ckptaudit.catalogue --update README.md"
