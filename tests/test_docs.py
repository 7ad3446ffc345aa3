"""The README is the front door and ``docs/`` holds the rest; this keeps both in step with the code (the finding
catalogue's page is checked in ``tests/test_catalogue.py``): every command's options (read from the argparse parser of ``ckptaudit.cli``), the links, and the
README's length.

Run: ``.venv/bin/python -m pytest -q tests/test_docs.py``
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptaudit.cli import _parser
from demo_pages import DEMO_PAGES, demo_sample, demo_sample_differences, stated_demo_seconds

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250
WRITTEN_ELSEWHERE: dict[str, str] = {}
"""Pages written on other branches (hostile, resume), and the page holding the former README text meanwhile."""


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


def _page(command: str) -> Path:
    page = DOCS / f"{command}.md"
    if not page.exists() and page.name in WRITTEN_ELSEWHERE:
        page = DOCS / WRITTEN_ELSEWHERE[page.name]
    return page


def undocumented_options(command: str, parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The long option strings of ``parser`` that ``text`` never mentions (``--help`` aside)."""
    missing = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if longs and not any(re.search(re.escape(o) + r"(?![\w-])", text) for o in longs):
            missing.append(longs[0])
    return missing


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_option_of_a_command_is_in_its_page(command: str) -> None:
    page = _page(command)
    assert page.exists(), f"ckptaudit {command} has no page: write docs/{command}.md"
    missing = undocumented_options(command, _subparsers()[command], page.read_text())
    assert not missing, f"{page.relative_to(ROOT)} does not mention {', '.join(missing)}"


def test_an_undocumented_option_is_caught() -> None:
    """The check itself: an option the page never names is reported, a prefix of another option is not enough."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-on")
    parser.add_argument("--fail")
    parser.add_argument("--out", "-o")
    assert undocumented_options("x", parser, "use `--fail-on error` and -o") == ["--fail", "--out"]


def test_every_command_has_a_row_and_a_link_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in _subparsers():
        row = [line for line in readme.splitlines() if line.startswith(f"| `ckptaudit {command}")]
        assert row, f"README's command table has no row for ckptaudit {command}"
        assert f"(docs/{command}.md)" in row[0], f"README's row for {command} does not link docs/{command}.md"


def test_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for needed in ("make demo", "make test", "import ckptaudit", 'ckptaudit.audit("', "report.ok", "report.findings",
                   "report.to_json()"):
        assert needed in readme, needed


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m]


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_links_lead_somewhere(path: Path) -> None:
    for link in _links(path):
        target = (path.parent / link).resolve()
        if not target.exists() and target.parent == DOCS and target.name in WRITTEN_ELSEWHERE:
            target = DOCS / WRITTEN_ELSEWHERE[target.name]
        assert target.exists(), f"{path.relative_to(ROOT)} links {link}, which does not exist"


BENCH_PAGES = (ROOT / "bench" / "README.md", DOCS / "performance.md")
_SCRIPT_COMMAND = re.compile(r"\.venv/bin/python ((?:bench|tests)/[\w/.-]+\.py)([^`#|\n]*)")


def _script_commands(page: Path) -> list[tuple[str, list[str]]]:
    """Every ``.venv/bin/python bench/... .py ARGS`` (or ``tests/...``) a page names: the script and its options."""
    return [(m[1], re.findall(r"(?<![\w-])--[\w-]+", m[2])) for m in _SCRIPT_COMMAND.finditer(page.read_text())]


@pytest.mark.parametrize("page", BENCH_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_command_names_a_script_and_options_it_has(page: Path) -> None:
    """The figures' pages tell how to rerun them: each command they give must name a script of this checkout, and
    each option it passes must be one the script's ``--help`` lists (a renamed script or flag breaks the page)."""
    commands = _script_commands(page)
    assert commands, f"{page.relative_to(ROOT)} names no command to rerun its figures"
    helps: dict[str, str] = {}
    for script, options in commands:
        assert (ROOT / script).is_file(), f"{page.relative_to(ROOT)} runs {script}, which does not exist"
        if options and script not in helps:
            proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300, check=False)
            assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-2000:]}"
            helps[script] = proc.stdout
        missing = [o for o in options if o not in helps.get(script, "")]
        assert not missing, f"{page.relative_to(ROOT)} runs {script} with {missing}, which its --help does not list"


