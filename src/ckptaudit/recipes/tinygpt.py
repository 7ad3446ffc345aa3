"""A tiny GPT-style language model: token and position embeddings, pre-norm attention + MLP blocks, LayerNorm.

Small enough to train for a few steps on 2 CPU cores in a second, big enough to have every kind of tensor a
real checkpoint has (embeddings, square and rectangular matrices, biases, norm weights initialised to ones).

The built-in recipe is world-size invariant, so a checkpoint saved on N ranks can be resumed on M: one global
batch per step, each rank takes its slice; dropout masks are keyed by the sample's global row and a draw from
torch's RNG (identical on every rank), not by the rank that happens to hold the row.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.1


class SampleDropout(nn.Module):
    """Dropout whose mask for each row of the batch depends on ``(key, global row, site)`` only.

    The owning :class:`TinyGPT` sets ``key`` (a draw from torch's RNG) and the global index of its first row
    before a training forward; the mask of a sample is then the same whichever rank holds it and however the
    global batch is split. Without a key (a forward outside the recipe's step) it is plain dropout.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        self.p, self.site = p, site
        self.key: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.key is None:
            return F.dropout(x, self.p, training=True)
        base, first_row = self.key
        masks = []
        for i in range(x.shape[0]):
            g = torch.Generator().manual_seed((base + (first_row + i) * 1_000_003 + self.site * 7919) % 2**63)
            masks.append(torch.rand(x.shape[1:], generator=g) >= self.p)
        mask = torch.stack(masks).to(x.device)
        return x * mask.to(x.dtype) / (1.0 - self.p)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, site: int = 0) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        h = self.n_heads
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, site: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, site)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, site=1 + i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.drop = SampleDropout(cfg.dropout, 0)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def set_dropout_key(self, key: tuple[int, int] | None) -> None:
        """``(draw from torch's RNG, global index of this rank's first row)`` for the next training forward."""
        for m in self.modules():
            if isinstance(m, SampleDropout):
                m.key = key


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------------------------
# The built-in recipe (see ckptaudit.recipe for the protocol)


class SyntheticTokens:
    """Seeded synthetic token sequences with a learnable rule; its position is its whole state.

    Global batch ``k`` (``global_batch`` sequences) depends only on ``(seed, k)``; rank ``r`` of ``W`` takes rows
    ``[r * b, (r + 1) * b)`` with ``b = global_batch / W``. Restoring ``position`` restores the stream, on any
    number of ranks that divides the global batch.
    """

    def __init__(self, cfg: GPTConfig, *, seed: int, rank: int, batch_size: int, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"SyntheticTokens: rank {rank} is not in a world of {world_size} rank(s); pass "
                             f"world_size= (each rank takes its own rows of the global batch)")
        self.cfg, self.seed, self.rank = cfg, seed, rank
        self.batch_size = batch_size
        """Rows of this rank."""
        self.global_batch = batch_size * world_size
        self.first_row = rank * batch_size
        """Global index of this rank's first row."""
        self.position = 0

    def global_batch_at(self, position: int, size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + position * 8191)
        v, t = self.cfg.vocab_size, self.cfg.seq_len + 1
        start = torch.randint(0, v, (size, 1), generator=g)
        stride = torch.randint(1, 7, (size, 1), generator=g)
        seq = (start + stride * torch.arange(t)) % v
        noise = torch.rand(size, t, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, v, (size, t), generator=g), seq)

    def batch_at(self, position: int) -> torch.Tensor:
        rows = self.global_batch_at(position, self.global_batch)
        return rows[self.first_row:self.first_row + self.batch_size]

    def next(self) -> torch.Tensor:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


