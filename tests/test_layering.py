"""Nothing imports upward (``shared/ARCHITECTURE.md``): every ``ckptaudit`` import of every module, lazy ones inside
functions included, is parsed and held against the layer table below.

Run: ``.venv/bin/python -m pytest -q tests/test_layering.py``
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ckptaudit"

TIERS: dict[str, dict[str, int]] = {
    # the vocabulary: findings and report types, the multi-process harness, the optional dependencies, codes, schema,
    # the job protocol, options
    "foundation": {"version": 0, "findings": 0, "launch": 0, "extras": 0, "catalogue": 1, "schema": 1, "recipes": 1, "options": 2},
    # one reader per container
    "readers": {"formats": 3},
    # what the bytes mean (on-disk conventions, library layouts), what is wrong (checks), how it is rendered;
    # checks and report import neither the other
    "interpretation": {"ondisk": 4, "layouts": 4, "checks": 5, "report": 5},
    # the audit engine (plan, scan, per-tensor scan, judge, distributed), then the compare engine on it
    "engine": {"auditing": 6, "comparing": 7},
    # what a user runs or calls, built on the engine
    # (the passport sits below latest, the store and serving, which require or write one)
    "commands": {"api": 8, "passport": 8, "latest": 9, "store": 10, "exporters": 11, "serving": 11, "probe": 12,
                 "resume": 12, "demo": 13},
    # how users come in
    "doors": {"integrations": 14, "testing": 14, "cli": 15, "__main__": 16},
}
"""Tier (the names of ``docs/architecture.md``) -> top-level unit of ``ckptaudit`` -> its layer. A module may import a
unit of a strictly lower layer, or its own unit; every layer of a tier is below every layer of the next tier."""

LAYERS: dict[str, int] = {unit: layer for units in TIERS.values() for unit, layer in units.items()}
TIER_OF: dict[str, str] = {unit: tier for tier, units in TIERS.items() for unit in units}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ckptaudit"


def _is_module(dotted: str, src: Path) -> bool:
    path = src.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path, src: Path) -> list[tuple[int, str]]:
    """``(line, imported ckptaudit module)`` for every import in ``path``, wherever it stands in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ckptaudit"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "ckptaudit":
                continue
            subs = [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}", src)]
            out += [(node.lineno, m) for m in subs or [node.module]]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append((node.lineno, "<relative>"))
    return out


def _module_name(path: Path, src: Path) -> str:
    return ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")


def upward_arrows(root: Path = SRC) -> list[str]:
    """Every import under ``root/ckptaudit`` that runs upward or sideways between units, or that the table cannot
    place."""
    bad = []
    for path in sorted((root / "ckptaudit").rglob("*.py")):
        importer = _module_name(path, root)
        src = _unit(importer)
        for line, imported in _imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            if imported == "<relative>":
                bad.append(f"{where}: relative import; write the absolute ckptaudit.* name")
                continue
            dst = _unit(imported)
            if dst == src:  # a unit uses itself
                continue
            if dst == "ckptaudit":
                bad.append(f"{where}: imports the package root, which resolves the public API on first use; import "
                           "the module that defines the name (ckptaudit.version for __version__)")
                continue
            if src == "ckptaudit":
                bad.append(f"{where}: the package root imports {imported} eagerly; import it lazily in __getattr__")
                continue
            for unit in (src, dst):
                if unit not in LAYERS:
                    bad.append(f"{where}: {unit} is not in tests/test_layering.py's TIERS; give it its tier and layer")
            if src in LAYERS and dst in LAYERS and LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{where}: {importer} ({TIER_OF[src]} tier, layer {LAYERS[src]}, {src}) imports "
                           f"{imported} ({TIER_OF[dst]} tier, layer {LAYERS[dst]}, {dst}): that arrow runs upward; "
                           "move the shared part below both")
    return bad


def test_no_import_runs_upward() -> None:
    assert upward_arrows() == []


def test_the_stated_directions_hold() -> None:
    """The directions ``shared/ARCHITECTURE.md`` names, spelled out, so that a change of LAYERS cannot lose them."""
    below = {unit for unit, layer in LAYERS.items() if layer < LAYERS["formats"]}
    assert LAYERS["findings"] == 0 and not {u for u, lv in LAYERS.items() if lv < 0}
    assert {"checks", "report", "cli", "store", "auditing"}.isdisjoint(below)
    for low, high in (("formats", "checks"), ("formats", "report"), ("formats", "store"), ("formats", "auditing"),
                      ("checks", "store"), ("checks", "cli"), ("report", "cli"), ("layouts", "checks"),
                      ("auditing", "store"), ("auditing", "cli"), ("checks", "auditing"), ("auditing", "comparing")):
        assert LAYERS[low] < LAYERS[high], (low, high)
    assert LAYERS["checks"] == LAYERS["report"]  # neither imports the other


