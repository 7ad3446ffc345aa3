"""Checkpoints written by the real libraries (transformers, accelerate, peft, lightning, torchtitan, and
``torch.distributed.checkpoint`` with ``get_state_dict``), for the ``libs`` tests.

Run as a script in a fresh interpreter (``python lib_writers.py hf|lightning|dcp OUT``) so the libraries' process-wide
state (Accelerate's ``PartialState`` singleton, logging, seeds, thread settings) never leaks into the test
process. Tiny models built from configs, CPU, one process, 2 optimizer steps; nothing is downloaded (the caller
sets ``HF_HUB_OFFLINE=1``), and no tokenizer code path is touched.

Next to each checkpoint the writer records the truth the audit is judged against (``<checkpoint>.truth.json``): the
parameter names of every param group of the live optimizer, in its order, so a test can check that each
index-keyed entry was attached to the parameter the optimizer really held.

The torchtitan checkpoint is written by torchtitan's own ``CheckpointManager`` in :func:`write_torchtitan`, on 2 real
ranks (``ckptaudit.launch``); it is imported by name, as spawn requires.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
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


def cast_to_bf16(state: Any) -> Any:
    """(tests) ``state`` with every floating tensor of one or more dimensions cast to bf16: what an exporter that
    casts a mixed-precision run's whole state (parameters and optimizer moments) writes."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.to(torch.bfloat16) if state.is_floating_point() and state.dim() > 0 else state
    if isinstance(state, dict):
        return type(state)((k, cast_to_bf16(v)) for k, v in state.items())
    if isinstance(state, list | tuple):
        return type(state)(cast_to_bf16(v) for v in state)
    return state


def _cpu_grad_scaler() -> Any:
    """A GradScaler for the CPU, the one a fp16 mixed-precision run gets on a GPU (Accelerate, and the Trainer
    through it, create one only for CUDA and other accelerators, never for the CPU)."""
    import torch

    return torch.amp.GradScaler("cpu", init_scale=2.0**8)


def _trainer(out: str, *, bin_weights: bool, fp16: bool = False) -> None:
    """``fp16``: ``TrainingArguments(fp16=True)`` with the GradScaler of a GPU's fp16 run given to the Trainer's own
    Accelerator on the CPU (where it creates none): the Trainer scales, steps and saves it (``scaler.pt``) itself."""
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

    class ScaledTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.accelerator.scaler = _cpu_grad_scaler()  # before prepare(): the optimizer steps through it

    model = _gpt2()
    args = TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=STEPS, per_device_train_batch_size=4,
                             weight_decay=0.01, report_to=[], use_cpu=True, logging_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0, fp16=fp16)
    cls = V4BinTrainer if bin_weights else ScaledTrainer if fp16 else Trainer
    trainer = cls(model=model, args=args, train_dataset=_token_dataset())
    trainer.train()
    _write_truth(os.path.join(out, f"checkpoint-{STEPS}"), groups=_groups_by_name(model, trainer.optimizer),
                 params=[n for n, _ in model.named_parameters()])


def _accelerate(out: str, *, frozen: str | None, safe_serialization: bool, bf16_init: bool = False,
                fp16: bool = False) -> None:
    """``bf16_init``: the weights rounded to bf16 first, as a bf16 release loaded in fp32 gives them. ``fp16``:
    ``mixed_precision="fp16"`` with a GPU run's GradScaler given to the Accelerator (on the CPU it creates none):
    ``backward``, the prepared optimizer and ``save_state`` (``scaler.pt``) use it as theirs."""
    import torch
    from accelerate import Accelerator

    model = _llama()
    if bf16_init:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16" if fp16 else "no")
    if fp16:
        accelerator.scaler = _cpu_grad_scaler()
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


