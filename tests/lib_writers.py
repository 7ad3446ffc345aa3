"""Checkpoints written by the real libraries (transformers, accelerate, lightning), for the ``libs`` tests.

Run as a script in a fresh interpreter (``python lib_writers.py hf|lightning OUT``) so the libraries' process-wide
state (Accelerate's ``PartialState`` singleton, logging, seeds, thread settings) never leaks into the test
process. Tiny models built from configs, CPU, one process, 2 optimizer steps; nothing is downloaded (the caller
sets ``HF_HUB_OFFLINE=1``), and no tokenizer code path is touched.

Next to each checkpoint the writer records the truth the audit is judged against (``<checkpoint>.truth.json``): the
parameter names of every param group of the live optimizer, in its order, so a test can check that each
index-keyed entry was attached to the parameter the optimizer really held.

The torchtitan-style checkpoint is written by :func:`write_torchtitan` on 2 real ranks (``ckptaudit.dist.launch``);
it is imported by name, as spawn requires.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

VOCAB, HIDDEN, LAYERS, STEPS = 64, 32, 2, 2


def _groups_by_name(model: Any, optimizer: Any) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _write_truth(checkpoint: str, **truth: Any) -> None:
    """Beside the checkpoint (``<checkpoint>.truth.json``), so it is no part of what is audited."""
    with open(checkpoint.rstrip("/") + ".truth.json", "w") as fh:
        json.dump(truth, fh, indent=1)


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face: Trainer, Accelerate, sharded save_pretrained


def _token_dataset(n: int = 16, seq: int = 8) -> Any:
    import torch

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = torch.randint(0, VOCAB, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    return Tokens()


def _gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=HIDDEN, n_layer=LAYERS, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)  # lm_head.weight is tied to transformer.wte.weight


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _trainer(out: str, *, bin_weights: bool) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    class V4BinTrainer(Trainer):
        """Writes ``pytorch_model.bin`` as transformers 4.x did with ``save_safetensors=False``.

        transformers 5 dropped that option (its ``save_pretrained`` writes safetensors only) but still loads
        ``pytorch_model.bin``; checkpoints from 4.x Trainers are everywhere. v4 wrote ``torch.save`` of the
        model's ``state_dict()`` (tied weights kept under both names), the config and the training arguments;
        everything else below is the real Trainer's own checkpointing.
        """

        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            assert output_dir is not None
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.model.state_dict() if state_dict is None else state_dict,
                       os.path.join(output_dir, "pytorch_model.bin"))
            self.model.config.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    model = _gpt2()
    args = TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=STEPS, per_device_train_batch_size=4,
                             weight_decay=0.01, report_to=[], use_cpu=True, logging_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    cls = V4BinTrainer if bin_weights else Trainer
    trainer = cls(model=model, args=args, train_dataset=_token_dataset())
    trainer.train()
    _write_truth(os.path.join(out, f"checkpoint-{STEPS}"), groups=_groups_by_name(model, trainer.optimizer),
                 params=[n for n, _ in model.named_parameters()])


def _accelerate(out: str, *, frozen: str | None, safe_serialization: bool) -> None:
    import torch
    from accelerate import Accelerator

    model = _llama()
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    accelerator = Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(_token_dataset(), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for step, batch in enumerate(loader):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step + 1 == STEPS:
            break
    accelerator.save_state(out, safe_serialization=safe_serialization)
    unwrapped = accelerator.unwrap_model(model)
    _write_truth(out, groups=_groups_by_name(unwrapped, optimizer.optimizer), frozen=frozen,
                 params=[n for n, _ in unwrapped.named_parameters()])


def _sharded(out: str) -> None:
    model = _llama()
    model.save_pretrained(out, max_shard_size="20KB")
    _write_truth(out, params=[n for n, _ in model.named_parameters()])


def write_hf(out: str) -> None:
    _trainer(os.path.join(out, "trainer-safetensors"), bin_weights=False)
    _trainer(os.path.join(out, "trainer-bin"), bin_weights=True)
    _accelerate(os.path.join(out, "accelerate"), frozen=None, safe_serialization=True)
    # gate_proj and up_proj have the same shape: with one of them frozen, index-keyed state cannot say which.
    _accelerate(os.path.join(out, "accelerate-bin-frozen"), frozen="model.layers.0.mlp.gate_proj.weight",
                safe_serialization=False)
    _sharded(os.path.join(out, "sharded"))


# ----------------------------------------------------------------------------------------------------------------
# Lightning


def _lightning(out: str, precision: str) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPT, lm_loss

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # A persistent buffer registered before the model: first in state_dict order, not a parameter.
            self.register_buffer("tokens_seen", torch.zeros(()))
            self.model = TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=HIDDEN, n_layers=LAYERS))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            self.tokens_seen += tokens.numel()
            return lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])

        def configure_optimizers(self) -> Any:
            # nanoGPT's split: weight decay on matrices and embeddings, none on biases and norm weights.
            decay = [p for p in self.parameters() if p.dim() >= 2]
            no_decay = [p for p in self.parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (16, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4, shuffle=True)
    module = LitGPT()
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, precision=precision, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=STEPS, save_top_k=-1)])
    trainer.fit(module, loader)
    (ckpt,) = (n for n in os.listdir(out) if n.endswith(".ckpt"))
    _write_truth(os.path.join(out, ckpt), groups=_groups_by_name(module, trainer.optimizers[0]),
                 params=[n for n, _ in module.named_parameters()])


def write_lightning(out: str) -> None:
    _lightning(os.path.join(out, "fp32"), "32-true")
    _lightning(os.path.join(out, "bf16-true"), "bf16-true")


# ----------------------------------------------------------------------------------------------------------------
# torchtitan's checkpoint layout, written by a real 2-rank FSDP2 job


def write_torchtitan(ctx: Any, out: str, steps: int) -> dict[str, Any]:
    """(2 ranks) Train the built-in FSDP2 recipe and save what torchtitan's ``CheckpointManager`` saves.

    Mirrors torchtitan's key layout (``components/checkpoint.py``): the model state dict flattened into the top
    level; ``optimizer`` from ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
    (``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``); ``lr_scheduler`` (the first scheduler's state dict);
    ``dataloader`` (``{"dp_rank_<r>": pickled loader state, "world_size": n}``); ``train_state`` (``step``,
    ``ntokens_seen``); saved with ``torch.distributed.checkpoint.save`` into ``step-<N>``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    from ckptaudit.recipes.tinygpt import recipe

    job = recipe.setup(ctx)
    ntokens = 0
    for _ in range(steps):
        recipe.step(job)
        ntokens += recipe.batch_size * recipe.cfg.seq_len * ctx.world_size

    class _Stateful(Stateful):
        def __init__(self, get: Any) -> None:
            self._get = get

        def state_dict(self) -> dict[str, Any]:
            return dict(self._get())

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            raise NotImplementedError("this job only saves")

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    states: dict[str, Any] = {
        "optimizer": _Stateful(lambda: get_optimizer_state_dict(job.model, job.optimizer, options=flat)),
        "lr_scheduler": _Stateful(job.scheduler.state_dict),
        "dataloader": _Stateful(lambda: {f"dp_rank_{ctx.rank}": pickle.dumps(job.data.state_dict()),
                                         "world_size": ctx.world_size}),
        "train_state": _Stateful(lambda: {"step": job.step, "ntokens_seen": ntokens}),
    }
    states.update(get_model_state_dict(job.model))
    path = os.path.join(out, f"step-{job.step}")
    dcp.save(states, checkpoint_id=path)
    return {"path": path, "params": [n for n, _ in job.model.named_parameters()], "step": job.step}


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed (ZeRO stages 0-3, bf16 and fp16 engines), 2 real CPU ranks


def _deepspeed_rank(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks) Train a tiny model 2 steps with ``deepspeed.initialize`` per variant; ``save_checkpoint`` each.

    The model's sizes are odd on purpose (91, 13 and 4 elements): ZeRO-1/2 pads each group's flat buffer and
    ZeRO-3 pads each parameter's partition, so a reader that ignores padding misplaces every later parameter.
    ``s1-bf16`` is saved at steps 2 and 4 (``latest`` names ``global_step4``). ``s2-bf16-rounded`` rounds the fp32
    masters to bf16 values in the engine's own optimizer before saving: the true positive.
    """
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world_size))
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")  # joins the group ckptaudit.dist.launch already made

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))
            self.body = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 4))

        def forward(self, x: Any) -> Any:
            self.seen += x.shape[0]
            return self.body(x)

    variants = [("s0-bf16", 0, "bf16"), ("s1-bf16", 1, "bf16"), ("s2-bf16", 2, "bf16"), ("s3-bf16", 3, "bf16"),
                ("s2-fp16", 2, "fp16"), ("s2-bf16-rounded", 2, "bf16"), ("s0-fp32", 0, "fp32")]
    kinds = {}
    for name, stage, dtype in variants:
        torch.manual_seed(0)
        model = Tiny()
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            # warmup_min_lr > 0: from 0 (the default), the first step is a no-op and the masters still equal the
            # bf16-cast initial weights after 2 steps (a step-0 checkpoint, not what these tests are about).
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}},
            **({dtype: {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}}
               if dtype != "fp32" else {}),
            "zero_optimization": {"stage": stage}}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config)
        gen = torch.Generator().manual_seed(ctx.rank)
        half = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        for step in range(1, 5 if name == "s1-bf16" else 3):
            loss = engine(torch.randn(2, 7, generator=gen).to(half)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            if name == "s2-bf16-rounded" and step == 2:
                for flat in optimizer.single_partition_of_fp32_groups:
                    flat.data.copy_(flat.data.to(torch.bfloat16).float())
            if step % 2 == 0:
                engine.save_checkpoint(os.path.join(out, name), client_state={"batches_seen": 2 * step})
        kinds[name] = type(optimizer).__name__
        if stage > 0 and ctx.rank == 0:
            # DeepSpeed's own consolidation of the fp32 masters (zero_to_fp32), as a plain torch.save beside the root.
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            fp32 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, name))
            torch.save({k: v.detach().clone().contiguous() for k, v in fp32.items()},
                       os.path.join(out, f"{name}.zero_to_fp32.pt"))
        torch.distributed.barrier()
    return {"optimizers": kinds, "params": [n for n, _ in Tiny().named_parameters()]}


def write_deepspeed(out: str) -> None:
    from ckptaudit.dist.launch import launch

    info = launch(_deepspeed_rank, 2, (out,), timeout_s=900, env={"DS_ACCELERATOR": "cpu"})[0]
    _write_truth(out, **info)


def run_writer(what: str, out: str, timeout_s: float = 600) -> None:
    """(test process) Run ``write_<what>`` in a fresh interpreter, offline, one thread; raise with its output."""
    import subprocess
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    # cwd=out: whatever a library drops into its working directory (logs, caches) stays out of the repository.
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), what, out], env=env, cwd=out,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"lib_writers {what} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


if __name__ == "__main__":
    what, where = sys.argv[1], sys.argv[2]
    {"hf": write_hf, "lightning": write_lightning, "deepspeed": write_deepspeed}[what](where)
