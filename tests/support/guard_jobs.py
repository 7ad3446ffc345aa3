"""Training runs with the guard on, for ``test_guard_*.py``: real libraries on CPU, tiny models, one process.

Run as a script in a fresh interpreter (``python guard_jobs.py hf|lightning OUT``, see ``run_job``) so each
library's process-wide state stays out of the test process. Each job writes ``OUT/result.json``: what the
guard decided and what the library's own resume path then did.

The defect: an exporter that rounds the fp32 masters to bf16 values in what it writes at its second save (the
live model keeps its fp32 masters, as an exporter that captured the bf16 compute copies would).

``SlowSteps`` waits at each step end until the guard has no audit pending: it stands for a training step longer
than an audit (the common case at scale), and makes "stopped at the next step boundary after the failing audit"
one exact step for the assertions.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

VOCAB, HIDDEN = 64, 32


def _bf16_values(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: (v.detach().to(torch.bfloat16).float() if v.is_floating_point() else v) for k, v in state.items()}


def rounding_trainer() -> Any:
    """A fresh ``transformers.Trainer`` subclass, the lossy exporter: at its second save the model weights it writes
    are rounded to bf16 values (a class per job: it counts its saves)."""
    from transformers import Trainer

    class RoundingTrainer(Trainer):  # type: ignore[misc]
        saves = 0

        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            RoundingTrainer.saves += 1
            if RoundingTrainer.saves == 2:
                state_dict = _bf16_values(self.model.state_dict())
            super()._save(output_dir, state_dict)

    return RoundingTrainer


def _dataset(n: int = 64, seq: int = 8) -> Any:
    from lib_writers import VOCAB as WRITER_VOCAB
    from lib_writers import _token_dataset

    assert WRITER_VOCAB == VOCAB  # the same tiny vocabulary as the models here
    return _token_dataset(n, seq)


def hf(out: str) -> None:
    _result(out, **_hf_story(out))


def hf_ddp(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks, ckptaudit.launch) The Trainer story with DDP through accelerate on CPU (gloo): the group
    launch made is the one accelerate uses. Every rank returns what it saw."""
    _rank_env(ctx)
    return {"rank": ctx.rank, **_hf_story(out)}


def _rank_env(ctx: Any) -> None:
    """The torchrun-style variables the libraries read to find their rank (the process group already exists)."""
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world_size), NODE_RANK="0", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))


def _hf_story(out: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from ckptaudit.integrations.transformers import AuditCallback

    RoundingTrainer = rounding_trainer()

    def model() -> Any:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))

    guard = AuditCallback(on_failure="stop")

    class SlowSteps(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            assert guard.guard.wait(120), "audit did not finish in 120 s"

    class Seen(TrainerCallback):  # type: ignore[misc]
        begin_step: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            Seen.begin_step = state.global_step

    def args(max_steps: int) -> Any:
        return TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, logging_strategy="no", dataloader_num_workers=0,
                                 disable_tqdm=True, seed=0, save_total_limit=3)

    trainer = RoundingTrainer(model=model(), args=args(20), train_dataset=_dataset(),
                              callbacks=[SlowSteps(), guard])
    raised = _raised(trainer.train)
    # Read now: the resumed run's own rotation (save_total_limit=3, no guard) deletes checkpoint-2, and the guard's
    # close then removes its report with it.
    verdicts = [_verdict(v) for v in guard.verdicts]
    stopped_at = trainer.state.global_step
    listing = sorted(os.listdir(out))
    files = {n: sorted(os.listdir(os.path.join(out, n))) for n in listing if os.path.isdir(os.path.join(out, n))}
    last = get_last_checkpoint(out)
    # The library's own resume path, in a new Trainer (no guard: what the user runs after the crash).
    resumed = Trainer(model=model(), args=args(stopped_at + 2), train_dataset=_dataset(), callbacks=[Seen()])
    resumed.train(resume_from_checkpoint=True)
    guard.guard.close(120)  # the worker process is reaped here, not left to the interpreter's exit
    return dict(stopped_at=stopped_at, listing=listing, files=files, get_last_checkpoint=os.path.basename(last or ""),
                raised=raised,
                resumed_from_step=Seen.begin_step, resumed_to_step=resumed.state.global_step, verdicts=verdicts)


