"""Training runs with the guard in fast loops (steps of milliseconds, no wait for the audit), for
``test_guard_fast.py``: the real Trainer, Lightning and Accelerate on CPU, tiny models.

Run as a script in a fresh interpreter (``python guard_fast_jobs.py WHAT OUT``, see :func:`run`) or on 2 real gloo
ranks (``guard_jobs.launch_job``). Each job returns what the guard decided, what was on disk at each save and
what the library's own resume path then did. The defect is the exporter's of ``guard_jobs``: weights rounded to
bf16 values in what a save writes (the live model keeps its fp32 masters).

Two ways to know what happened "before the verdict" without timing: the bound's own promise is observed at the
moment each save writes (inside the library's save, after the guard's wait); and where a test needs audits
pending on purpose, the job stops the guard's real worker process (``SIGSTOP``) once the first verdict is in,
and lets it go (``SIGCONT``) at the end of training, before the guard waits for its audits.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from guard_jobs import JOB_ENV, VOCAB, _bf16_values, _dataset, _raised, _rank_env, _result, _verdict, rounding_trainer


def _unverified(saves: list[int], verdicts: Any, step: int) -> list[int]:
    """The save points before ``step`` that still wait for a verdict: a step is verified once every file
    saved at it has one (Lightning saves two per step)."""
    judged: dict[int, int] = {}
    for v in verdicts:
        judged[v.step] = judged.get(v.step, 0) + 1
    return sorted({s for s in saves if s != step and judged.get(s, 0) < saves.count(s)})


class _Held:
    """The guard's worker process, stopped while audits pile up, always let go."""

    def __init__(self) -> None:
        self.pid: int | None = None

    def stop(self, guard: Any) -> None:
        assert guard.wait(120), "the first audit did not finish in 120 s"
        child = guard._child
        assert child is not None and child.poll() is None
        self.pid = child.pid
        os.kill(child.pid, signal.SIGSTOP)

    def go(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)
            self.pid = None


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face Trainer


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))


def _hf_args(out: str, max_steps: int, limit: int | None = None) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, logging_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True, seed=0, save_total_limit=limit)


def hf_fast(out: str) -> None:
    _result(out, **_hf_fast(out))


def hf_fast_last(out: str) -> None:
    """:func:`hf_fast` whose last save (step 12, the end of training) is the lossy one: its verdict can only come
    after the last step."""
    _result(out, **_hf_fast(out, lossy=6))


