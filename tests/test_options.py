"""One option table (``ckptaudit.options``): the API's signature, the typed stub, the command line's flags and the
guards all derive from it, so they cannot drift; the API has ``jobs`` and the command line ``--quick``.

Run: ``.venv/bin/python -m pytest -q tests/test_options.py``
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptaudit
from ckptaudit.cli import _parser, main
from ckptaudit.options import AUDIT_OPTIONS, COMPARE_OPTIONS, Option
from real_checkpoints import torch_save_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"
STUB = SRC / "ckptaudit" / "__init__.pyi"
TABLES = {"audit": AUDIT_OPTIONS, "compare": COMPARE_OPTIONS}


def _stub_keywords(func: str) -> list[tuple[str, str, object]]:
    """``(name, annotation, default)`` of each keyword-only parameter of ``func`` in the stub."""
    tree = ast.parse(STUB.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func]
    args = node.args
    return [(a.arg, ast.unparse(a.annotation) if a.annotation else "", ast.literal_eval(d) if d else None)
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]


@pytest.mark.parametrize("func", sorted(TABLES))
def test_the_typed_stub_spells_the_table(func: str) -> None:
    table = TABLES[func]
    assert _stub_keywords(func) == [(o.name, o.annotation, o.default) for o in table.values()]


@pytest.mark.parametrize("func", sorted(TABLES))
def test_help_shows_the_table_as_typed_keywords(func: str) -> None:
    fn = getattr(ckptaudit, func)
    assert fn is getattr(__import__("ckptaudit.api").api, func)  # one function, not a wrapper of it
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in params] == [(o.name, o.default) for o in TABLES[func].values()]
    shown = str(inspect.signature(fn))
    for o in TABLES[func].values():
        assert f"{o.name}: {o.annotation.replace('Iterable', 'collections.abc.Iterable')}" in shown.replace(
            "typing.", ""), (o.name, shown)


def _flags(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("command", sorted(TABLES))
def test_the_command_line_flags_are_the_table(command: str) -> None:
    flags = _flags(command)
    for opt in TABLES[command].values():
        if not opt.cli:
            assert opt.flag not in flags
            continue
        action = flags[opt.flag]
        assert (action.help and opt.help.split(" (")[0] in action.help) or opt.name == "fail_on", opt.name
        if opt.choices:
            assert tuple(action.choices or ()) == opt.choices and action.default == opt.default
        if opt.annotation == "bool":  # a switch: --quick turns one on, --no-run-evidence one on by default off
            assert action.default is opt.default and action.nargs == 0 and action.dest == opt.name


def test_api_jobs_and_cli_quick(tmp_path: Path) -> None:
    path = str(torch_save_checkpoint(tmp_path / "model.pt"))
    one, many = ckptaudit.audit(path, jobs=1), ckptaudit.audit(path)
    assert one.to_dict()["findings"] == many.to_dict()["findings"]
    with pytest.raises(ValueError, match=r"option jobs=0 is not valid; pass an int >= 1, or None"):
        ckptaudit.audit(path, jobs=0)
    quick = ckptaudit.audit(path, quick=True)
    out, err = io.StringIO(), io.StringIO()
    assert main(["audit", path, "--quick", "--format", "json", "--no-progress"], stdout=out, stderr=err) in (0, 1)
    doc = json.loads(out.getvalue())
    assert doc["findings"] == quick.to_dict()["findings"] and quick.quick
    full = io.StringIO()
    main(["audit", path, "--format", "json", "--no-progress"], stdout=full, stderr=err)
    assert doc != json.loads(full.getvalue())  # --quick reached the engine: the report says which mode ran


def test_a_bad_value_on_the_command_line_is_a_usage_error_from_the_table(tmp_path: Path) -> None:
    path = str(torch_save_checkpoint(tmp_path / "model.pt"))
    err = io.StringIO()
    assert main(["compare", path, path, "--jobs", "65", "--no-progress"], stdout=io.StringIO(), stderr=err) == 2
    assert "option jobs=65 is not valid; pass an int from 1 to 64" in err.getvalue()


def test_the_check_catches_a_drifted_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a table entry the stub does not spell is seen."""
    extra = Option("verbose", False, "bool", lambda v: isinstance(v, bool), "True or False", "x")
    monkeypatch.setitem(AUDIT_OPTIONS, "verbose", extra)  # type: ignore[index]
    with pytest.raises(AssertionError):
        test_the_typed_stub_spells_the_table("audit")


def test_a_type_checker_sees_the_typed_options(tmp_path: Path) -> None:
    """The package ships ``py.typed``: mypy on a user's snippet reads the stub, so a wrong option is an error."""
    assert (SRC / "ckptaudit" / "py.typed").is_file()
    snippet = tmp_path / "user.py"
    snippet.write_text("import ckptaudit\n"
                       "ok = ckptaudit.audit('x', master_dtype='float32', jobs=2, quick=True).ok\n"
                       "ckptaudit.audit('x', master_dtype='fp64')\n")
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}  # found as installed, as a user's mypy finds it
    run = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--follow-imports=silent",
                          str(snippet)], capture_output=True, text=True, timeout=600, check=False, env=env,
                         cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "user.py:3:" in errors[0] and "master_dtype" in errors[0], run.stdout