def lightning(out: str) -> None:
    _result(out, **_lightning_story(out))


def lightning_ddp(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks, ckptaudit.launch) The Lightning story with ``strategy="ddp"`` on CPU (gloo): Lightning
    finds the ranks in the environment and the process group launch made. Every rank returns what it saw."""
    _rank_env(ctx)
    return {"rank": ctx.rank, **_lightning_story(out, ddp=True)}


def _lightning_story(out: str, ddp: bool = False) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptaudit.integrations.lightning import AuditCallback
    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPT, lm_loss

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=HIDDEN, n_layers=2))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            return lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            # The lossy exporter: the second save point (step 4) writes the weights rounded to bf16 values.
            if self.trainer.global_step == 4:
                checkpoint["state_dict"] = _bf16_values(checkpoint["state_dict"])

    guard = AuditCallback(on_failure="stop")

    class SlowSteps(L.Callback):
        def on_train_batch_end(self, *args: Any, **kw: Any) -> None:
            assert guard.guard.wait(120), "audit did not finish in 120 s"

    class Seen(L.Callback):
        start_step: int | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            Seen.start_step = trainer.global_step

    def loader() -> Any:
        tokens = torch.randint(0, VOCAB, (64, 17), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)

    def trainer(max_steps: int, *callbacks: Any) -> Any:
        ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=2, save_top_k=-1,
                               save_last=True)
        return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=2 if ddp else 1,
                         strategy="ddp" if ddp else "auto", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out, callbacks=[*callbacks, ckpt])

    torch.manual_seed(0)
    first = trainer(20, SlowSteps(), guard)
    raised = _raised(lambda: first.fit(LitGPT(), loader()))
    stopped_at = first.global_step
    listing = sorted(os.listdir(os.path.join(out, "ckpts")))
    passports = _passports_hold(os.path.join(out, "ckpts"), listing)  # before the resumed run rewrites last.ckpt
    last = os.path.join(out, "ckpts", "last.ckpt")
    last_state = torch.load(last, map_location="cpu", weights_only=True)
    second = trainer(stopped_at + 2, Seen())
    second.fit(LitGPT(), loader(), ckpt_path="last")
    guard.guard.close(120)
    return dict(stopped_at=stopped_at, listing=listing, passports=passports, last_is_link=os.path.islink(last),
                raised=raised,
                last_global_step=last_state["global_step"], resumed_from_step=Seen.start_step,
                resumed_to_step=second.global_step, verdicts=[_verdict(v) for v in guard.verdicts])


def store(ctx: Any, root: str) -> dict[str, Any] | None:
    """(2 ranks) The tiny FSDP2 recipe saved through ckptaudit.store with the guard: step 2 good; before step 4
    a bug rounds the live fp32 masters to bf16 values (in place), so step 4 is saved faithfully but holds
    rounded masters; keep_last=1. Then every rank resumes with load_checkpoint."""
    import torch

    from ckptaudit.integrations.guard import Guard
    from ckptaudit.integrations.store import save_checkpoint, stop_requested
    from ckptaudit.recipes.tinygpt import recipe
    from ckptaudit.store import load_checkpoint

    guard = Guard(on_failure="stop")
    job = recipe.setup(ctx)
    stopped_at = None
    pointers: list[tuple[str | None, str | None]] = []

    def pointer() -> str | None:
        path = os.path.join(root, "latest")
        return open(path).read().strip() if os.path.exists(path) else None
    for step in range(1, 9):
        recipe.step(job)
        if step == 4:
            with torch.no_grad():
                for p in job.model.parameters():
                    p.copy_(p.bfloat16().float())
        if step % 2 == 0:
            save_checkpoint(job, root, guard=guard, keep_last=1)
            if ctx.rank == 0:
                before = pointer()
                assert guard.wait(120)  # SlowSteps: a step longer than the audit
                pointers.append((before, pointer()))
        if stop_requested(guard):
            stopped_at = step
            break
    guard.close(120)
    fresh = recipe.setup(ctx)
    loaded = load_checkpoint(fresh, root)
    if ctx.rank != 0:
        return None
    return {"stopped_at": stopped_at, "pointer_before_and_after_each_audit": pointers, "listing": sorted(os.listdir(root)),
            "pointer": open(os.path.join(root, "latest")).read().strip(), "loaded_step": loaded.step,
            "verdicts": [_verdict(v) for v in guard.verdicts]}


def deepspeed(out: str) -> None:
    """DeepSpeed (ZeRO stage 0, fp32, CPU, gloo, one process): the exporter defect at the second save (step 4):
    the weights written are rounded to bf16 values (the live masters are put back right after)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed as ds
    import torch

    from ckptaudit.integrations.deepspeed import save_checkpoint
    from ckptaudit.integrations.guard import Guard, stop_requested

    ds.init_distributed(dist_backend="gloo")
    ckpts = os.path.join(out, "ckpts")

    def engine() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        return ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    guard = Guard(on_failure="stop")
    e = engine()
    stopped_at = None
    latest_after_each_audit = []
    for step in range(1, 21):
        e.backward(e(torch.randn(4, 32)).square().mean())
        e.step()
        if step % 2 == 0:
            exact = [p.detach().clone() for p in e.module.parameters()]
            if step == 4:
                with torch.no_grad():
                    for p in e.module.parameters():
                        p.copy_(p.bfloat16().float())
            save_checkpoint(e, ckpts, guard=guard)
            with torch.no_grad():
                for p, x in zip(e.module.parameters(), exact, strict=True):
                    p.copy_(x)
            assert guard.wait(120)  # SlowSteps: a step longer than the audit
            latest = os.path.join(ckpts, "latest")
            latest_after_each_audit.append(open(latest).read() if os.path.exists(latest) else None)
        if stop_requested(guard):
            stopped_at = step
            break
    guard.close(120)
    listing = sorted(os.listdir(ckpts))
    resumed = engine()
    path, _ = resumed.load_checkpoint(ckpts)
    _result(out, stopped_at=stopped_at, listing=listing, latest_after_each_audit=latest_after_each_audit,
            loaded=os.path.basename(os.path.dirname(path)) if path else None, resumed_step=resumed.global_steps,
            verdicts=[_verdict(v) for v in guard.verdicts])


