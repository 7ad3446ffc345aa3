"""What the serving quality gate measures for sound and for broken exports: the figures behind its default limits.

    .venv/bin/python bench/serving_gate.py [--steps 6 300] [--device cpu]

For each model (the built-in tiny GPT, and a wider one, each trained for a few and for many steps in one process,
fp32) it exports the weights every way below and prints the gate's metrics and verdict:

- sound conversions: bf16, fp16, bf16 with the LayerNorms kept in fp32;
- formats too coarse for the model: unscaled float8 (e4m3fn, e5m2);
- broken conversions (a custom ``convert``): one matrix zeroed, one matrix's rows permuted, 1% noise on one matrix;
- a source whose activations leave fp16's range (one MLP's input weights and bias x 2**16, its output weights
  / 2**16: the fp32 model computes nearly the same function, GELU being almost linear away from 0) exported as
  bf16 and as fp16.

The gate checks the *conversion*: both sides of the comparison are the same checkpoint, so damage that is already
in the checkpoint (a zeroed matrix in the training state) is the audit's and the resume test's business, not the
gate's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

from ckptaudit.launch import RankContext
from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPTRecipe
from ckptaudit.serving.export import ExportOptions, export_serving
from ckptaudit.serving.gate import GateThresholds, judge_gate

tiny = TinyGPTRecipe(name="tinygpt-plain", wrap="none", param_dtype=None)
wide = TinyGPTRecipe(name="widegpt-plain", wrap="none", param_dtype=None, lr=1e-3, total_steps=400,
                     cfg=GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=4, n_layers=4))
RECIPES = {"tiny": tiny, "wide": wide}
MATRIX = "blocks.0.mlp.fc.weight"


def train(recipe: TinyGPTRecipe, steps: int, path: str) -> float:
    job = recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=os.path.dirname(path)))
    loss = float("nan")
    for _ in range(steps):
        loss = recipe.step(job)
    torch.save({"model": job.model.state_dict(), "step": steps}, path)
    return loss


def zero_matrix(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros_like(t, dtype=dtype) if name == MATRIX else t.to(dtype)


def permute_rows(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if name != MATRIX:
        return t.to(dtype)
    return t[torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(0))].to(dtype)


def noise_1pct(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if name != MATRIX:
        return t.to(dtype)
    g = torch.Generator().manual_seed(0)
    return (t + 0.01 * t.std() * torch.randn(t.shape, generator=g)).to(dtype)


def out_of_fp16_range(src: str, dst: str) -> None:
    state = torch.load(src, weights_only=True)
    sd = dict(state["model"])
    sd["blocks.0.mlp.fc.weight"] = sd["blocks.0.mlp.fc.weight"] * 2.0**16
    sd["blocks.0.mlp.fc.bias"] = sd["blocks.0.mlp.fc.bias"] * 2.0**16
    sd["blocks.0.mlp.out.weight"] = sd["blocks.0.mlp.out.weight"] / 2.0**16
    torch.save({"model": sd}, dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[6, 300])
    ap.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    lax = GateThresholds(max_abs_diff=1e9, max_rel_diff=1e9, min_cosine=0.0, min_top1=0.0, max_loss_diff=1e9)
    here = os.path.abspath(__file__)
    cols = ("model", "steps", "loss", "export", "max_abs", "max_rel", "min_cos", "top1", "loss_diff", "default gate")
    print(" | ".join(cols))
    print("|".join("---" for _ in cols))
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for steps in args.steps:
                torch.manual_seed(0)
                src = os.path.join(tmp, f"{model}-{steps}.pt")
                t0 = time.monotonic()
                loss = train(RECIPES[model], steps, src)
                print(f"# trained {model} {steps} steps in {time.monotonic() - t0:.1f}s", file=sys.stderr)
                ranged = os.path.join(tmp, f"{model}-{steps}-ranged.pt")
                out_of_fp16_range(src, ranged)
                cases: list[tuple[str, str, dict[str, Any]]] = [
                    ("bf16", src, {"dtype": "bfloat16"}),
                    ("fp16", src, {"dtype": "float16"}),
                    ("bf16, LayerNorms fp32", src, {"dtype": "bfloat16", "keep_fp32": ("*ln*",)}),
                    ("float8_e4m3fn", src, {"dtype": "float8_e4m3fn"}),
                    ("float8_e5m2", src, {"dtype": "float8_e5m2"}),
                    ("bf16, one matrix zeroed", src, {"dtype": "bfloat16", "convert": zero_matrix}),
                    ("bf16, one matrix's rows permuted", src, {"dtype": "bfloat16", "convert": permute_rows}),
                    ("bf16, 1% noise on one matrix", src, {"dtype": "bfloat16", "convert": noise_1pct}),
                    ("bf16, one MLP x/÷ 2**16", ranged, {"dtype": "bfloat16"}),
                    ("fp16, one MLP x/÷ 2**16", ranged, {"dtype": "float16"}),
                ]
                for label, path, kw in cases:
                    out = os.path.join(tmp, f"out-{len(os.listdir(tmp))}")
                    res = export_serving(path, ExportOptions(recipe=f"{here}:{model}", out=out, thresholds=lax,
                                                             device=args.device, **kw))
                    m = res.gate.metrics
                    verdict = judge_gate(m, GateThresholds())
                    row = (model, str(steps), f"{loss:.2f}", label, _f(m.max_abs_diff), _f(m.max_rel_diff),
                           _c(m.min_cosine), f"{m.top1_agreement:.4f}", _f(m.loss_diff),
                           "pass" if verdict.passed else "FAIL: " + ", ".join(
                               c.metric for c in verdict.checks if not c.passed) + (
                               " (non-finite)" if m.nonfinite else ""))
                    print(" | ".join(row))
    return 0


def _f(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.3g}"


def _c(x: float) -> str:
    return "n/a" if x != x else f"{x:.6f}"


if __name__ == "__main__":
    sys.exit(main())