def hf_fast_ddp(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks) :func:`hf_fast` with DDP through accelerate on CPU (gloo)."""
    _rank_env(ctx)
    return {"rank": ctx.rank, **_hf_fast(out)}


def _hf_fast(out: str, lossy: int = 2) -> dict[str, Any]:
    """Stop mode, a save every 2 steps to step 12; save number ``lossy`` (the second: step 4) is lossy; nothing
    waits for the audit."""
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint

    from ckptaudit.integrations.transformers import AuditCallback

    audit = AuditCallback(on_failure="stop")
    saves: list[int] = []
    seen: list[list[int]] = []

    class RoundingTrainer(Trainer):
        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            # Inside the library's write of checkpoint-N (main process), after the guard's wait at the step end.
            step = self.state.global_step
            seen.append(_unverified(saves, audit.verdicts, step))
            saves.append(step)
            if len(saves) == lossy:
                state_dict = _bf16_values(self.model.state_dict())
            super()._save(output_dir, state_dict)

    class Seen(TrainerCallback):  # type: ignore[misc]
        begin_step: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            Seen.begin_step = state.global_step

    trainer = RoundingTrainer(model=_llama(), args=_hf_args(out, 12), train_dataset=_dataset(), callbacks=[audit])
    raised = _raised(trainer.train)
    stopped_at = trainer.state.global_step
    listing = sorted(os.listdir(out))
    last = get_last_checkpoint(out)
    resumed = Trainer(model=_llama(), args=_hf_args(out, stopped_at + 2), train_dataset=_dataset(),
                      callbacks=[Seen()])
    resumed.train(resume_from_checkpoint=True)
    audit.guard.close(120)
    return dict(stopped_at=stopped_at, listing=listing, raised=raised, saves=saves,
                unverified_at_each_write=seen, waits=[(w.step, w.unverified) for w in audit.guard.waits],
                get_last_checkpoint=os.path.basename(last or ""), resumed_from_step=Seen.begin_step,
                verdicts=[_verdict(v) for v in audit.verdicts])


def hf_retention(out: str) -> None:
    """Warn mode, ``save_total_limit=2``, a save every 2 steps to step 10, the second save (step 4) lossy; the
    audits after the first are held until the end of training, so every save comes while older ones wait."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint

    from ckptaudit.integrations.transformers import AuditCallback

    audit = AuditCallback(on_failure="warn")
    held = _Held()
    on_disk: list[list[str]] = []

    RoundingTrainer = rounding_trainer()

    class Hold(TrainerCallback):  # type: ignore[misc]  # before the guard's callback
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                held.stop(audit.guard)  # checkpoint-2 has passed; every later save waits for its audit

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            held.go()

    class Watch(TrainerCallback):  # type: ignore[misc]  # after the guard's callback (its rotation)
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            on_disk.append(sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")))

    args = _hf_args(out, 10, limit=2)
    trainer = RoundingTrainer(model=_llama(), args=args, train_dataset=_dataset(), callbacks=[Hold(), audit, Watch()])
    try:
        trainer.train()
    finally:
        held.go()
    audit.guard.close(120)
    _result(out, listing=sorted(os.listdir(out)), on_disk_at_each_save=on_disk, limit_after=args.save_total_limit,
            get_last_checkpoint=os.path.basename(get_last_checkpoint(out) or ""),
            verdicts=[_verdict(v) for v in audit.verdicts])


# ---------------------------------------------------------------------------------------------------------------
# Lightning


def _lightning(out: str, *, guard: Any = None, lossy_from: int = 4, lossy_to: int = 10**9, saves: Any = None,
               seen: Any = None, top_k: int = -1, max_steps: int = 12, ddp: bool = False,
               callbacks: tuple[Any, ...] = ()) -> Any:
    """(trainer, module, loader): ModelCheckpoint every 2 steps with ``save_last=True``; the saves at steps
    ``lossy_from``..``lossy_to`` write bf16-rounded weights."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPT, lm_loss

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=32, n_layers=2))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            return lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            # Inside the library's save (after the guard's wait), before the file is written.
            step = self.trainer.global_step
            if guard is not None and self.trainer.is_global_zero:
                seen.append(_unverified(saves, guard.verdicts, step))
                saves.append(step)
            if lossy_from <= step <= lossy_to:
                checkpoint["state_dict"] = _bf16_values(checkpoint["state_dict"])

    tokens = torch.randint(0, VOCAB, (64, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=2, save_top_k=top_k,
                           save_last=True)
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=2 if ddp else 1,
                        strategy="ddp" if ddp else "auto", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, callbacks=[*callbacks, ckpt])
    return trainer, LitGPT(), loader


def lightning_fast(out: str) -> None:
    _result(out, **_lightning_fast(out))


def lightning_fast_last(out: str) -> None:
    """:func:`lightning_fast` whose only lossy save is the last one (step 12, the end of fitting)."""
    _result(out, **_lightning_fast(out, lossy_from=12))


def lightning_fast_ddp(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks) :func:`lightning_fast` with ``strategy="ddp"`` on CPU (gloo)."""
    _rank_env(ctx)
    return {"rank": ctx.rank, **_lightning_fast(out, ddp=True)}


def _lightning_fast(out: str, ddp: bool = False, lossy_from: int = 4) -> dict[str, Any]:
    """Stop mode, nothing waits for the audit; every save from step ``lossy_from`` on is lossy. Then ``fit(ckpt_path="last")``
    in a new Trainer, which saves twice more into the same folder."""
    import lightning as L
    import torch

    from ckptaudit.integrations.lightning import AuditCallback

    audit = AuditCallback(on_failure="stop")
    saves: list[int] = []
    seen: list[list[int]] = []

    class Seen(L.Callback):
        start_step: int | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            Seen.start_step = trainer.global_step

    trainer, module, loader = _lightning(out, guard=audit.guard, lossy_from=lossy_from, saves=saves, seen=seen,
                                         ddp=ddp, callbacks=(audit,))
    raised = _raised(lambda: trainer.fit(module, loader))
    stopped_at = trainer.global_step
    ckpts = os.path.join(out, "ckpts")
    listing = sorted(os.listdir(ckpts))
    last = torch.load(os.path.join(ckpts, "last.ckpt"), map_location="cpu", weights_only=True)
    audit.guard.close(120)
    resumed, module2, loader2 = _lightning(out, lossy_from=10**9, max_steps=stopped_at + 4, ddp=ddp,
                                           callbacks=(Seen(),))
    resumed.fit(module2, loader2, ckpt_path="last")
    return dict(stopped_at=stopped_at, listing=listing, raised=raised, saves=saves, unverified_at_each_write=seen,
                last_global_step=last["global_step"], resumed_from_step=Seen.start_step,
                resumed_to_step=resumed.global_step, listing_after_resume=sorted(os.listdir(ckpts)),
                verdicts=[_verdict(v) for v in audit.verdicts])


def lightning_rewrite(out: str) -> None:
    """Warn mode, ``save_top_k=1``, ``save_last=True``, a save every 2 steps to step 8, the save at step 4 lossy;
    the audits after the first step's are held until the end of training, so ``last.ckpt`` is rewritten three
    times while its earlier contents wait for their verdicts (and ModelCheckpoint asks to remove files whose
    audit is pending). ``TMPDIR`` decides how Lightning rewrites it: renamed over (same filesystem) or copied
    into the same inode (another filesystem)."""
    import lightning as L
    import torch

    from ckptaudit.integrations.lightning import AuditCallback

    audit = AuditCallback(on_failure="warn")
    held = _Held()

    on_disk: list[list[str]] = []

    class Hold(L.Callback):  # before the guard's callback
        def on_train_batch_start(self, trainer: Any, *args: Any, **kw: Any) -> None:
            ckpts = os.path.join(out, "ckpts")  # after the previous batch end's saves and removals
            if os.path.isdir(ckpts):
                on_disk.append(sorted(n for n in os.listdir(ckpts) if n.startswith("epoch=")))

        def on_train_batch_end(self, trainer: Any, *args: Any, **kw: Any) -> None:
            if trainer.global_step == 3:
                held.stop(audit.guard)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            held.go()

    trainer, module, loader = _lightning(out, lossy_from=4, lossy_to=4, top_k=1, max_steps=8,
                                         callbacks=(Hold(), audit))
    try:
        trainer.fit(module, loader)
    finally:
        held.go()
    audit.guard.close(120)
    ckpts = os.path.join(out, "ckpts")

    def step_of(name: str) -> int:
        return int(torch.load(os.path.join(ckpts, name), map_location="cpu", weights_only=True)["global_step"])

    _result(out, listing=sorted(os.listdir(ckpts)), last_step=step_of("last.ckpt"), on_disk_at_each_step=on_disk,
            quarantined_last_step=step_of("last.ckpt.quarantined"), tmpdir_device=os.stat(os.environ["TMPDIR"]).st_dev,
            ckpts_device=os.stat(ckpts).st_dev, verdicts=[{**_verdict(v), "note": v.note} for v in audit.verdicts])


# ---------------------------------------------------------------------------------------------------------------
# Accelerate


def accelerate_ddp(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks) DDP through Accelerate on CPU (gloo), ``automatic_checkpoint_naming`` with ``total_limit=1``,
    ``save_state`` every 2 steps in a fast loop, stop mode; the user's save hook rounds the weights of the second
    save (``checkpoint_1``, step 4). Then a new Accelerator resumes with ``load_state()``."""
    return _accelerate_story(ctx, out, fsdp=False)


def accelerate_fsdp(ctx: Any, out: str) -> dict[str, Any]:
    """(2 ranks) :func:`accelerate_ddp` with FSDP2 through Accelerate (``FullyShardedDataParallelPlugin
    (fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")``): Accelerate's own ``prepare`` (``fully_shard``),
    ``save_state`` (``save_fsdp_model`` / ``save_fsdp_optimizer``: the DCP folders ``pytorch_model_fsdp_0/`` and
    ``optimizer_0/``) and ``load_state``. Accelerate selects FSDP only on multi-GPU kinds of devices, so the job
    sets its state's ``distributed_type`` to FSDP after the Accelerator is built, as its own selection does on GPUs;
    the process group is gloo on CPU. The second save's masters are the bf16 values (the sharded parameters
    rounded in place before ``save_state``: the headline defect, the compute copies saved as the masters)."""
    return _accelerate_story(ctx, out, fsdp=True)


def _accelerate_story(ctx: Any, out: str, fsdp: bool) -> dict[str, Any]:
    _rank_env(ctx)
    import torch
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ProjectConfiguration

    from ckptaudit.integrations.accelerate import guard_accelerator
    from ckptaudit.integrations.guard import CheckpointAuditFailed, Guard, stop_requested

    def build() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=out, automatic_checkpoint_naming=True, total_limit=1))
        if fsdp:
            acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                   state_dict_type="SHARDED_STATE_DICT")
            acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    def local(model: Any) -> dict[str, Any]:
        """This rank's view of the weights: its shards under FSDP, the whole state under DDP."""
        return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                for k, v in acc.unwrap_model(model).state_dict().items()}

    acc, model, opt = build()
    sharded = type(next(model.parameters())).__name__ == "DTensor"
    saves = [0]

    def rounding(models: Any, weights: list[dict[str, Any]], output_dir: str) -> None:
        if saves[0] == 2 and not fsdp:  # the exporter bug, in the user's own save hook
            weights[:] = [_bf16_values(w) for w in weights]

    acc.register_save_state_pre_hook(rounding)
    guard = guard_accelerator(acc, Guard(on_failure="stop"))
    saved: dict[int, dict[str, Any]] = {}
    on_disk: list[list[str]] = []
    stopped_at = None
    for step in range(1, 13):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + ctx.rank))
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            saves[0] += 1
            if saves[0] == 2 and fsdp:  # the masters replaced by their bf16 values (FSDP's save hook sees none)
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(p.to(torch.bfloat16).float())
            saved[acc.save_iteration] = local(model)
            acc.save_state()
            if ctx.rank == 0:
                on_disk.append(sorted(os.listdir(os.path.join(out, "checkpoints"))))
        if stop_requested(guard):
            stopped_at = step
            break
    raised = None
    try:
        guard.finish(120)
    except CheckpointAuditFailed as exc:
        raised = {"message": str(exc), "failed": [os.path.basename(v.checkpoint) for v in exc.failed]}
    acc.wait_for_everyone()
    checkpoints = sorted(os.listdir(os.path.join(out, "checkpoints")))
    home = sorted(os.listdir(os.path.join(out, "ckptaudit")))
    layout = sorted(os.listdir(os.path.join(out, "checkpoints", checkpoints[-1]))) if checkpoints else []
    acc2, model2, _ = build()
    acc2.load_state()  # automatic_checkpoint_naming: the newest checkpoint_N
    loaded = local(model2)
    same = [i for i, w in sorted(saved.items()) if all(torch.equal(loaded[k], w[k]) for k in w)]
    return {"rank": ctx.rank, "stopped_at": stopped_at, "raised": raised, "checkpoints": checkpoints, "home": home,
            "on_disk_at_each_save": on_disk, "loaded_iteration": same, "sharded": sharded, "layout": layout,
            "verdicts": [_verdict(v) for v in guard.verdicts]}