def deepspeed_zero(ctx: Any, out: str) -> dict[int, dict[str, Any]]:
    """(2 ranks, ckptaudit.launch) DeepSpeed ZeRO-2 then ZeRO-3, bf16 engine, CPU, gloo: the masters are
    rounded to bf16 values in the optimizer's own fp32 partitions (ZeRO-1/2 ``single_partition_of_fp32_groups``,
    ZeRO-3 ``fp32_partitioned_groups_flat``) just before the second save (step 4), and put back right after it:
    the checkpoint holds masters the run never had. Every rank returns, per stage, what it saw."""
    _rank_env(ctx)
    import gc

    import deepspeed as ds
    import torch

    from ckptaudit.integrations.deepspeed import save_checkpoint
    from ckptaudit.integrations.guard import Guard, stop_requested

    ds.init_distributed(dist_backend="gloo")  # joins the group ckptaudit.launch made

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # Odd sizes: ZeRO pads the flat partitions, so a reader that ignores padding misplaces parameters.
            self.body = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 4))

        def forward(self, x: Any) -> Any:
            return self.body(x)

    def engine(stage: int) -> Any:
        torch.manual_seed(0)
        model = Tiny()
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
               "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                            "warmup_num_steps": 10}}}
        return ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def masters(e: Any) -> list[Any]:
        opt = e.optimizer
        return list(opt.fp32_partitioned_groups_flat if e.zero_optimization_stage() == 3
                    else opt.single_partition_of_fp32_groups)

    def real(e: Any) -> list[Any]:
        """This rank's master elements without the padding (left uninitialized: NaN or anything)."""
        opt, out = e.optimizer, []
        if e.zero_optimization_stage() < 3:  # one flat partition per group; the padding at its end
            return [flat[:flat.numel() - pad] for flat, pad in zip(masters(e), opt.groups_padding, strict=True)]
        for flat, params in zip(masters(e), opt.fp16_groups, strict=True):  # each parameter's padded partition
            offset = 0
            for p in params:
                part = p.partition_numel()
                out.append(flat[offset:offset + max(0, min(p.ds_numel - ctx.rank * part, part))])
                offset += part
        return out

    results: dict[int, dict[str, Any]] = {}
    for stage in (2, 3):
        ckpts = os.path.join(out, f"zero{stage}")
        guard = Guard(on_failure="stop")
        e = engine(stage)
        gen = torch.Generator().manual_seed(ctx.rank)
        stopped_at, at_step_2 = None, None
        latest_after_each_audit = []
        for step in range(1, 21):
            e.backward(e(torch.randn(2, 7, generator=gen).bfloat16()).float().pow(2).mean())
            e.step()
            if step % 2 == 0:
                exact = [m.detach().clone() for m in masters(e)]
                if step == 2:
                    at_step_2 = [m.detach().clone() for m in real(e)]
                if step == 4:
                    with torch.no_grad():
                        for m in masters(e):
                            m.copy_(m.bfloat16().float())
                save_checkpoint(e, ckpts, guard=guard)
                with torch.no_grad():
                    for m, x in zip(masters(e), exact, strict=True):
                        m.copy_(x)
                if ctx.rank == 0:
                    assert guard.wait(120)  # SlowSteps: a step longer than the audit
                    latest = os.path.join(ckpts, "latest")
                    latest_after_each_audit.append(open(latest).read() if os.path.exists(latest) else None)
            if stop_requested(guard):  # all ranks, the same answer
                stopped_at = step
                break
        guard.close(120)
        listing = sorted(os.listdir(ckpts))
        optimizer = type(e.optimizer).__name__
        del e  # one engine at a time: ZeRO-3 keeps process-wide state about the parameters it partitions
        gc.collect()
        resumed = engine(stage)
        path, _ = resumed.load_checkpoint(ckpts)  # DeepSpeed's own resume path: reads `latest`
        assert at_step_2 is not None
        same = all(torch.equal(m, x) for m, x in zip(real(resumed), at_step_2, strict=True))
        diff = max(float((m.float() - x.float()).abs().max()) if m.numel() else 0.0
                   for m, x in zip(real(resumed), at_step_2, strict=True))
        results[stage] = {
            "rank": ctx.rank, "optimizer": optimizer, "masters_max_diff": diff, "stopped_at": stopped_at, "listing": listing,
            "latest_after_each_audit": latest_after_each_audit,
            "loaded": os.path.basename(os.path.dirname(path)) if path else None,
            "resumed_step": resumed.global_steps, "loaded_step_2_masters": same,
            "verdicts": [_verdict(v) for v in guard.verdicts]}
        torch.distributed.barrier()
    return results