@dataclass(frozen=True, kw_only=True)
class TinyGPTRecipe:
    """A tiny GPT trained with AdamW and a warmup + cosine schedule on :class:`SyntheticTokens`.

    ``wrap``: ``fsdp2`` (``fully_shard`` per block and at the root), ``ddp`` or ``none``.
    ``param_dtype``: FSDP2 ``MixedPrecisionPolicy`` compute dtype (``None``: no mixed precision).
    ``master_dtype``: the dtype of the sharded parameters the optimizer updates (``bfloat16`` casts the model
    before ``fully_shard``: a run with low-precision masters).
    ``global_batch_size``: sequences per step over all ranks, split evenly (the world size must divide it), so
    the run is the same on any number of ranks; ``None``: ``batch_size`` sequences per rank.
    """

    name: str = "tinygpt"
    seed: int = 0
    cfg: GPTConfig = GPTConfig()
    wrap: str = "fsdp2"
    param_dtype: str | None = "bfloat16"
    master_dtype: str = "float32"
    lr: float = 3e-3
    warmup_steps: int = 4
    total_steps: int = 64
    batch_size: int = 4
    global_batch_size: int | None = 8

    def setup(self, ctx: Any) -> Any:
        from ckptaudit.recipe import Job

        torch.manual_seed(self.seed)
        base = TinyGPT(self.cfg)
        if self.master_dtype != "float32":
            base = base.to(getattr(torch, self.master_dtype))
        model = self._wrap(base, ctx)
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)
        warm, total = self.warmup_steps, self.total_steps

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        per_rank = self.batch_size
        if self.global_batch_size is not None:
            if self.global_batch_size % ctx.world_size:
                raise ValueError(f"global_batch_size {self.global_batch_size} is not divisible by the world size "
                                 f"{ctx.world_size}; run on a number of ranks that divides it")
            per_rank = self.global_batch_size // ctx.world_size
        data = SyntheticTokens(self.cfg, seed=self.seed, rank=ctx.rank, batch_size=per_rank,
                               world_size=ctx.world_size)
        # One RNG stream on every rank: each step draws the dropout key from it (masks depend on the global
        # row, so ranks still drop different units, and the run does not depend on the world size). Python's
        # and NumPy's generators too, so every rank's RNG state is the same (and a checkpoint may hold one).
        torch.manual_seed(self.seed * 7919)
        random.seed(self.seed * 7919)
        np.random.seed(self.seed * 7919)
        return Job(model=model, optimizer=opt, scheduler=sched, data=data)

    def _wrap(self, model: nn.Module, ctx: Any) -> nn.Module:
        if self.wrap == "none":
            return model
        if self.wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        if self.wrap != "fsdp2":
            raise ValueError(f"wrap must be fsdp2, ddp or none, not {self.wrap!r}")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = "cuda" if ctx.backend == "nccl" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
            model = model.cuda()
        mesh = init_device_mesh(device, (ctx.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if self.param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=getattr(torch, self.param_dtype), reduce_dtype=torch.float32
            )
        blocks: list[nn.Module] = list(model.blocks) if isinstance(model, TinyGPT) else []
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def step(self, job: Any) -> float:
        batch = job.data.next()
        device = next(job.model.parameters()).device
        batch = batch.to(device)
        core = _core(job.model)
        if core is not None:
            core.set_dropout_key((int(torch.randint(0, 2**62, (1,))), job.data.first_row))
        logits = job.model(batch[:, :-1])
        loss = lm_loss(logits, batch[:, 1:])
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        if job.scheduler is not None:
            job.scheduler.step()
        job.step += 1
        return float(loss.detach())

    def eval_batch(self, job: Any) -> torch.Tensor:
        """A fixed held-out batch of token sequences (positions far beyond any training run), for the probe's
        armed forward, an exporter's ``prepare`` and the serving quality gate (its next-token loss)."""
        data = SyntheticTokens(self.cfg, seed=self.seed + 1, rank=0, batch_size=16)
        return data.batch_at(10_000)

    def forward(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """The logits for every token but the last (each sequence's last token is only a target)."""
        return model(batch[:, :-1])

    def build_model(self) -> nn.Module:
        """An unwrapped model of this recipe's architecture (for offline evaluation)."""
        return TinyGPT(self.cfg)


def _core(model: nn.Module) -> TinyGPT | None:
    """The TinyGPT inside a wrapper (DDP's ``module``; FSDP2 wraps in place)."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, TinyGPT) else None


recipe = TinyGPTRecipe()
"""The built-in recipe: FSDP2, bf16 compute, fp32 masters."""

low_precision_recipe = TinyGPTRecipe(name="tinygpt-bf16-masters", master_dtype="bfloat16")
"""The same job trained with bf16 masters (the model is cast to bf16 before ``fully_shard``)."""

plain_recipe = TinyGPTRecipe(name="tinygpt-plain", wrap="none", param_dtype=None)
"""No wrapping, fp32 throughout (one process or many replicas with identical data)."""