def _peft_lora(out: str) -> None:
    """PEFT LoRA through the real Trainer: base weights from a bf16 release (rounded to bf16, loaded in fp32) and
    frozen; LoRA on q_proj, v_proj and embed_tokens, so PEFT saves the frozen base embedding beside the adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = _llama()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj", "embed_tokens"]))
    args = TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=STEPS, per_device_train_batch_size=4,
                             weight_decay=0.01, learning_rate=1e-3, report_to=[], use_cpu=True, logging_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_token_dataset())
    trainer.train()
    _write_truth(os.path.join(out, f"checkpoint-{STEPS}"), groups=_groups_by_name(model, trainer.optimizer),
                 trainable=[n for n, p in model.named_parameters() if p.requires_grad])


def _each(out: str, configs: dict[str, Callable[[str], None]]) -> None:
    """(writer process) Each configuration into ``out/<name>``, its outcome recorded (see ``configurations.py``):
    one that raises takes no other with it."""
    from configurations import Outcomes, configuration

    outcomes = Outcomes(out, list(configs))

    def one(name: str) -> None:
        with configuration(name):
            configs[name](os.path.join(out, name))

    for name in configs:
        outcomes.run(name, one, name)


def write_hf(out: str) -> None:
    frozen = "model.layers.0.mlp.gate_proj.weight"
    _each(out, {
        "trainer-safetensors": lambda d: _trainer(d, bin_weights=False),
        "trainer-bin": lambda d: _trainer(d, bin_weights=True),
        "accelerate": lambda d: _accelerate(d, frozen=None, safe_serialization=True),
        # gate_proj and up_proj have the same shape: with one of them frozen, index-keyed state cannot say which.
        "accelerate-bin-frozen": lambda d: _accelerate(d, frozen=frozen, safe_serialization=False),
        # The same from a bf16 release: the frozen gate_proj keeps its bf16 values, and the optimizer state cannot
        # say whether it or up_proj is the frozen one (by order beside pytorch_model.bin; by shape beside
        # safetensors).
        "accelerate-bin-frozen-bf16init": lambda d: _accelerate(d, frozen=frozen, safe_serialization=False,
                                                                bf16_init=True),
        "accelerate-frozen-bf16init": lambda d: _accelerate(d, frozen=frozen, safe_serialization=True,
                                                            bf16_init=True),
        "sharded": _sharded,
        "peft-lora": _peft_lora,
        # fp16 mixed precision: the saved GradScaler state is the run's record of its fp32 masters.
        "trainer-fp16": lambda d: _trainer(d, bin_weights=False, fp16=True),
        "accelerate-fp16": lambda d: _accelerate(d, frozen=None, safe_serialization=True, fp16=True),
    })


# ----------------------------------------------------------------------------------------------------------------
# Lightning


def _lightning(out: str, precision: str) -> None:
    """``precision="16-mixed"`` goes in as Lightning's own ``MixedPrecision("16-mixed", "cpu")`` plugin (the
    ``precision`` flag turns 16-mixed into bf16-mixed on the CPU): fp16 autocast and a CPU GradScaler, whose state
    Lightning saves in the ``.ckpt`` under ``MixedPrecision``."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import MixedPrecision

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
    how: dict[str, Any] = ({"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed"
                           else {"precision": precision})
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, **how, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=STEPS, save_top_k=-1)])
    trainer.fit(module, loader)
    (ckpt,) = (n for n in os.listdir(out) if n.endswith(".ckpt"))
    _write_truth(os.path.join(out, ckpt), groups=_groups_by_name(module, trainer.optimizers[0]),
                 params=[n for n, _ in module.named_parameters()])


def write_lightning(out: str) -> None:
    _each(out, {"fp32": lambda d: _lightning(d, "32-true"), "bf16-true": lambda d: _lightning(d, "bf16-true"),
                "16-mixed": lambda d: _lightning(d, "16-mixed")})


# ----------------------------------------------------------------------------------------------------------------
# torchtitan 0.3.0's own CheckpointManager, on a real 2-rank FSDP2 job