def torchtitan(out: str) -> None:
    """torchtitan's real CheckpointManager (DCP, synchronous) on one gloo rank: the second save (step 4) writes
    the weights rounded to bf16 values (the live masters are put back right after)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo")
    facts = _torchtitan_story(out, "disabled")
    dist.destroy_process_group()
    _result(out, **facts)


def torchtitan_async(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks, ckptaudit.launch) The torchtitan story with ``async_mode="async"``: ``save`` returns while
    DCP still writes; the guard audits when the save's future completes. Every rank returns what it saw."""
    _rank_env(ctx)
    return {"rank": ctx.rank, **_torchtitan_story(out, "async")}


def _torchtitan_story(out: str, async_mode: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from ckptaudit.integrations.guard import Guard, stop_requested
    from ckptaudit.integrations.torchtitan import guard_checkpoint_manager

    def build() -> tuple[Any, Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = OptimizersContainer(OptimizersContainer.Config(implementation="for-loop", param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]),
            model_parts=[model])
        sched = LRSchedulersContainer.Config().build(optimizers=opt, training_steps=20)
        mgr = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=0,
                                                         last_save_model_only=False, async_mode=async_mode),
                                dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                                states={}, sd_adapter=None, base_folder=out)
        return model, opt, sched, mgr

    rank = dist.get_rank()
    guard = Guard(on_failure="stop")
    model, opt, sched, mgr = build()
    mgr = guard_checkpoint_manager(mgr, guard)
    stopped_at, at_step_2, pending_saves = None, None, 0
    for step in range(1, 21):
        # The same data on every rank: the replicas stay equal without DDP.
        model(torch.randn(4, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        exact = [p.detach().clone() for p in model.parameters()]
        if step == 2:
            at_step_2 = exact
        if step == 4:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.bfloat16().float())
        written = mgr.save(step, last_step=step == 20)  # async: returns once the state is staged, DCP writing
        pending_saves += bool(written) and mgr.save_future is not None
        with torch.no_grad():
            for p, x in zip(model.parameters(), exact, strict=True):
                p.copy_(x)
        if rank == 0:
            assert guard.wait(120)  # SlowSteps: a step longer than the save and its audit
        if stop_requested(guard):
            stopped_at = step
            break
    guard.close(120)
    mgr.close()
    listing = sorted(os.listdir(os.path.join(out, "ckpt")))
    fresh, _, _, mgr2 = build()
    loaded = mgr2.load()  # torchtitan's own resume path: the newest valid step-N
    assert at_step_2 is not None
    same = all(torch.equal(p, x) for p, x in zip(fresh.parameters(), at_step_2, strict=True))
    mgr2.close()
    return dict(stopped_at=stopped_at, listing=listing, loaded=loaded, loaded_step_2_weights=same,
                saves_still_writing_when_save_returned=pending_saves, verdicts=[_verdict(v) for v in guard.verdicts])


def _passports_hold(folder: str, listing: list[str]) -> dict[str, bool]:
    """Each passport the guard left beside a checkpoint file -> whether it attests that file's bytes now, with a
    passing verdict (``ckptaudit.passport.verify``)."""
    from ckptaudit.passport import verify

    return {n: verify(os.path.join(folder, n.removesuffix(".passport.json"))).ok
            for n in listing if n.endswith(".passport.json")}


def _raised(train: Any) -> dict[str, Any] | None:
    """Run ``train()``; what :class:`CheckpointAuditFailed` it raised at the end (``None`` if it returned)."""
    from ckptaudit.integrations.guard import CheckpointAuditFailed

    try:
        train()
    except CheckpointAuditFailed as exc:
        return {"message": str(exc), "failed": [os.path.basename(v.checkpoint) for v in exc.failed]}
    return None


def _verdict(v: Any) -> dict[str, Any]:
    contract = None
    if v.report and os.path.exists(v.report):
        with open(v.report) as fh:
            contract = json.load(fh).get("contract")
    return {"checkpoint": os.path.basename(v.checkpoint), "step": v.step, "ok": v.ok, "codes": list(v.codes),
            "report": os.path.basename(v.report) if v.report else None,
            "quarantined_to": os.path.basename(v.quarantined_to) if v.quarantined_to else None,
            "summary": v.summary, "error": v.error, "contract": contract, "damage": v.damage,
            "damaged_ancestor": v.damaged_ancestor}


def _result(out: str, **facts: Any) -> None:
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump(facts, fh, indent=1)


JOB_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "DS_ACCELERATOR": "cpu"}
"""The environment of every job: offline, one thread per process, DeepSpeed on the CPU."""


