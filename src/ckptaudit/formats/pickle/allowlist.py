"""The pickle allowlist: every global a pickle may reference, and how each may be used.

An allowlist, not a denylist: anything nobody vetted (``io.open``, ``torch.storage._load_from_bytes``,
``os.system``) is refused by construction. :mod:`ckptaudit.formats.pickle.scan` checks names against these sets
at the opcode level; :mod:`ckptaudit.formats.pickle.unpickler` maps each allowed name to a vetted implementation.
"""

from __future__ import annotations

import _compat_pickle

__all__ = [
    "ALL_SAFE",
    "DCP_METADATA_GLOBALS",
    "HARMLESS_GLOBALS",
    "NUMPY_DTYPE_CLASSES",
    "NUMPY_GLOBALS",
    "STORAGE_TYPES",
    "TORCH_DTYPES",
    "TORCH_GLOBALS",
    "WRITER_DECLARED_SAFE",
    "global_name",
]

# Names of tensor-rebuild functions and storage types that torch.save writes.
STORAGE_TYPES = (
    "DoubleStorage FloatStorage HalfStorage BFloat16Storage LongStorage IntStorage ShortStorage CharStorage "
    "ByteStorage BoolStorage ComplexFloatStorage ComplexDoubleStorage"
).split()
TORCH_DTYPES = (
    "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool complex64 "
    "complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz double float half long int short"
).split()
NUMPY_DTYPE_CLASSES = (
    "Float64DType Float32DType Float16DType Int64DType Int32DType Int16DType Int8DType UInt64DType UInt32DType "
    "UInt16DType UInt8DType BoolDType"
).split()

TORCH_GLOBALS: frozenset[str] = frozenset(
    [
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._utils._rebuild_from_type_v2",
        "torch._tensor._rebuild_from_type_v2",
        "torch.Size",
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.device",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        "collections.OrderedDict",
        "_codecs.encode",
    ]
    + [f"builtins.{name}" for name in ("set", "frozenset", "complex", "slice")]
    + [f"torch.{s}" for s in STORAGE_TYPES]
    + [f"torch.{d}" for d in TORCH_DTYPES]
)
"""What ``torch.save`` of tensors, parameters and plain containers references."""

NUMPY_GLOBALS: frozenset[str] = frozenset(
    [
        f"{mod}.{name}"
        for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    ]
    + [f"{mod}._frombuffer" for mod in ("numpy.core.numeric", "numpy._core.numeric")]
    + ["numpy.ndarray", "numpy.dtype"]
    + [f"numpy.dtypes.{c}" for c in NUMPY_DTYPE_CLASSES]
)
"""NumPy arrays, scalars and dtypes, as RNG states (``np.random.get_state()``) pickle them."""

DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    [
        "torch.distributed.checkpoint.metadata." + n
        for n in (
            "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata TensorProperties "
            "StorageMeta MetadataIndex _MEM_FORMAT_ENCODING"
        ).split()
    ]
    # The save plans PyTorch's own planner dataclasses describe: Megatron-Core's torch_dist save keeps every rank's
    # plan in .metadata (Metadata.all_local_plans); items of ShardedObjects carry BytesIOWriteData, plans after
    # FileSystemWriter.prepare_global_plan a _StoragePrefix.
    + [
        "torch.distributed.checkpoint.planner." + n
        for n in "SavePlan WriteItem WriteItemType TensorWriteData BytesIOWriteData".split()
    ]
    + ["torch.distributed.checkpoint.filesystem._StoragePrefix"]
    + [
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
        "torch.Size",
        "collections.OrderedDict",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
    ]
    + [f"torch.{d}" for d in TORCH_DTYPES]
)
"""What ``.metadata`` of a ``torch.distributed.checkpoint`` directory references (torch 2.4 - 2.13)."""