def write_torchtitan(ctx: Any, out: str, steps: int) -> dict[str, Any]:
    """(2 ranks) Train the built-in FSDP2 recipe's model with torchtitan's own parts and save with its
    ``CheckpointManager`` (``torchtitan.components.checkpoint``).

    Everything saved is torchtitan's: ``ModelWrapper`` (model FQNs at the top level), ``OptimizersContainer``
    (AdamW, its flat ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>`` state), ``LRSchedulersContainer``
    (``{"last_epoch": n}``), ``ParallelAwareDataloader`` (``dp_rank_<r>``: its pickled ``StatefulDataLoader``
    state, ``world_size``) and ``train_state`` (the Trainer's ``{"step", "ntokens_seen"}``, here a small Stateful
    with the same state dict: torchtitan's ``Trainer`` itself needs a model spec and a tokenizer). The model is
    ckptaudit's tiny GPT under FSDP2 with a bf16 ``MixedPrecisionPolicy`` (fp32 masters), on CPU with gloo, its
    initial weights rounded to bf16 as a bf16 release would give them. Saved twice: ``step-0`` before the first
    step (torchtitan's seed checkpoint) and ``step-<steps>``.
    """
    import torch
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from ckptaudit.recipes.tinygpt import SyntheticTokens, TinyGPT, lm_loss, recipe

    torch.manual_seed(recipe.seed)
    base = TinyGPT(recipe.cfg)
    with torch.no_grad():  # initial weights as a bf16 release gives them, loaded into fp32 masters
        for p in base.parameters():
            p.copy_(p.bfloat16().float())
    model = recipe._wrap(base, ctx)
    optimizers: Any = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.01})],
            implementation="for-loop"),
        model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=8)

    class Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            data = SyntheticTokens(recipe.cfg, seed=recipe.seed, rank=ctx.rank, batch_size=1,
                                   world_size=ctx.world_size)
            while True:
                yield data.next()[0]

    dataloader = ParallelAwareDataloader(Batches(), dp_rank=ctx.rank, dp_world_size=ctx.world_size, batch_size=4)

    class TrainState(Stateful):
        def __init__(self) -> None:
            self.step, self.ntokens_seen = 0, 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]

    train_state = TrainState()
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=steps, keep_latest_k=0),
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder=out)
    # A seed checkpoint before any step: OptimizersContainer.state_dict() fills AdamW's state by its own zero-lr
    # step (init_optim_state: step 1, zero moments).
    assert checkpointer.save(0)
    batches = iter(dataloader)
    for _ in range(steps):
        batch = next(batches)
        lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.step += 1
        train_state.ntokens_seen += batch.numel() * ctx.world_size
        assert checkpointer.save(train_state.step) == (train_state.step % steps == 0)
    checkpointer.close()
    return {"path": os.path.join(out, "checkpoint", f"step-{steps}"), "step": steps,
            "step0": os.path.join(out, "checkpoint", "step-0"),
            "params": [n for n, _ in model.named_parameters()]}


# ----------------------------------------------------------------------------------------------------------------
# get_state_dict + DCP, one process: before the first step, and after real steps


def _gpt_from_a_bf16_release() -> Any:
    """A plain tiny GPT (seeded) whose fp32 weights are bf16-representable, as a bf16 release loaded into fp32."""
    import torch

    from ckptaudit.recipes.tinygpt import TinyGPT, plain_recipe

    torch.manual_seed(0)
    model = TinyGPT(plain_recipe.cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _train(model: Any, opt: Any, sched: Any, steps: int) -> None:
    """``steps`` real steps of the tiny GPT on its synthetic tokens, the scheduler stepped after the optimizer."""
    from ckptaudit.recipes.tinygpt import SyntheticTokens, lm_loss, plain_recipe

    data = SyntheticTokens(plain_recipe.cfg, seed=0, rank=0, batch_size=4)
    for _ in range(steps):
        batch = data.next()
        lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _dcp_job(out: str, *, steps: int, export_rounded: bool, frozen: str | None) -> None:
    """A plain tiny GPT initialised from bf16-representable weights (a bf16 release loaded into fp32), AdamW,
    a LambdaLR warmup; ``steps`` real steps, then ``get_state_dict`` (which fills a fresh AdamW's state by its own
    zero-lr step) and ``torch.distributed.checkpoint.save`` of model, FQN-keyed optimizer, scheduler and train
    step. ``export_rounded``: the model is saved through its bf16 compute copy (the exporter bug: masters rounded
    after real steps). ``frozen``: a parameter left out of the optimizer."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _gpt_from_a_bf16_release()
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    _train(model, opt, sched, steps)
    model_sd, optim_sd = get_state_dict(model, opt)
    if export_rounded:
        model_sd = {k: v.bfloat16().float() for k, v in model_sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": model_sd, "optim": optim_sd, "lr_scheduler": sched.state_dict(),
                  "train_state": {"step": steps}}, checkpoint_id=out)
    _write_truth(out, trainable=[n for n, p in model.named_parameters() if p.requires_grad], frozen=frozen)
    if steps and not export_rounded and frozen is None:
        # The model alone, cast to bf16 for serving: no optimizer state says what its masters were.
        torch.save({k: v.bfloat16() for k, v in model.state_dict().items()}, out + "-model-bf16.pt")


def _finetune_lr0(out: str, *, steps: int = 2) -> None:
    """A fine-tune of a tiny GPT loaded from bf16-representable weights (a bf16 release in fp32) whose lower layers
    are kept by learning rate 0 throughout: AdamW groups ``[embeddings + blocks.0 at lr 0, the rest at 3e-3]``, a
    LambdaLR warmup over both (``initial_lr`` and ``base_lrs`` 0 for the first group), ``steps`` real steps (the
    lr-0 weights get moments, never an update). Saved twice: ``get_state_dict`` + DCP (FQN-keyed groups, the step as
    ``train/step``) at ``out``, and ``torch.save`` of ``model.state_dict()`` and ``optimizer.state_dict()``
    (index-keyed groups, the step as ``trainer/global_step``) at ``out + ".pt"``."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _gpt_from_a_bf16_release()
    kept = [n for n, _ in model.named_parameters() if n.split(".")[0] in ("tok_emb", "pos_emb")
            or n.startswith("blocks.0.")]
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [params[n] for n in kept], "lr": 0.0},
                             {"params": [p for n, p in params.items() if n not in kept], "lr": 3e-3}],
                            weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    before = {n: params[n].detach().clone() for n in kept}
    _train(model, opt, sched, steps)
    assert all(torch.equal(before[n], params[n]) for n in kept), "lr 0 changed a weight"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(),
                "trainer": {"global_step": steps}}, out + ".pt")
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": model_sd, "optim": optim_sd, "lr_scheduler": sched.state_dict(), "train/step": steps},
                 checkpoint_id=out)
    _write_truth(out, lr0=kept, trained=[n for n in params if n not in kept])
    _write_truth(out + ".pt", lr0=kept, trained=[n for n in params if n not in kept])