def test_every_page_is_reachable_from_the_index() -> None:
    index = (DOCS / "index.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_the_recipe_page_example_runs_and_resumes_bit_identically(tmp_path: Path) -> None:
    """docs/recipes.md's recipe, as a newcomer would save it: it loads by path, trains, and keeps its promise of
    determinism (a resume through ckptaudit.store continues with the same losses)."""
    import torch

    from ckptaudit.launch import RankContext
    from ckptaudit.recipes import load_recipe
    from ckptaudit.store import load_checkpoint, save_checkpoint

    page = (DOCS / "recipes.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_recipe.py").write_text(code)
    recipe = load_recipe(f"{tmp_path / 'my_recipe.py'}:recipe")
    ctx = RankContext(rank=0, world_size=1, backend="gloo", shared_dir=str(tmp_path))
    job = recipe.setup(ctx)
    first = [recipe.step(job) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(first))) and job.step == 3
    save_checkpoint(job, tmp_path / "ckpts")
    expected = [recipe.step(job) for _ in range(3)]
    again = recipe.setup(ctx)
    assert [recipe.step(again) for _ in range(3)] == first  # seeded
    fresh = recipe.setup(ctx)
    loaded = load_checkpoint(fresh, tmp_path / "ckpts")
    assert loaded.step == 3 and [recipe.step(fresh) for _ in range(3)] == expected
    assert recipe.build_model()(recipe.eval_batch(None)).shape == (4, 1)


def test_the_pages_state_one_demo_and_one_duration() -> None:
    assert demo_sample(DEMO_PAGES[0]) == demo_sample(DEMO_PAGES[1])
    assert len({stated_demo_seconds(p) for p in DEMO_PAGES}) == 1
    assert f"({stated_demo_seconds(DEMO_PAGES[0])} s)" in demo_sample(DEMO_PAGES[0])


def test_the_demo_sample_check_catches_a_stale_line() -> None:
    """The check itself, on the README's sample drawn as rich draws it (heavy and light rules, other numbers):
    it passes; a changed verdict, a renamed row or a lost section does not."""
    sample = demo_sample(DEMO_PAGES[0])
    drawn = sample.replace(" | ", " │ ").replace("1.83e-03", "1.91e-03").replace("(abridged)", "")
    drawn = drawn.replace("drifts\nin the resume", "drifts in the resume")
    assert demo_sample_differences(sample, drawn) == []
    for old, new in (("DRIFT", "drift"), ("compute_copy    ", "compute-copy    "),
                     ("=== live probe", "=== probe")):
        assert old in drawn
        assert demo_sample_differences(sample, drawn.replace(old, new)), old


def synopsis(page: Path, command: str) -> str | None:
    """The page's synopsis: the code block that begins ``ckptaudit COMMAND``."""
    for block in re.findall(r"```\n(.*?)```", page.read_text(), flags=re.S):
        if block.startswith(f"ckptaudit {command}"):
            return str(block)
    return None


def synopsis_gaps(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The options (and choices of options) of ``parser`` that the synopsis ``text`` leaves out."""
    gaps = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if not longs:
            continue
        found = [o for o in longs if re.search(re.escape(o) + r"(?![\w-])", text)]
        if not found:
            gaps.append(longs[0])
        elif action.choices:
            m = re.search(re.escape(found[0]) + r"[ =]([\w|.-]+)", text)
            listed = set(m[1].split("|")) if m else set()
            gaps += [f"{found[0]} {c}" for c in action.choices if str(c) not in listed]
    return gaps


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_option_is_in_the_synopsis(command: str) -> None:
    page = _page(command)
    text = synopsis(page, command)
    assert text is not None, f"{page.relative_to(ROOT)} has no synopsis (a code block beginning 'ckptaudit {command}')"
    gaps = synopsis_gaps(_subparsers()[command], text)
    assert not gaps, f"the synopsis in {page.relative_to(ROOT)} leaves out {', '.join(gaps)}"


def test_a_synopsis_gap_is_caught() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", choices=["table", "json", "html"])
    parser.add_argument("--jobs", "-j")
    assert synopsis_gaps(parser, "ckptaudit x [--format table|json|html] [-j N]") == ["--jobs"]
    assert synopsis_gaps(parser, "ckptaudit x [--format table|json] [--jobs N]") == ["--format html"]


def test_the_index_states_the_schema_version() -> None:
    from ckptaudit.findings import SCHEMA_VERSION

    index = (DOCS / "index.md").read_text()
    assert f"(schema {SCHEMA_VERSION})" in index
    assert (DOCS / "json-schema.md").read_text().startswith(f"# JSON report (schema {SCHEMA_VERSION})")