def test_the_tiers_are_ordered_and_cover_the_package() -> None:
    """Every layer of a tier lies below every layer of the next one, and every top-level unit has its tier."""
    tiers = list(TIERS.values())
    for lower, upper in itertools.pairwise(tiers):
        assert max(lower.values()) < min(upper.values()), (lower, upper)
    units = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert units - {"__init__"} == set(LAYERS)


def test_the_architecture_page_names_the_same_tiers() -> None:
    """``docs/architecture.md``'s table: one row per tier, in order, listing exactly that tier's units."""
    import re

    page = (SRC.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| \*\*(\w+)\*\* \| (.*?) \|", page, flags=re.M)
    assert [name for name, _ in rows] == list(TIERS)
    for name, cell in rows:
        listed = {re.sub(r"\.py$|/$", "", u) for u in re.findall(r"`([\w/.]+)`", cell)} - {"__init__"}
        assert listed == set(TIERS[name]), name


def _planted(tmp_path: Path, importer: str, imported: str) -> Path:
    """A copy of the package under ``tmp_path/src`` with ``imported`` appended to its module ``importer``."""
    import shutil

    copy = tmp_path / "src" / "ckptaudit"
    shutil.copytree(PACKAGE, copy)
    target = copy / importer
    target.write_text(target.read_text() + "\n" + imported + "\n")
    return tmp_path / "src"


def private_imports(root: Path = SRC) -> list[str]:
    """Every import under ``root/ckptaudit`` of another module's underscore name (``from x import _name``, or a module
    ``_name`` itself): a name a sibling uses is that module's API and carries no underscore."""
    bad = []
    for path in sorted((root / "ckptaudit").rglob("*.py")):
        importer = _module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "ckptaudit"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "ckptaudit":
                    continue
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for dotted in names:
                private = [p for p in dotted.split(".") if p.startswith("_") and not p.startswith("__")]
                if private and dotted.rsplit(".", 1)[0] != importer:
                    bad.append(f"{where}: {importer} imports {dotted}; {private[0]} is used outside its module, so "
                               "it is that module's API: name it without the underscore")
                    break  # one line a statement
    return bad


def test_no_module_imports_a_private_name_of_another() -> None:
    assert private_imports() == []


@pytest.mark.parametrize(("checker", "importer", "imported", "says"), [
    ("upward", "checks/manifest.py", "from ckptaudit.store import durable", "runs upward"),
    ("upward", "formats/io/tensors.py", "from ckptaudit.checks.precision import check_precision", "runs upward"),
    ("upward", "findings.py", "import ckptaudit.catalogue", "runs upward"),
    ("upward", "report/table.py", "from ckptaudit import cli", "runs upward"),
    ("upward", "checks/precision.py", "def f():\n    from ckptaudit.report import json", "runs upward"),
    ("private", "formats/pickle/walk.py", "from ckptaudit.formats.pickle.ops import _Const", "without the underscore"),
    ("private", "checks/precision.py", "def f():\n    from ckptaudit.formats.dcp.reader import _lists",
     "without the underscore"),
    ("private", "integrations/guard.py", "import ckptaudit.integrations._hidden", "without the underscore"),
    ("private", "integrations/store.py", "from ckptaudit.integrations._hidden import x", "without the underscore"),
])
def test_a_planted_import_is_caught(tmp_path: Path, checker: str, importer: str, imported: str, says: str) -> None:
    """The checkers themselves: each upward or private import, planted in a copy of the package, is named once,
    with its line."""
    bad = {"upward": upward_arrows, "private": private_imports}[checker](_planted(tmp_path, importer, imported))
    assert len(bad) == 1 and f"src/ckptaudit/{importer}:" in bad[0] and says in bad[0], bad


TOOL_EXCLUDES = {".bzr", ".direnv", ".eggs", ".git", ".hg", ".mypy_cache", ".nox", ".pants.d", ".pytype", ".ruff_cache",
                 ".svn", ".tox", ".venv", "__pypackages__", "_build", "buck-out", "build", "dist", "node_modules",
                 "site-packages", "venv"}
"""The folder names ruff (and other tools: mypy, coverage, packaging) skip by default: a module in one is never
linted (``dist/launch.py`` never was, until it became ``launch.py``)."""


def skipped_folders(root: Path = PACKAGE) -> list[str]:
    """Every folder under ``root`` whose name a tool skips by default."""
    return sorted(str(p.relative_to(root.parent)) for p in root.rglob("*") if p.is_dir() and p.name in TOOL_EXCLUDES)


def test_no_module_lies_where_tools_do_not_look(tmp_path: Path) -> None:
    assert skipped_folders() == []
    planted = _planted(tmp_path, "findings.py", "")
    (planted / "ckptaudit" / "dist").mkdir()
    (planted / "ckptaudit" / "dist" / "__init__.py").write_text("")
    assert skipped_folders(planted / "ckptaudit") == ["ckptaudit/dist"]
