"""A user's recipe for ``ckptaudit resume-test``, ``probe`` and ``export-serving``: a small MLP classifier on
feature vectors, under FSDP2 with bf16 compute.

Copy this file next to your training code and replace the model, the data and the step with yours. Run it from
the repository root (2 ranks train and save, then fresh processes resume; docs/recipes.md, "Any model", has the
probe and export-serving commands too)::

    .venv/bin/python -m ckptaudit resume-test --recipe docs/examples/my_recipe.py:recipe \\
        --exporter docs/examples/my_exporter.py:export

What ckptaudit needs from a recipe (docs/resume-test.md, "The protocol"):

- ``name`` and ``seed``;
- ``setup(ctx) -> Job``, run on every rank after the process group exists (``ctx.rank``, ``ctx.world_size``,
  ``ctx.backend``, ``ctx.shared_dir``), building everything from the seed: the same ``setup`` builds the run that
  saves and every fresh run that restores;
- ``step(job) -> loss``, run on every rank: one optimizer step; returns the loss as a float or a 0-dim tensor and
  advances ``job.step`` (ckptaudit advances it when the recipe does not);
- for ``probe``, an exporter's ``prepare`` and ``export-serving`` (optional): ``eval_batch(job)``, a held-out batch
  in whatever form your model takes (here features and labels), ``forward(model, batch)``, the model on it, and
  ``eval_loss(model, batch)``, the loss the serving gate compares; ``build_model()``, the unwrapped fp32 model.

To be judged at all, the steps must be reproducible: seed everything from ``seed`` and the data position, not from
the clock or the process.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ckptaudit.recipe import Job


class ToyClassification:
    """A data source whose position is its whole state (it has ``state_dict``/``load_state_dict``).

    Global batch ``k`` is drawn from ``(seed, k)``; each rank takes its slice, so the run is the same on any
    number of ranks that divides the global batch (``--resume-nproc`` works)."""

    def __init__(self, *, seed: int, rank: int, world_size: int, global_batch: int = 16) -> None:
        if global_batch % world_size:
            raise ValueError(f"global_batch {global_batch} is not divisible by the world size {world_size}")
        self.seed, self.per_rank = seed, global_batch // world_size
        self.first, self.global_batch = rank * self.per_rank, global_batch
        self.position = 0
        self.teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        x = torch.randn(self.global_batch, 16, generator=g)
        y = (x @ self.teacher).argmax(dim=1)
        self.position += 1
        rows = slice(self.first, self.first + self.per_rank)
        return x[rows], y[rows]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class MyRecipe:
    name = "my-mlp"
    seed = 0
    compute_dtype = "bfloat16"
    """Optional: the dtype forward computes in (the positive control rounds the masters to it)."""

    def build_model(self) -> nn.Module:
        """The unwrapped model in fp32 (``export-serving`` loads a checkpoint's weights into it)."""
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def setup(self, ctx: Any) -> Job:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch.manual_seed(self.seed)
        model = self.build_model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)), mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(math.pi * min(s, 100) / 100)))
        data = ToyClassification(seed=self.seed, rank=ctx.rank, world_size=ctx.world_size)
        return Job(model=model, optimizer=optimizer, scheduler=scheduler, data=data)

    def step(self, job: Job) -> torch.Tensor:
        x, y = job.data.next()
        loss = F.cross_entropy(job.model(x).float(), y)
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        job.scheduler.step()
        job.step += 1
        return loss.detach()

    def eval_batch(self, job: Job | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A held-out batch (features, labels), the same on every rank and offline (``job`` is then None)."""
        data = ToyClassification(seed=self.seed, rank=0, world_size=1, global_batch=256)
        data.position = 1_000_000  # far beyond any training run
        return data.next()

    def forward(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The model on the batch's features: the class logits."""
        return model(batch[0])

    def eval_loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The serving gate compares this loss between the fp32 model and the exported one."""
        return F.cross_entropy(model(batch[0]).float(), batch[1])


recipe = MyRecipe()
