"""The finding catalogue: every code the source emits is catalogued, and the table of docs/catalogue.md is current."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptaudit.catalogue import CATALOGUE, markdown, update_readme

ROOT = Path(__file__).resolve().parents[1]


def test_every_emitted_code_is_catalogued() -> None:
    emitted: set[str] = set()
    for path in (ROOT / "src" / "ckptaudit").rglob("*.py"):
        text = path.read_text()
        emitted |= set(re.findall(r'finding\(\s*"([a-z0-9-]+\.[a-z0-9-]+)"', text))
        emitted |= set(re.findall(r'Rule\(\s*"([a-z0-9-]+\.[a-z0-9-]+)"', text))
    assert emitted, "the pattern found no codes at all"
    assert emitted <= set(CATALOGUE), sorted(emitted - set(CATALOGUE))


def test_the_catalogue_page_lists_the_catalogue() -> None:
    page = (ROOT / "docs" / "catalogue.md").read_text()
    block = page.split("<!-- catalogue:start -->")[1].split("<!-- catalogue:end -->")[0].strip()
    assert block == markdown(), "docs/catalogue.md is stale: run .venv/bin/python -m ckptaudit.catalogue --update"
    assert all(f"| `{code}` |" in block for code in CATALOGUE)


def test_update_rewrites_the_page_and_refuses_a_file_without_markers(tmp_path: Path) -> None:
    page = tmp_path / "catalogue.md"
    page.write_text("# Finding catalogue\n\n<!-- catalogue:start -->\nstale\n<!-- catalogue:end -->\n\nafter\n")
    assert update_readme(str(page)) is True
    assert page.read_text() == f"# Finding catalogue\n\n<!-- catalogue:start -->\n{markdown()}\n<!-- catalogue:end -->\n\nafter\n"
    assert update_readme(str(page)) is False
    readme = tmp_path / "README.md"
    readme.write_text("# front door\n")
    with pytest.raises(ValueError, match="no <!-- catalogue:start -->"):
        update_readme(str(readme))
    assert readme.read_text() == "# front door\n"
