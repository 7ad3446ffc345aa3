"""Interpret a checkpoint's parts: which tensors are the model, which the optimizer, where the rest lives.

Readers say *what is in the files*; this module says *what it means*, for the layouts real tools write:

- ``torch.distributed.checkpoint`` with ``get_state_dict`` (``model``, ``optim``/``optimizer`` FQN-keyed),
  and ckptaudit's own writer;
- torchtitan (model FQNs at the top level, ``optimizer`` flattened to ``state.<fqn>.<name>`` and
  ``param_groups.<fqn>.<key>``, ``lr_scheduler``, ``dataloader``, ``train_state``);
- Hugging Face Trainer ``checkpoint-N/`` (``model.safetensors`` or ``pytorch_model.bin``, sharded with an
  index or not; ``optimizer.pt``; ``scheduler.pt``; ``rng_state*.pth``; ``trainer_state.json``);
- Accelerate ``save_state`` (``model*.safetensors``/``pytorch_model*.bin``, ``optimizer*.bin``,
  ``scheduler*.bin``, ``random_states_*.pkl``, ``sampler*.bin``/``dl_state_dict*.bin``);
- Lightning ``.ckpt`` (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``global_step``);
- Megatron-Core ``torch_dist`` (``metadata.json``, ``common.pt``, DCP keyed by each ShardedTensor's flat key;
  optimizer state under ``optimizer.state.<name>.<key>``, the distributed optimizer's under
  ``optimizer.distributed.dp_group_idx_<g>.*``; see :func:`~ckptaudit.layouts.megatron.layout.megatron_view`);
- DeepSpeed ``global_stepN/`` and its root (read by :mod:`ckptaudit.formats.deepspeed.reader`): the fp32 masters
  rebuilt from the ZeRO partitions are the model's parameters, the bf16/fp16 ``module`` weights their compute
  copies, the moments keyed by parameter name, ``lr_scheduler``, ``client_state`` and ``global_steps``;
- plain dicts (``model``/``state_dict``/``module``, ``optimizer``/``optim``, ``scheduler``/``lr_scheduler``,
  ``rng``/``rng_state``, ``step``/``train_state``/``data``/``dataloader``) and bare state dicts.


The package is cut by library rule behind one contract, :mod:`~ckptaudit.layouts.rules` (a rule for a whole
checkpoint, or for one part, each registering itself with its place in the order): :mod:`~ckptaudit.layouts.view`
(the data and the shared helpers), :mod:`~ckptaudit.layouts.core` (:func:`interpret`, the driver that asks the rules
in order), :mod:`~ckptaudit.layouts.huggingface` (files by their names), :mod:`~ckptaudit.layouts.keyed` (plain
dicts, DCP/``get_state_dict``, torchtitan, Lightning), :mod:`~ckptaudit.layouts.deepspeed` and
:mod:`~ckptaudit.layouts.megatron` (sub-packages, so that their code loads only for a checkpoint of theirs). A new
library layout is one module registering its rule, with no edit to the driver.

Pure: no I/O beyond what the parts already describe.
"""

from __future__ import annotations

from typing import Any

from ckptaudit.layouts.core import interpret
from ckptaudit.layouts.huggingface import file_rule
from ckptaudit.layouts.view import (
    DATA_KEYS,
    MODEL_KEYS,
    OPTIMIZER_KEYS,
    RNG_KEYS,
    SCHEDULER_KEYS,
    STEP_KEYS,
    ContractRecord,
    ModelView,
    OptimizerView,
    TensorRef,
    View,
    find_step,
    is_step_key,
    normalize_fqn,
)

__all__ = [
    "DATA_KEYS",
    "MEGATRON_MASTERS",
    "MODEL_KEYS",
    "OPTIMIZER_KEYS",
    "RNG_KEYS",
    "SCHEDULER_KEYS",
    "STEP_KEYS",
    "ContractRecord",
    "ModelView",
    "OptimizerView",
    "TensorRef",
    "View",
    "file_rule",
    "find_step",
    "interpret",
    "is_step_key",
    "normalize_fqn",
]


def __getattr__(name: str) -> Any:
    # The Megatron and DeepSpeed rules are imported when a checkpoint needs them (core.interpret).
    if name == "MEGATRON_MASTERS":
        from ckptaudit.layouts.megatron.layout import MEGATRON_MASTERS

        return MEGATRON_MASTERS
    raise AttributeError(f"module 'ckptaudit.layouts' has no attribute {name!r}")
