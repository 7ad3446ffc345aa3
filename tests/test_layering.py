"""Nothing imports upward (``shared/ARCHITECTURE.md``): every ``ckptaudit`` import of every module, lazy ones inside
functions included, is parsed and held against the layer table below.

Run: ``.venv/bin/python -m pytest -q tests/test_layering.py``
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ckptaudit"

LAYERS: dict[str, int] = {
    # data model and the standalone multi-process harness: import nothing of ours
    "model": 0,
    "dist": 0,
    "extras": 0,
    "catalogue": 1,
    "schema": 1,
    "recipe": 1,
    # one reader per on-disk format (the store's manifest and layout names included)
    "formats": 2,
    "recipes": 2,
    "layouts": 3,
    "records": 3,
    "exporters": 3,
    # pure checks over records, and the renderers: neither imports the other
    "checks": 4,
    "report": 4,
    # the scan phase (plan, threads, records), then the audit that judges it
    "scanning": 5,
    "audit": 6,
    "distaudit": 7,
    "compare": 6,
    "probe": 6,
    "store": 7,
    "api": 7,
    "resume": 7,
    "demo": 8,
    "integrations": 8,
    "testing": 8,
    "cli": 9,
    "__main__": 10,
}
"""Top-level unit of ``ckptaudit`` -> its layer. A module may import a unit of a strictly lower layer, or its own unit."""


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
            if dst == "ckptaudit" or dst == src:  # the package root only carries __version__; a unit uses itself
                continue
            if src == "ckptaudit":
                bad.append(f"{where}: the package root imports {imported} eagerly; import it lazily in __getattr__")
                continue
            for unit in (src, dst):
                if unit not in LAYERS:
                    bad.append(f"{where}: {unit} is not in tests/test_layering.py's LAYERS; give it its layer")
            if src in LAYERS and dst in LAYERS and LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{where}: {importer} (layer {LAYERS[src]}, {src}) imports {imported} "
                           f"(layer {LAYERS[dst]}, {dst}): that arrow runs upward; move the shared part below both")
    return bad


def test_no_import_runs_upward() -> None:
    assert upward_arrows() == []


def test_the_stated_directions_hold() -> None:
    """The directions ``shared/ARCHITECTURE.md`` names, spelled out, so that a change of LAYERS cannot lose them."""
    below = {unit for unit, layer in LAYERS.items() if layer < LAYERS["formats"]}
    assert LAYERS["model"] == 0 and not {u for u, lv in LAYERS.items() if lv < 0}
    assert {"checks", "report", "cli", "store", "audit"}.isdisjoint(below)
    for low, high in (("formats", "checks"), ("formats", "report"), ("formats", "store"), ("formats", "audit"),
                      ("checks", "store"), ("checks", "cli"), ("report", "cli"), ("layouts", "checks"),
                      ("audit", "store"), ("audit", "cli"), ("checks", "scanning"), ("scanning", "audit"),
                      ("scanning", "distaudit")):
        assert LAYERS[low] < LAYERS[high], (low, high)
    assert LAYERS["checks"] == LAYERS["report"]  # neither imports the other


@pytest.mark.parametrize(("importer", "imported"), [
    ("checks/manifest.py", "from ckptaudit.store import layout"),
    ("formats/tensors.py", "from ckptaudit.checks.precision import check_precision"),
    ("model.py", "import ckptaudit.catalogue"),
    ("report/table.py", "from ckptaudit import cli"),
    ("checks/precision.py", "def f():\n    from ckptaudit.report import json"),
])
def test_an_upward_arrow_is_caught(tmp_path: Path, importer: str, imported: str) -> None:
    """The checker itself: each upward import, planted in a copy of the package, is named with its line."""
    import shutil

    copy = tmp_path / "src" / "ckptaudit"
    shutil.copytree(PACKAGE, copy)
    target = copy / importer
    target.write_text(target.read_text() + "\n" + imported + "\n")
    bad = upward_arrows(tmp_path / "src")
    assert len(bad) == 1 and f"src/ckptaudit/{importer}:" in bad[0] and "runs upward" in bad[0], bad
