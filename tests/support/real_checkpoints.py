"""Small real checkpoints, written by the real libraries, for the security and fuzz tests (single process)."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any


def trained(path: Path, *, rounded: bool = False, width: int = 16) -> Path:
    """A real tiny model trained 2 AdamW steps, saved with torch.save as most training scripts do."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if rounded:
        state = {k: v.bfloat16().float() for k, v in state.items()}
    torch.save({"model": state, "optimizer": opt.state_dict(), "step": 2}, path)
    return path


def _model_and_optimizer() -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def torch_save_checkpoint(path: Path) -> Path:
    """A plain-dict ``torch.save`` training checkpoint: model, optimizer, scheduler, RNG states, step."""
    import numpy as np
    import torch

    model, opt, sched = _model_and_optimizer()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "step": 2,
        },
        path,
    )
    return path


def safetensors_file(path: Path) -> Path:
    from safetensors.torch import save_file

    model, _, _ = _model_and_optimizer()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata={"format": "pt"})
    return path


def read_dcp_metadata(ckpt: Path) -> Any:
    """torch's own ``Metadata`` of a DCP directory these tests wrote (trusted bytes), to edit and pickle back."""
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(ckpt)).read_metadata()


def dcp_checkpoint(path: Path, extra: dict[str, Any] | None = None) -> Path:
    """``torch.distributed.checkpoint.save`` of model + FQN-keyed optimizer state, in one process."""
    import torch
    import torch.distributed.checkpoint as dcp

    model, opt, _ = _model_and_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    osd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {names[id(params[i])]: s for i, s in osd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]}
              for g in osd["param_groups"]]
    sd: dict[str, Any] = {"model": model.state_dict(), "optim": {"state": state, "param_groups": groups},
                          "step": torch.tensor(2)}
    sd.update(extra or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": single-process save is what we want
        dcp.save(sd, checkpoint_id=str(path))
    return path


def hf_sharded_directory(path: Path) -> Path:
    """A Hugging Face model directory from ``save_pretrained``: sharded safetensors + index json + config."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(str(path), max_shard_size="20KB")
    assert any(n.endswith(".index.json") for n in os.listdir(path)), os.listdir(path)
    return path


def accelerate_directory(path: Path, random_states_extra: dict[str, Any] | None = None) -> Path:
    """A directory laid out as Accelerate's ``save_state`` writes it: ``model.safetensors``, ``optimizer.bin``,
    ``scheduler.bin`` and ``random_states_0.pkl`` (a ``torch.save`` file despite its name)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model, opt, sched = _model_and_optimizer()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    torch.save(opt.state_dict(), path / "optimizer.bin")
    torch.save(sched.state_dict(), path / "scheduler.bin")
    states = {"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    states.update(random_states_extra or {})
    torch.save(states, path / "random_states_0.pkl")
    return path


def chunked_training_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """A small model whose embedding spans several 1 MiB chunks, after two real AdamW steps; one layer's
    weights rounded to bf16 and another's bias to fp16, as compute-copy exporters leave them (so every precision
    path runs, and the precision evidence differs between the two 16-bit formats)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1024, 640), torch.nn.Linear(640, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 640))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randint(0, 1024, (4, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    sd["1.weight"] = sd["1.weight"].bfloat16().float()
    sd["3.bias"] = sd["3.bias"].half().float()
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = opt.state_dict()
    state = {names[id(params[i])]: s for i, s in osd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]}
              for g in osd["param_groups"]]
    return sd, {"state": state, "param_groups": groups}


def chunked_checkpoints(out: Path) -> dict[str, Path]:
    """The same training state as torch.save, single-process DCP and safetensors (model), written once."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    sd, osd = chunked_training_state()
    torch.save({"model": sd, "optimizer": osd, "step": 2}, out / "ckpt.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": sd, "optim": osd, "step": torch.tensor(2)}, checkpoint_id=str(out / "dcp"))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return {"torch.save": out / "ckpt.pt", "dcp": out / "dcp", "safetensors": out / "model.safetensors"}