HARMLESS_GLOBALS: dict[str, str] = {
    # Hugging Face Trainer's training_args.bin: TrainingArguments and everything it holds (transformers 4.x-5.x).
    "transformers.training_args.TrainingArguments": "object",
    "transformers.training_args_seq2seq.Seq2SeqTrainingArguments": "object",
    "transformers.trainer_pt_utils.AcceleratorConfig": "object",
    "transformers.training_args.OptimizerNames": "enum",
    "transformers.training_args.ParallelMode": "enum",
    "transformers.trainer_utils.SchedulerType": "enum",
    "transformers.trainer_utils.IntervalStrategy": "enum",
    "transformers.trainer_utils.SaveStrategy": "enum",
    "transformers.trainer_utils.HubStrategy": "enum",
    "transformers.trainer_utils.FSDPOption": "enum",
    "transformers.trainer_utils.EvaluationStrategy": "enum",
    "transformers.debug_utils.DebugOption": "enum",
    "accelerate.state.PartialState": "object",
    "accelerate.utils.dataclasses.DistributedType": "enum",
    # TRL's configs are TrainingArguments subclasses, saved the same way.
    "trl.trainer.sft_config.SFTConfig": "object",
    "trl.trainer.dpo_config.DPOConfig": "object",
    "trl.trainer.grpo_config.GRPOConfig": "object",
    "trl.trainer.reward_config.RewardConfig": "object",
    # DeepSpeed's *_optim_states.pt (0.x): its loss scalers, the ZeRO stage enum and ZeRO-1/2 fragment addresses.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "object",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "object",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "enum",
    "deepspeed.utils.tensor_fragment.fragment_address": "object",
    # Megatron-LM's common.pt: args (an argparse.Namespace, with Megatron's enums among its values) and the rerun
    # state machine, what megatron.core.safe_globals registers for torch.load(weights_only=True).
    "argparse.Namespace": "object",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig": "object",
    "megatron.core.transformer.enums.AttnBackend": "enum",
    "megatron.core.transformer.enums.CudaGraphScope": "enum",
    "megatron.core.enums.ModelType": "enum",
    "megatron.core.rerun_state_machine.RerunMode": "enum",
    "megatron.core.rerun_state_machine.RerunDiagnostic": "enum",
    "megatron.core.rerun_state_machine.RerunState": "enum",
    "signal.Signals": "enum",
}
"""Well-known framework objects that are harmless to skip, never to run: ``name -> how it may be used``.

Hugging Face's ``training_args.bin`` pickles ``TrainingArguments``, Accelerate's ``PartialState`` and enums. A
pickle whose only globals outside the allowlist are these, used the way their own ``__reduce__`` uses them, is
reported as not loaded (``security.not-loaded``, a warning). "object" names may only be instantiated without
running their constructor (``NEWOBJ`` with no arguments, as dataclasses pickle); "enum" names may only be
called with constant arguments (the enum member lookup ``Enum(value)``). Calling them any other way would run
framework code with attacker-chosen arguments on ``torch.load(weights_only=False)``, so that makes the pickle
``security.unsafe-pickle``. Exact names only: ``transformers.training_args`` + ``os.system`` (a dotted
``STACK_GLOBAL`` name reaching through the module) is not harmless."""

WRITER_DECLARED_SAFE: frozenset[str] = frozenset([
    # megatron.core.safe_globals.SAFE_GLOBALS (megatron-core 0.16): registered with
    # torch.serialization.add_safe_globals so that Megatron's own torch.load(weights_only=True) reads common.pt.
    "argparse.Namespace",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunState",
    "signal.Signals",
])
"""Names of :data:`HARMLESS_GLOBALS` that the library writing the checkpoint itself declares safe for
``torch.load(weights_only=True)`` of its own files. They are read exactly like the other harmless names (inert
placeholders, nothing constructed; a use other than their own pickling's is still ``security.unsafe-pickle``),
but not reported as ``security.not-loaded``: the checkpoint's own loader accepts them without running code, so
there is nothing to warn about. Hugging Face's ``TrainingArguments`` and DeepSpeed's classes are not declared
safe by their libraries, and keep the warning."""
assert WRITER_DECLARED_SAFE <= set(HARMLESS_GLOBALS)

ALL_SAFE: frozenset[str] = TORCH_GLOBALS | NUMPY_GLOBALS | DCP_METADATA_GLOBALS


def global_name(module: str, name: str, proto: int) -> str:
    """The global an unpickler really resolves for ``GLOBAL module name``: below protocol 3, Python's
    unpicklers map Python 2 names (``__builtin__.set``, ``commands.call`` is ``subprocess.call``)."""
    if proto < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"