# ---------------------------------------------------------------------------------------------------------------
# torchtitan


def torchtitan_retention(out: str) -> None:
    """torchtitan's real CheckpointManager (DCP, one gloo rank), warn mode, ``keep_latest_k=2``, a save every 2
    steps to step 10, the save at step 4 lossy; the audits after the first are held until the end."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from ckptaudit.integrations.guard import Guard
    from ckptaudit.integrations.torchtitan import guard_checkpoint_manager

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = OptimizersContainer(OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]), model_parts=[model])
    sched = LRSchedulersContainer.Config().build(optimizers=opt, training_steps=10)
    guard = Guard(on_failure="warn")
    mgr = guard_checkpoint_manager(CheckpointManager(
        CheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=2, last_save_model_only=False),
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={}, sd_adapter=None,
        base_folder=out), guard)
    folder = os.path.join(out, "ckpt")
    held = _Held()
    on_disk: list[list[str]] = []
    try:
        for step in range(1, 11):
            model(torch.randn(4, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            exact = [p.detach().clone() for p in model.parameters()]
            if step == 4:
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(p.bfloat16().float())
            if mgr.save(step, last_step=step == 10):
                on_disk.append(sorted(n for n in os.listdir(folder) if n.startswith("step-")))
            with torch.no_grad():
                for p, x in zip(model.parameters(), exact, strict=True):
                    p.copy_(x)
            if step == 3:
                held.stop(guard)
    finally:
        held.go()
    guard.close(120)
    mgr.close()
    dist.destroy_process_group()
    _result(out, listing=sorted(os.listdir(folder)), on_disk_at_each_save=on_disk,
            keep_latest_k=mgr.keep_latest_k, verdicts=[_verdict(v) for v in guard.verdicts])


# ---------------------------------------------------------------------------------------------------------------
# The waits of several ranks


def held_audit(ctx: Any, out: str, hold_s: float) -> dict[str, Any]:
    """(2 ranks, a process-group timeout shorter than ``hold_s``) Stop mode: rank 0's audit of step 2 is held for
    ``hold_s`` seconds (its save's future is done then), and both ranks come to the save of step 4 and then to the
    end of training: the bound's wait and the end's wait must not keep rank 1 inside one collective that long.
    ``out`` holds ``step=2.pt`` and ``step=4.pt`` (written by the test process). Rank 1 enters the first collective
    only once rank 0's worker is up (a file says so): on a loaded machine the worker's start-up alone could
    outlast the short timeout, and that is not what is tested."""
    import threading
    import time
    from concurrent.futures import Future

    from ckptaudit.integrations.guard import Guard, before_save_everywhere, wait_everywhere

    guard = Guard(on_failure="stop", background="thread")
    ready = os.path.join(out, "rank0-ready")
    if ctx.rank == 0:
        assert guard.started(120), "the guard's worker did not start in 120 s"
        held: Future[None] = Future()
        guard.submit(os.path.join(out, "step=2.pt"), step=2, ready=held)
        threading.Timer(hold_s, held.set_result, args=(None,)).start()
        with open(ready, "w"):
            pass
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            assert time.monotonic() < deadline, "rank 0 did not get ready in 120 s"
            time.sleep(0.05)
    before_save_everywhere(guard, 4)  # rank 0 waits for step 2's verdict; rank 1 beside it
    judged_before_the_save = len(guard.verdicts)
    if ctx.rank == 0:
        guard.submit(os.path.join(out, "step=4.pt"), step=4, ready=(late := Future()))
        threading.Timer(hold_s, late.set_result, args=(None,)).start()
    done = wait_everywhere(guard)
    return {"rank": ctx.rank, "judged_before_the_save": judged_before_the_save, "done": done,
            "waits": [(w.step, w.unverified) for w in guard.waits], "verdicts": [v.ok for v in guard.verdicts]}


# ---------------------------------------------------------------------------------------------------------------


def run(what: str, out: str, env: dict[str, str] | None = None, timeout_s: float = 900) -> dict[str, Any]:
    """(test process) Run job ``what`` in a fresh interpreter, offline (``runs.run_job``)."""
    from runs import run_job

    return run_job(__file__, what, out, env={**JOB_ENV, **(env or {})}, timeout_s=timeout_s)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    {"hf_fast": hf_fast, "hf_fast_last": hf_fast_last, "hf_retention": hf_retention, "lightning_fast": lightning_fast,
     "lightning_fast_last": lightning_fast_last,
     "lightning_rewrite": lightning_rewrite, "torchtitan_retention": torchtitan_retention}[sys.argv[1]](sys.argv[2])
