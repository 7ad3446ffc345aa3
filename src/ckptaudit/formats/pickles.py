"""Pickles without execution: an opcode-level scanner and restricted unpicklers built on one allowlist.

Three kinds of pickle reach ckptaudit: ``data.pkl`` inside ``torch.save`` zip archives (and inside every item
of a ``.distcp`` file), ``.metadata`` of ``torch.distributed.checkpoint`` directories, and plain pickles
(legacy ``torch.save`` files). None of them is ever unpickled with plain :mod:`pickle`.

1. :func:`scan` walks the opcodes (``pickletools.genops``, which decodes but never executes) with a symbolic
   stack and memo, so it resolves every global the pickle references, also through ``STACK_GLOBAL`` and memo
   indirections, and reports those outside the allowlist.
2. Only when every global is allowed does a reader unpickle, through an ``Unpickler`` whose ``find_class``
   maps each allowed name to a vetted implementation and refuses everything else (defence in depth: the
   allowlist is checked twice). Torch tensors become lazy references into the file; no storage is read.

It is an allowlist, not a denylist: anything nobody vetted (``io.open``, ``torch.storage._load_from_bytes``,
``os.system``) is refused by construction.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

__all__ = [
    "HARMLESS_GLOBALS",
    "PickleScan",
    "UnsafeGlobalError",
    "dcp_metadata_loads",
    "scan",
]

# Names of tensor-rebuild functions and storage types that torch.save writes.
_STORAGE_TYPES = (
    "DoubleStorage FloatStorage HalfStorage BFloat16Storage LongStorage IntStorage ShortStorage CharStorage "
    "ByteStorage BoolStorage ComplexFloatStorage ComplexDoubleStorage"
).split()
_TORCH_DTYPES = (
    "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool complex64 "
    "complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz double float half long int short"
).split()
_NUMPY_DTYPE_CLASSES = (
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
        "builtins.set",
        "builtins.frozenset",
        "builtins.complex",
        "builtins.slice",
        "_codecs.encode",
    ]
    + [f"torch.{s}" for s in _STORAGE_TYPES]
    + [f"torch.{d}" for d in _TORCH_DTYPES]
)
"""What ``torch.save`` of tensors, parameters and plain containers references."""

NUMPY_GLOBALS: frozenset[str] = frozenset(
    [
        f"{mod}.{name}"
        for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    ]
    + ["numpy.ndarray", "numpy.dtype"]
    + [f"numpy.dtypes.{c}" for c in _NUMPY_DTYPE_CLASSES]
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
    + [
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
        "torch.Size",
        "collections.OrderedDict",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
    ]
    + [f"torch.{d}" for d in _TORCH_DTYPES]
)
"""What ``.metadata`` of a ``torch.distributed.checkpoint`` directory references (torch 2.4 - 2.13)."""

HARMLESS_GLOBALS: tuple[str, ...] = (
    "transformers.training_args.",
    "transformers.trainer_utils.",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "transformers.utils.generic.",
    "transformers.debug_utils.",
    "accelerate.state.",
    "accelerate.utils.dataclasses.",
    "trl.trainer.",
    "enum.",
)
"""Prefixes of well-known framework objects that are harmless to skip, never to run (e.g. Hugging Face's
``training_args.bin`` pickles ``TrainingArguments``, Accelerate's ``PartialState`` and enums). A pickle whose
only disallowed globals match these is reported as not loaded (``security.not-loaded``); any other global
makes it ``security.unsafe-pickle``."""

ALL_SAFE: frozenset[str] = TORCH_GLOBALS | NUMPY_GLOBALS | DCP_METADATA_GLOBALS


@dataclass(frozen=True, slots=True)
class PickleScan:
    """What one pickle references, read at the opcode level."""

    globals: tuple[str, ...]
    """Every global, ``module.name``, in order of first appearance."""
    unsafe: tuple[str, ...]
    """Globals outside the allowlist and outside :data:`HARMLESS_GLOBALS`."""
    harmless: tuple[str, ...]
    """Globals outside the allowlist that :data:`HARMLESS_GLOBALS` names: not loaded, not a threat."""
    error: str | None = None
    """Why the opcodes could not be walked to the end (truncated or malformed), with the byte offset."""
    error_offset: int | None = None
    end: int = 0
    """Offset just past the ``STOP`` opcode (where a following pickle starts)."""

    @property
    def loadable(self) -> bool:
        return self.error is None and not self.unsafe and not self.harmless


class UnsafeGlobalError(pickle.UnpicklingError):
    """A restricted unpickler met a global outside its allowlist."""

    def __init__(self, name: str) -> None:
        super().__init__(f"global {name!r} is not in the allowlist; refusing to load it")
        self.name = name


class _Mark:
    pass


_MARK = _Mark()
_UNKNOWN = object()
_STRING_OPS = frozenset(
    "STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8".split()
)


def scan(data: bytes | IO[bytes], allowed: frozenset[str] = ALL_SAFE) -> PickleScan:
    """Walk one pickle's opcodes (never executing them) and classify every global it references.

    ``data`` is the pickle's bytes or a stream positioned at its start; a stream is left just past ``STOP``.
    """
    stream: IO[bytes] = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
    start = stream.tell()
    found: dict[str, None] = {}
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    error: str | None = None
    error_offset: int | None = None
    pos = start

    def note(name: str) -> None:
        found.setdefault(name, None)

    try:
        for op, arg, at in pickletools.genops(stream):
            pos = at if at is not None else pos
            name = op.name
            if name == "MARK":
                stack.append(_MARK)
                continue
            # Memo operations leave the stack as it is (PUT) or push a remembered value (GET).
            if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack:
                    raise ValueError(f"{name} on an empty stack")
                memo[int(str(arg)) if name != "MEMOIZE" else len(memo)] = stack[-1]
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                if int(str(arg)) not in memo:
                    raise ValueError(f"{name} of memo entry {arg} that was never stored")
                stack.append(memo[int(str(arg))])
                continue
            # Pop what the opcode consumes (to the mark, then the fixed items before it).
            before = op.stack_before
            if pickletools.markobject in before:
                while stack and stack[-1] is not _MARK:
                    stack.pop()
                if not stack:
                    raise ValueError("MARK expected on the stack")
                stack.pop()
                fixed = before.index(pickletools.markobject)
            else:
                fixed = len(before)
            popped = []
            for _ in range(fixed):
                if not stack:
                    raise ValueError(f"stack underflow at opcode {name}")
                popped.append(stack.pop())
            popped.reverse()
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                note(f"{module}.{attr}")
            elif name == "STACK_GLOBAL":
                module_obj, attr_obj = popped
                if isinstance(module_obj, str) and isinstance(attr_obj, str):
                    note(f"{module_obj}.{attr_obj}")
                else:
                    note("<unresolvable STACK_GLOBAL>")
            elif name in ("EXT1", "EXT2", "EXT4"):
                note(f"<copyreg extension {arg}>")
            # Push what the opcode produces.
            if name in _STRING_OPS:
                stack.append(arg if isinstance(arg, str) else _UNKNOWN)
            else:
                stack.extend(_UNKNOWN for _ in op.stack_after)
            if name == "STOP":
                break
    except Exception as exc:  # noqa: BLE001 - every malformed pickle becomes a scan error, never a crash
        error = f"{exc}"
        error_offset = pos
    end = stream.tell()
    names = tuple(found)
    unsafe: list[str] = []
    harmless: list[str] = []
    for n in names:
        if n in allowed:
            continue
        if n.startswith(HARMLESS_GLOBALS):
            harmless.append(n)
        else:
            unsafe.append(n)
    if error is None and not names and end == start:
        error, error_offset = "empty pickle", start
    return PickleScan(names, tuple(unsafe), tuple(harmless), error, error_offset, end)


# --------------------------------------------------------------------------------------------------------------
# Restricted unpicklers


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals only through ``table`` (``module.name`` -> object)."""

    def __init__(
        self,
        file: io.BufferedIOBase,
        table: dict[str, Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._table = table
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        try:
            return self._table[key]
        except KeyError:
            raise UnsafeGlobalError(key) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed in this pickle")
        return self._persistent(pid)


def _safe_codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1").
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is only allowed for latin1 byte strings")
    return obj.encode("latin1")


def _numpy_table() -> dict[str, Any]:
    import numpy as np

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not np.ndarray:
            raise pickle.UnpicklingError("only plain numpy.ndarray may be reconstructed")
        return np.ndarray.__new__(np.ndarray, shape, dtype)

    def make_dtype(spec: Any, align: bool = False, copy: bool = False) -> Any:
        dt = np.dtype(spec, align=align, copy=copy)
        if dt.hasobject or dt.kind not in "biufc":
            raise pickle.UnpicklingError(f"numpy dtype {dt} is not allowed (only numeric dtypes)")
        return dt

    def scalar(dtype: Any, data: Any = None) -> Any:
        if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
            raise pickle.UnpicklingError("only numeric numpy scalars are allowed")
        if len(data) != dtype.itemsize:
            raise pickle.UnpicklingError("numpy scalar size does not match its dtype")
        return np.frombuffer(data, dtype=dtype)[0]

    table: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": make_dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[f"{mod}._reconstruct"] = reconstruct
        table[f"{mod}.scalar"] = scalar
    dtypes_mod = getattr(np, "dtypes", None)
    for cls in _NUMPY_DTYPE_CLASSES:
        if dtypes_mod is not None and hasattr(dtypes_mod, cls):
            table[f"numpy.dtypes.{cls}"] = getattr(dtypes_mod, cls)
    return table


def base_table() -> dict[str, Any]:
    """Harmless builtins and containers shared by every restricted unpickler."""
    import torch

    table: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.complex": complex,
        "builtins.slice": slice,
        "_codecs.encode": _safe_codecs_encode,
        "torch.Size": torch.Size,
        "torch.device": torch.device,
    }
    for d in _TORCH_DTYPES:
        value = getattr(torch, d, None)
        if isinstance(value, torch.dtype):
            table[f"torch.{d}"] = value
    table.update(_numpy_table())
    return table


def dcp_metadata_loads(data: bytes) -> Any:
    """Unpickle a DCP ``.metadata`` file through the DCP allowlist. Call :func:`scan` first for a report.

    Raises :class:`UnsafeGlobalError` for anything outside the allowlist, ``pickle.UnpicklingError`` or
    ``ValueError``/``EOFError`` for malformed data.
    """
    import pathlib

    import torch
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.serialization

    table = base_table()
    for name in DCP_METADATA_GLOBALS:
        module, _, attr = name.rpartition(".")
        if module == "torch.distributed.checkpoint.metadata":
            table[name] = getattr(dcp_md, attr)
    table["torch.distributed.checkpoint.filesystem._StorageInfo"] = dcp_fs._StorageInfo
    table["torch.serialization._get_layout"] = torch.serialization._get_layout
    table["torch.Size"] = torch.Size
    table["pathlib.PosixPath"] = pathlib.PurePosixPath
    table["pathlib.PurePosixPath"] = pathlib.PurePosixPath
    table["pathlib.PureWindowsPath"] = pathlib.PureWindowsPath
    # Only the names the DCP allowlist admits: drop numpy, devices and the like from the base table.
    table = {k: v for k, v in table.items() if k in DCP_METADATA_GLOBALS}
    return RestrictedUnpickler(io.BytesIO(data), table).load()


def describe(names: Iterable[str]) -> str:
    return ", ".join(sorted(set(names)))
