"""The examples in docs/examples run as the docs say: docs/recipes.md's "Any model" commands (an MLP on features
and a small CNN on images through resume-test, probe and export-serving), each run exactly as written, from a
scratch directory standing in for the repository root (the example paths resolved to the real files)."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
PREFIX = ".venv/bin/python -m ckptaudit "


def documented_commands() -> list[list[str]]:
    """The command lines between the any-model markers of docs/recipes.md, as argv lists."""
    page = (ROOT / "docs" / "recipes.md").read_text()
    block = page.split("<!-- any-model:start -->", 1)[1].split("<!-- any-model:end -->", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 6, lines
    return [shlex.split(line.removeprefix(PREFIX)) for line in lines]


def run(argv: list[str]) -> tuple[int, dict[str, Any], str]:
    argv = [a.replace("docs/examples/", f"{EXAMPLES}/") for a in argv]
    out, err = io.StringIO(), io.StringIO()
    code = main([*argv, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.mark.dist
@pytest.mark.parametrize("model", ["my_recipe", "cnn_recipe"])
def test_the_any_model_examples_run_as_documented(model: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    resume, probe, serving = [argv for argv in documented_commands() if f"docs/examples/{model}.py:recipe" in argv]
    assert [argv[0] for argv in (resume, probe, serving)] == ["resume-test", "probe", "export-serving"]

    code, doc, err = run(resume)
    assert code == 1, err  # the defect beside the faithful exporter is an error
    verdicts = {c["exporter"].rpartition(":")[2]: c["verdict"] for c in doc["resume"]["candidates"]}
    defect = "fp16_copy" if model == "my_recipe" else "compute_copy"
    assert verdicts == {"export": "faithful", defect: "drift"}, err
    assert doc["resume"]["power"] and "rounded to bfloat16" in doc["resume"]["control"]["what"]
    mine = doc["resume"]["candidates"][0]
    assert mine["loader"].startswith("load (") and all(v["status"] == "restored" for v in mine["restore"].values())
    if model == "cnn_recipe":  # its dropout draws from torch's generator, and the exporter restores it
        assert doc["resume"]["consumed"]["generators"]["torch"] is True

    code, doc, err = run(probe)
    assert code == 0, err
    assert set(doc["probe"]["verdicts"]) == {"faithful"}, doc["probe"]["verdicts"]
    assert (tmp_path / re.sub(r"/.*", "", serving[1]) / "checkpoint").is_dir()

    code, doc, err = run(serving)
    assert code == 0, err
    gate = doc["serving"]["gate"]
    assert gate["passed"] and gate["metrics"]["kind"] == "logits" and gate["metrics"]["vocab"] == 4
    assert gate["metrics"]["loss_source"] == "eval_loss" and gate["metrics"]["top1_agreement"] >= 0.9
    assert (tmp_path / serving[serving.index("--out") + 1] / "model.safetensors").is_file()


@pytest.mark.dist
def test_the_example_exporter_is_restored_whole_by_the_default_loader(tmp_path: Path) -> None:
    """docs/resume-test.md's default layout and docs/examples/my_exporter.py agree: its ``export`` without its
    ``load`` is restored by the default loader, every component judged restored."""
    alone = tmp_path / "alone.py"
    alone.write_text("import importlib.util, sys\n"
                     f"spec = importlib.util.spec_from_file_location('my_exporter', {str(EXAMPLES / 'my_exporter.py')!r})\n"
                     "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n\n\n"
                     "def export(job, path, ctx):\n    mod.export(job, path, ctx)\n")
    code, doc, err = run(["resume-test", "--recipe", "docs/examples/my_recipe.py:recipe", "--exporter",
                          f"{alone}:export", "--save-at", "3", "--steps", "3"])
    assert code == 0, err
    (mine,) = doc["resume"]["candidates"]
    assert mine["verdict"] == "faithful" and mine["loader"] == "ckptaudit.resume.default_load", mine
    assert {k: v["status"] for k, v in mine["restore"].items()} == dict.fromkeys(mine["restore"], "restored"), mine
    from ckptaudit.resume.config import COMPONENTS

    assert set(mine["restore"]) == set(COMPONENTS), mine["restore"]  # every component judged, training step too