def write_dcp(out: str) -> None:
    _each(out, {
        "step0": lambda d: _dcp_job(d, steps=0, export_rounded=False, frozen=None),
        "step0-frozen": lambda d: _dcp_job(d, steps=0, export_rounded=False, frozen="tok_emb.weight"),
        "trained": lambda d: _dcp_job(d, steps=2, export_rounded=False, frozen=None),
        "trained-frozen": lambda d: _dcp_job(d, steps=2, export_rounded=False, frozen="tok_emb.weight"),
        "trained-rounded-frozen": lambda d: _dcp_job(d, steps=2, export_rounded=True, frozen="tok_emb.weight"),
        "finetune-lr0": _finetune_lr0,  # also writes finetune-lr0.pt beside it
    })


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed (ZeRO stages 0-3, bf16 and fp16 engines), 2 real CPU ranks


DEEPSPEED_VARIANTS = [("s0-bf16", 0, "bf16"), ("s1-bf16", 1, "bf16"), ("s2-bf16", 2, "bf16"), ("s3-bf16", 3, "bf16"),
                      ("s2-fp16", 2, "fp16"), ("s2-bf16-rounded", 2, "bf16"), ("s0-fp32", 0, "fp32"),
                      ("s1-bf16-warmup0", 1, "bf16"), ("s2-bf16-aligned", 2, "bf16")]
"""(name, ZeRO stage, engine dtype) of every DeepSpeed configuration; each is its own 2-rank launch."""


def _deepspeed_tiny() -> Any:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))
            self.body = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 4))

        def forward(self, x: Any) -> Any:
            self.seen += x.shape[0]
            return self.body(x)

    return Tiny()


def _deepspeed_predicates() -> str:
    """What DeepSpeed's engine asks before it builds an fp16 or bf16 engine on this CPU, and what oneDNN says."""
    import torch
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return (f"DeepSpeed's {type(acc).__name__}.is_fp16_supported() {bool(acc.is_fp16_supported())}, "
            f"is_bf16_supported() {bool(acc.is_bf16_supported())}; torch.ops.mkldnn._is_mkldnn_fp16_supported() "
            f"{bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}, _is_mkldnn_bf16_supported() "
            f"{bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}")


