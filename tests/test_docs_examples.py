"""The worked example of docs/resume-test.md (docs/examples/my_recipe.py and my_exporter.py) runs as documented."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ckptaudit.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.mark.dist
def test_the_documented_example_recipe_and_exporter_resume_faithfully() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["resume-test", "--recipe", f"{EXAMPLES / 'my_recipe.py'}:recipe",
                 "--exporter", f"{EXAMPLES / 'my_exporter.py'}:export", "--exporter", "ckptaudit.exporters:fp16_copy",
                 "--save-at", "3", "--steps", "3", "--format", "json", "--no-progress"], stdout=out, stderr=err)
    doc = json.loads(out.getvalue())
    verdicts = {c["exporter"].rpartition(":")[2]: c["verdict"] for c in doc["resume"]["candidates"]}
    assert verdicts == {"export": "faithful", "fp16_copy": "drift"}, err.getvalue()
    assert doc["resume"]["power"] and "rounded to bfloat16" in doc["resume"]["control"]["what"]
    assert code == 1  # the fp16 copy is an error finding
    mine = doc["resume"]["candidates"][0]
    assert mine["loader"].startswith("load (") and all(v["status"] == "restored" for v in mine["restore"].values())
