"""Errors in the user's recipe: usage errors (exit 2) that name the function, the rule and the file, never a raw
traceback unless asked (--verbose / --debug)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from ckptaudit.cli import main
from ckptaudit.recipes import load_object
from runs import SUPPORT

USER = str(SUPPORT / "resume_user_code.py")


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["resume-test", "--no-progress", *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.dist
def test_a_step_that_returns_no_loss_is_a_usage_error_naming_the_rule() -> None:
    code, out, err = run("--recipe", f"{USER}:none_step", "--nproc", "1", "--save-at", "1", "--steps", "1")
    assert code == 2 and out == ""
    assert "NoneStep.step (" in err and "resume_user_code.py" in err
    assert "step must return the loss as a float or a 0-dim tensor; it returned None" in err
    assert "Traceback" not in err and "--verbose" in err


def test_a_syntax_error_in_the_recipe_file(tmp_path: Path) -> None:
    bad = tmp_path / "myrecipe.py"
    bad.write_text("from ckptaudit.recipes.tinygpt import recipe\ndef broken(:\n    pass\n")
    code, _, err = run("--recipe", f"{bad}:recipe")
    assert code == 2
    assert f"syntax error in {bad}, line 2" in err and "Traceback" not in err
    code, _, err = run("--recipe", f"{bad}:recipe", "--verbose")
    assert code == 2 and "Traceback" in err and "SyntaxError" in err


def test_an_import_error_in_the_recipe_file(tmp_path: Path) -> None:
    bad = tmp_path / "myrecipe.py"
    bad.write_text("import no_such_package_anywhere\nrecipe = None\n")
    code, _, err = run("--recipe", f"{bad}:recipe")
    assert code == 2 and "importing" in err and "no_such_package_anywhere" in err and "Traceback" not in err


def test_a_recipe_file_imports_modules_beside_it(tmp_path: Path) -> None:
    (tmp_path / "helpers_for_my_recipe.py").write_text("from ckptaudit.recipes.tinygpt import recipe\n")
    (tmp_path / "my_recipe_file.py").write_text("from helpers_for_my_recipe import recipe\n")
    assert load_object(f"{tmp_path / 'my_recipe_file.py'}:recipe").name == "tinygpt"


def test_module_attr_that_does_not_import_hints_at_the_file_form(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrecipe_not_on_path.py").write_text("recipe = 1\n")
    code, _, err = run("--recipe", "myrecipe_not_on_path:recipe")
    assert code == 2 and "load it by path with myrecipe_not_on_path.py:recipe" in err
    code, _, err = run("--recipe", "no_such_module:recipe")
    assert code == 2 and "cannot import module no_such_module" in err and "path/to/file.py:recipe" in err
    code, _, err = run("--exporter", "ckptaudit.exporters")
    assert code == 2 and "not of the form module:attr" in err


def test_help_shows_the_defaults() -> None:
    from ckptaudit.cli import _parser

    sub = _parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    text = " ".join(sub.choices["resume-test"].format_help().split())  # type: ignore[attr-defined]
    for flag, default in (("--save-at", "(default 8)"), ("--steps", "(default 8)"), ("--margin", "(default 10)"),
                          ("--timeout", "(default 600)")):
        assert flag in text and default in text
    assert "ckptaudit.exporters:documented" in text