def _deepspeed_rank(ctx: Any, out: str, name: str, stage: int, dtype: str) -> dict[str, Any]:
    """(2 ranks) Train a tiny model 2 steps with ``deepspeed.initialize`` as configuration ``name``; save it.

    The model's sizes are odd on purpose (91, 13 and 4 elements): ZeRO-1/2 pads each group's flat buffer and
    ZeRO-3 pads each parameter's partition, so a reader that ignores padding misplaces every later parameter.
    ``s2-bf16-aligned`` sets ``zero_optimization.parameter_alignment``: DeepSpeed then pads every parameter but the
    last to a multiple of 8 bf16 elements inside the flat buffer (``param_alignment_paddings``), so the padding
    sits between parameters, not only at the end. ``s1-bf16`` is saved at steps 2 and 4 (``latest`` names
    ``global_step4``). ``s2-bf16-rounded`` rounds the fp32
    masters to bf16 values in the engine's own optimizer before saving: the true positive. ``s1-bf16-warmup0``
    keeps DeepSpeed's default ``warmup_min_lr`` 0, so its first two steps apply lr 0: saved after steps 1 and 2
    (masters still the bf16 initial weights, moments non-zero: done right) and 4, its masters rounded to bf16
    after the real steps 3 and 4 (the true positive the lr-0 reading must not excuse).

    Returns ``{"refused": reason}`` when DeepSpeed's engine refuses the dtype on this CPU (its own sanity check,
    before any collective, on both ranks alike).
    """
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world_size))
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")  # joins the group ckptaudit.launch already made
    torch.manual_seed(0)
    model = _deepspeed_tiny()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        # warmup_min_lr > 0: from 0 (the default), the first step is a no-op and the masters still equal the
        # bf16-cast initial weights after 2 steps (a step-0 checkpoint, not what these tests are about).
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        **({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}}}
           if "warmup0" in name else {}),  # DeepSpeed's default warmup_min_lr: 0
        **({dtype: {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}}
           if dtype != "fp32" else {}),
        "zero_optimization": {"stage": stage, **({"parameter_alignment": True} if "aligned" in name else {})}}
    try:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config)
    except ValueError as exc:
        if "is not supported on your device" not in str(exc):
            raise
        return {"refused": f"deepspeed.initialize: {exc} ({_deepspeed_predicates()})"}
    gen = torch.Generator().manual_seed(ctx.rank)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    last = 4 if name.startswith("s1-") else 2
    for step in range(1, last + 1):
        loss = engine(torch.randn(2, 7, generator=gen).to(half)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if name in ("s2-bf16-rounded", "s1-bf16-warmup0") and step == last:
            for flat in optimizer.single_partition_of_fp32_groups:
                flat.data.copy_(flat.data.to(torch.bfloat16).float())
        if step % 2 == 0 or (step == 1 and "warmup0" in name):
            engine.save_checkpoint(os.path.join(out, name), client_state={"batches_seen": 2 * step})
    if stage > 0 and ctx.rank == 0:
        # DeepSpeed's own consolidation of the fp32 masters (zero_to_fp32), as a plain torch.save beside the root.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, name))
        torch.save({k: v.detach().clone().contiguous() for k, v in fp32.items()},
                   os.path.join(out, f"{name}.zero_to_fp32.pt"))
    torch.distributed.barrier()
    return {"optimizer": type(optimizer).__name__}


def write_deepspeed(out: str) -> None:
    """(writer process) Each configuration of :data:`DEEPSPEED_VARIANTS` in its own 2-rank launch, so that one the
    engine refuses on this CPU (fp16 without oneDNN's fp16 kernels) or one that fails takes no other with it."""
    from ckptaudit.launch import launch
    from configurations import Outcomes, Refused

    os.environ["DS_ACCELERATOR"] = "cpu"  # before the fork server imports deepspeed: it picks its accelerator once
    outcomes = Outcomes(out, [name for name, _, _ in DEEPSPEED_VARIANTS])
    # deepspeed.init_distributed JIT-compiles DeepSpeed's one C++ op (shared-memory allreduce) at first use, minutes
    # of g++ on 2 busy cores: done here, once (TORCH_EXTENSIONS_DIR keeps it), outside every rank's deadline.
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
    fast: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "deepspeed", "lib_writers")}

    def one(name: str, stage: int, dtype: str) -> str:
        results = launch(_deepspeed_rank, 2, (out, name, stage, dtype), timeout_s=300, **fast)
        if "refused" in results[0]:
            raise Refused(results[0]["refused"])
        return str(results[0]["optimizer"])

    kinds = {name: outcomes.run(name, one, name, stage, dtype) for name, stage, dtype in DEEPSPEED_VARIANTS}
    _write_truth(out, optimizers={k: v for k, v in kinds.items() if v is not None},
                 params=[n for n, _ in _deepspeed_tiny().named_parameters()])


def run_writer(what: str, out: str, timeout_s: float = 850) -> Any:
    """(test process) Run ``write_<what>`` in a fresh interpreter, offline, one thread; return what it wrote
    (``configurations.Written``: each configuration's path, skip or failure). A writer that dies raises with its
    output, naming the configuration it was writing."""
    from pathlib import Path

    from configurations import Written, in_progress
    from runs import run_script

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
    proc = run_script(__file__, what, out, env=env, timeout_s=timeout_s)
    if proc.returncode != 0:
        during = in_progress(out)
        raise RuntimeError(f"lib_writers {what} died ({proc.returncode})"
                           + (f" while writing configuration {during!r}" if during else "")
                           + f":\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return Written(Path(out), what)


if __name__ == "__main__":
    what, where = sys.argv[1], sys.argv[2]
    {"hf": write_hf, "lightning": write_lightning, "dcp": write_dcp, "deepspeed": write_deepspeed}[what](where)