def launch_job(fn: Any, out: str, *args: Any, timeout_s: float = 600) -> list[dict[str, Any]]:
    """(test process) Run ``fn(ctx, out, *args)`` on 2 real gloo ranks (ckptaudit.launch: a timeout on
    the group and on every child, every child reaped); what each rank returned, in rank order."""
    from ckptaudit.launch import launch

    os.makedirs(out, exist_ok=True)
    results: list[dict[str, Any]] = launch(fn, 2, (out, *args), timeout_s=timeout_s, pg_timeout_s=240,
                                           backend="gloo", env=dict(JOB_ENV))
    return results


def live(verdict: dict[str, Any], run: str) -> None:
    """(test process) The guarded audit held the checkpoint to the running job's contract (the dtype of what its optimizer
    steps), not to one inferred from the file."""
    contract = verdict["contract"]
    assert (contract["source"], contract["master_dtype"]) == ("live", "float32"), contract
    assert contract["detail"].startswith("the live run: ") and run in contract["detail"], contract


def run_job(what: str, out: str, timeout_s: float = 600) -> dict[str, Any]:
    """(test process) Run job ``what`` in a fresh interpreter, offline (``runs.run_job``)."""
    from runs import run_job as run_script_job

    return run_script_job(__file__, what, out, env=JOB_ENV, timeout_s=timeout_s)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    what, where = sys.argv[1], sys.argv[2]
    {"hf": hf, "lightning": lightning, "deepspeed": deepspeed, "torchtitan": torchtitan}[what](where)
