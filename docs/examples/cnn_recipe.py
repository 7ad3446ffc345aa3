"""A user's recipe for ``ckptaudit resume-test``, ``probe`` and ``export-serving``: a small CNN classifying images,
under FSDP2 with bf16 compute, with dropout (it draws from torch's generator, so the checkpoint must restore it).

Nothing here is a language model: the batches are images and labels, and ``forward``/``eval_loss`` tell ckptaudit
how to run the model on them. Run it from the repository root (docs/recipes.md, "Any model", has every command)::

    .venv/bin/python -m ckptaudit resume-test --recipe docs/examples/cnn_recipe.py:recipe \\
        --exporter docs/examples/my_exporter.py:export --exporter ckptaudit.exporters:compute_copy
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ckptaudit.recipe import Job

SIDE, CLASSES = 12, 4


class ToyImages:
    """Seeded images whose class is the template they match best; the position is the whole state.

    Global batch ``k`` is drawn from ``(seed, k)`` and each rank takes its slice, as a distributed sampler would."""

    def __init__(self, *, seed: int, rank: int, world_size: int, global_batch: int = 16) -> None:
        if global_batch % world_size:
            raise ValueError(f"global_batch {global_batch} is not divisible by the world size {world_size}")
        self.seed, self.per_rank = seed, global_batch // world_size
        self.first, self.global_batch = rank * self.per_rank, global_batch
        self.position = 0
        self.templates = torch.randn(CLASSES, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))

    def batch_at(self, position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        images = torch.randn(size, 1, SIDE, SIDE, generator=g)
        labels = torch.einsum("bchw,kchw->bk", images, self.templates).argmax(dim=1)
        return images, labels

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.batch_at(self.position, self.global_batch)
        self.position += 1
        rows = slice(self.first, self.first + self.per_rank)
        return images[rows], labels[rows]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GELU(),
                                      nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.GELU())
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(16 * (SIDE // 2) ** 2, CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class CNNRecipe:
    name = "small-cnn"
    seed = 0
    compute_dtype = "bfloat16"

    def build_model(self) -> nn.Module:
        """The unwrapped model in fp32 (``export-serving`` loads a checkpoint's weights into it)."""
        return SmallCNN()

    def setup(self, ctx: Any) -> Job:
        """(all ranks) The CNN sharded by FSDP2 (the convolutions, the head, the root) with bf16 compute copies."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch.manual_seed(self.seed)
        model = self.build_model()
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for part in (model.features, model.head, model):
            fully_shard(part, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
        data = ToyImages(seed=self.seed, rank=ctx.rank, world_size=ctx.world_size)
        torch.manual_seed(self.seed + 1)  # the dropout stream: the same on every rank, restored from the checkpoint
        return Job(model=model, optimizer=optimizer, scheduler=scheduler, data=data)

    def step(self, job: Job) -> torch.Tensor:
        images, labels = job.data.next()
        loss = F.cross_entropy(job.model(images).float(), labels)
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        job.scheduler.step()
        job.step += 1
        return loss.detach()

    def eval_batch(self, job: Job | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A held-out batch (images, labels), the same on every rank and offline (``job`` is then None)."""
        return ToyImages(seed=self.seed, rank=0, world_size=1).batch_at(1_000_000, 64)

    def forward(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The model on the batch's images: the class logits (the serving gate compares them row by row)."""
        return model(batch[0])

    def eval_loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]).float(), batch[1])


recipe = CNNRecipe()
