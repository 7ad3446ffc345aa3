"""The serving gate on models that are not language models: a regression MLP, an embedding model and a classifier
fed float features, each exported from a real ``torch.save`` training checkpoint by the CLI. The exported model's
float inputs must be cast to its compute dtype (bf16 weights cannot multiply fp32 features), the metric must fit
the output (values, vectors, class scores), and a broken conversion must still fail."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.cli import main
from ckptaudit.serving.gate import GateThresholds, compare_outputs, judge_gate, output_kind

RECIPES = '''
import torch
from torch import nn
from torch.nn import functional as F


def _features(n=128, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g)


class Regression:
    name, seed = "regression", 0

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

    def eval_batch(self, job):
        x = _features()
        return x, x.sum(dim=1, keepdim=True)

    def forward(self, model, batch):
        return model(batch[0])

    def eval_loss(self, model, batch):
        return F.mse_loss(model(batch[0]), batch[1])


class Embedding:
    name, seed = "embedding", 0
    output_kind = "embedding"

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))

    def eval_batch(self, job):
        return _features()


class Classifier:
    name, seed = "classifier", 0

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 5))

    def eval_batch(self, job):
        return {"input": _features()}


class _Takes(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input):
        return self.inner(input)


class KeywordClassifier(Classifier):
    def build_model(self):
        return _Takes(super().build_model())


regression, embedding, classifier = Regression(), Embedding(), KeywordClassifier()


def zero_first(name, tensor, dtype):
    out = tensor.to(dtype)
    return torch.zeros_like(out) if name.endswith("0.weight") else out
'''

CASES = {"regression": ("values", True), "embedding": ("embedding", False), "classifier": ("logits", False)}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The recipes file and, per recipe, a training checkpoint (model and optimizer state, ``torch.save``)."""
    from ckptaudit.recipes import load_object

    root = tmp_path_factory.mktemp("any-model")
    (root / "recipes_any.py").write_text(RECIPES)
    ckpts = {}
    for name in CASES:
        recipe = load_object(f"{root / 'recipes_any.py'}:{name}")
        torch.manual_seed(1)
        model = recipe.build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):  # a few real updates: weights that need fp32's low bits
            x = torch.randn(16, 8)
            out = model(input=x) if name == "classifier" else model(x)
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        path = root / f"{name}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        ckpts[name] = path
    return {"root": root, "ckpts": ckpts}


def export(made: dict[str, Any], name: str, out: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    o, e = io.StringIO(), io.StringIO()
    code = main(["export-serving", str(made["ckpts"][name]), "--recipe", f"{made['root'] / 'recipes_any.py'}:{name}",
                 "--out", str(out), "--format", "json", "--no-progress", *extra], stdout=o, stderr=e)
    return code, (json.loads(o.getvalue()) if o.getvalue() else {}), e.getvalue()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_model_fed_float_inputs_exports_to_bf16_and_passes_a_gate_that_fits_its_output(
        made: dict[str, Any], name: str, tmp_path: Path) -> None:
    code, doc, err = export(made, name, tmp_path / "out")
    assert code == 0, err  # no "Float and BFloat16": the float features were cast to bf16 for the bf16 model
    kind, has_loss = CASES[name]
    gate = doc["serving"]["gate"]
    m = gate["metrics"]
    assert gate["passed"] and m["kind"] == kind
    assert (m["top1_agreement"] is not None) == (kind == "logits")
    assert (m["loss_source"] == "eval_loss") == has_loss and (m["loss_diff"] is not None) == has_loss
    assert 0 < m["max_rel_diff"] < 0.05  # the bf16 rounding is seen, and small
    codes = [f["code"] for f in doc["findings"]]
    assert codes == ([] if has_loss else ["gate.no-loss"])
    if kind == "values":
        # One row, the whole output at one scale: its size, and no vocabulary or positions a regressor lacks.
        assert m["values"] == 128 and "vocab" not in m and "positions" not in m
    else:
        assert m["positions"] == 128


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_broken_conversion_fails_the_gate_for_every_kind_of_output(made: dict[str, Any], name: str,
                                                                      tmp_path: Path) -> None:
    code, doc, err = export(made, name, tmp_path / "out", "--convert",
                            f"{made['root'] / 'recipes_any.py'}:zero_first")
    assert code == 1, err
    failed = {f["subject"] for f in doc["findings"] if f["code"] == "gate.failed"}
    assert "max_rel_diff" in failed and not (tmp_path / "out").exists()


def test_output_kinds_and_their_metrics() -> None:
    assert output_kind(torch.zeros(4, 1)) == "values" and output_kind(torch.zeros(4)) == "values"
    assert output_kind(torch.zeros(4, 3)) == "logits" and output_kind(torch.zeros(2, 5, 7)) == "logits"
    assert output_kind(torch.zeros(4, 3), "embedding") == "embedding"
    with pytest.raises(ValueError, match="output_kind 'scores' is not one of logits, embedding, values"):
        output_kind(torch.zeros(4, 3), "scores")
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    swapped = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    logits = compare_outputs(ref, swapped, kind="logits")
    assert logits.top1_agreement == 0.0 and logits.min_cosine == 0.0
    embedding = compare_outputs(ref, swapped, kind="embedding")
    assert embedding.top1_agreement is None and embedding.min_cosine == 0.0
    assert [c.metric for c in judge_gate(embedding, GateThresholds()).checks] == ["max_abs_diff", "max_rel_diff",
                                                                              "min_cosine"]
    # Values are compared at one scale: a small error on a value near 0 is not a 100 % error.
    values = compare_outputs(torch.tensor([100.0, 1e-3]), torch.tensor([100.0, 2e-3]), kind="values")
    assert (values.positions, values.vocab) == (1, 2) and values.max_rel_diff == pytest.approx(1e-5)
    loss = compare_outputs(ref, ref, kind="values", losses=(0.5, 0.75))
    assert loss.loss_diff == 0.25 and loss.loss_source == "eval_loss"
