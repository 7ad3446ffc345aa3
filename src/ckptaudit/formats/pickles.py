"""Pickles without execution: an opcode-level scanner and restricted unpicklers built on one allowlist.

Three kinds of pickle reach ckptaudit: ``data.pkl`` inside ``torch.save`` zip archives (and inside every item
of a ``.distcp`` file), ``.metadata`` of ``torch.distributed.checkpoint`` directories, and plain pickles
(legacy ``torch.save`` files, ``*.pkl``). None of them is ever unpickled with plain :mod:`pickle`.

1. :func:`scan` walks the opcodes (decoding, never executing) with a symbolic stack and memo, so it resolves
   every global the pickle references, also through ``STACK_GLOBAL`` and memo indirections, and reports those
   outside the allowlist. Declared lengths are checked against the bytes that remain before anything is
   read (a ``BINBYTES8`` claiming terabytes is an error, not an allocation), long byte strings are skipped
   rather than read, memo indices may not run ahead of the opcodes, and opcode count and stack depth have
   hard limits.
2. Only when every global is allowed does a reader unpickle, through :class:`RestrictedUnpickler`: a
   pure-Python unpickler whose ``find_class`` maps each allowed name to a vetted implementation (the
   allowlist is checked twice), which refuses ``EXT``/``INST``/``OBJ``, lets ``BUILD`` touch only
   instances of vetted classes with vetted state, and charges every call against a budget proportional
   to the pickle's size (so a small pickle cannot make a huge object by calling allowed functions in a
   loop). Torch tensors become lazy references into the file; no storage is read.
3. :func:`check_tree` bounds the depth and the expanded size of what was loaded (no cycles, no
   exponential sharing), so every later recursive walk is safe.

It is an allowlist, not a denylist: anything nobody vetted (``io.open``, ``torch.storage._load_from_bytes``,
``os.system``) is refused by construction.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import math
import pickle
import pickletools
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

__all__ = [
    "ALL_SAFE",
    "DCP_METADATA_GLOBALS",
    "HARMLESS_GLOBALS",
    "MAX_DEPTH",
    "MAX_METADATA_OPCODES",
    "MAX_NODES",
    "MAX_OPCODES",
    "NUMPY_GLOBALS",
    "TORCH_GLOBALS",
    "Opaque",
    "PickleLimitError",
    "PickleScan",
    "RestrictedUnpickler",
    "UnsafeGlobalError",
    "base_table",
    "check_tree",
    "dcp_metadata_loads",
    "scan",
]

# --------------------------------------------------------------------------------------------------------------
# Limits. Real checkpoints stay far below them; a hostile pickle meets them long before it can exhaust memory or
# time. Hitting one is reported as a finding naming the limit, never a crash.

MAX_OPCODES = 5_000_000
"""Opcodes walked per pickle (``torch.save`` needs about 25 per tensor: 200k tensors). Walking costs about 1 µs
per opcode and loading about 2 µs; each opcode makes at most one object (at most ~70 bytes), which bounds the
memory of what a pickle can build to a few hundred MiB."""
MAX_METADATA_OPCODES = 20_000_000
"""The same for DCP ``.metadata`` (about 25 opcodes per shard of a tensor: 800k shards, e.g. a 70B model's
parameters and Adam moments over 300 ranks)."""
MAX_STACK = 1 << 22
"""Deepest symbolic stack accepted."""
MAX_LINE = 1 << 16
"""Longest line argument (``GLOBAL``, ``INT``, ``UNICODE`` of protocol 0)."""
MAX_INLINE = 1 << 16
"""String arguments longer than this are skipped by the scanner (it only needs short ones: names)."""
MAX_DEPTH = 100
"""Deepest nesting of a loaded object tree (real checkpoints: under 15)."""
MAX_NODES = 10_000_000
"""Most nodes of a loaded tree, shared sub-trees counted every time they are reachable."""
CALL_BUDGET_FACTOR = 4
"""Constructors called while unpickling may copy at most this many times the pickle's size (plus 16 Mi)."""

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
        "_codecs.encode",
    ]
    + [f"builtins.{name}" for name in ("set", "frozenset", "complex", "slice")]
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
    + [f"{mod}._frombuffer" for mod in ("numpy.core.numeric", "numpy._core.numeric")]
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

ALL_SAFE: frozenset[str] = TORCH_GLOBALS | NUMPY_GLOBALS | DCP_METADATA_GLOBALS


@dataclass(frozen=True, slots=True)
class PickleScan:
    """What one pickle references, read at the opcode level."""

    globals: tuple[str, ...]
    """Every global, ``module.name``, in order of first appearance."""
    unsafe: tuple[str, ...]
    """Globals outside the allowlist and outside :data:`HARMLESS_GLOBALS`, and harmless ones misused."""
    harmless: tuple[str, ...]
    """Globals outside the allowlist that :data:`HARMLESS_GLOBALS` names, used as documented: not loaded, not
    a threat."""
    error: str | None = None
    """Why the opcodes could not be walked to the end (truncated, malformed or over a limit)."""
    error_offset: int | None = None
    """Byte offset of the opcode where the walk stopped (relative to the pickle's start in its stream)."""
    end: int = 0
    """Offset just past the ``STOP`` opcode (where a following pickle starts)."""
    limit: bool = False
    """The error is a safety limit of the scanner (the pickle may be well-formed but too large to vet)."""
    misused: tuple[str, ...] = field(default=())
    """Harmless globals called in a way their own pickling never does (they are also in ``unsafe``)."""

    @property
    def loadable(self) -> bool:
        return self.error is None and not self.unsafe and not self.harmless


class UnsafeGlobalError(pickle.UnpicklingError):
    """A restricted unpickler met a global outside its allowlist."""

    def __init__(self, name: str) -> None:
        super().__init__(f"global {name!r} is not in the allowlist; refusing to load it")
        self.name = name


class PickleLimitError(pickle.UnpicklingError):
    """A pickle, or what it builds, exceeds one of the safety limits of this module."""


class _ScanError(Exception):
    def __init__(self, message: str, limit: bool = False) -> None:
        super().__init__(message)
        self.limit = limit


# --------------------------------------------------------------------------------------------------------------
# The scanner


class _Mark:
    __slots__ = ()


class _Const:
    """A constant (number, bool, None, bytes, or a string too long to keep)."""

    __slots__ = ()


class _Unknown:
    """Any value the scanner does not model (the result of a call, a container)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class _Global:
    name: str


@dataclass(frozen=True, slots=True)
class _Tuple:
    """A tuple whose items are all constants or strings, of length ``n``."""

    n: int


_MARK, _CONST, _UNKNOWN = _Mark(), _Const(), _Unknown()
_OPS: list[pickletools.OpcodeInfo | None] = [None] * 256
for _op in pickletools.opcodes:
    _OPS[ord(_op.code)] = _op

# Length-prefixed arguments: (struct format of the length, kind of value).
_PREFIXED = {
    "string1": ("<B", "str1"),
    "string4": ("<i", "str1"),
    "bytes1": ("<B", "bytes"),
    "bytes4": ("<I", "bytes"),
    "bytes8": ("<Q", "bytes"),
    "bytearray8": ("<Q", "bytes"),
    "unicodestring1": ("<B", "str"),
    "unicodestring4": ("<I", "str"),
    "unicodestring8": ("<Q", "str"),
    "long1": ("<B", "long"),
    "long4": ("<i", "long"),
}
_FIXED = {name: struct.Struct(fmt) for name, fmt in
          {"uint1": "<B", "uint2": "<H", "int4": "<i", "uint4": "<I", "uint8": "<Q", "float8": ">d"}.items()}
_CONST_OPS = frozenset(
    "NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT BINBYTES SHORT_BINBYTES "
    "BINBYTES8 BYTEARRAY8".split()
)


def global_name(module: str, name: str, proto: int) -> str:
    """The global an unpickler really resolves for ``GLOBAL module name``: below protocol 3, Python's
    unpicklers map Python 2 names (``__builtin__.set``, ``commands.call`` is ``subprocess.call``)."""
    if proto < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _is_const(value: Any) -> bool:
    return isinstance(value, str | _Const | _Tuple)


class _Walker:
    """One pass over one pickle's opcodes with a symbolic stack and memo."""

    def __init__(self, stream: IO[bytes], allowed: frozenset[str], max_opcodes: int) -> None:
        self.stream = stream
        self.max_opcodes = max_opcodes
        self.start = stream.tell()
        stream.seek(0, io.SEEK_END)
        self.size = stream.tell()
        stream.seek(self.start)
        self.allowed = allowed
        self.found: dict[str, None] = {}
        self.misused: dict[str, None] = {}
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.op_at = self.start
        self.proto = 0

    # -- argument decoding, bounded by what the stream still holds ------------------------------------------
    def _remaining(self) -> int:
        return self.size - self.stream.tell()

    def _exact(self, n: int, what: str) -> bytes:
        if n > self._remaining():
            raise _ScanError(f"{what} declares {n} bytes, only {self._remaining()} remain (truncated or corrupt)")
        data = self.stream.read(n)
        if len(data) != n:
            raise _ScanError(f"{what}: needs {n} bytes, read {len(data)}")
        return data

    def _line(self) -> bytes:
        line = self.stream.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            if len(line) > MAX_LINE:
                raise _ScanError(f"a line argument is longer than {MAX_LINE} bytes", limit=True)
            raise _ScanError("line argument without newline (truncated)")
        return line

    def _arg(self, op: pickletools.OpcodeInfo) -> Any:
        desc = op.arg
        if desc is None:
            return None
        if desc.n > 0:  # a few bytes: read them, no allocation to check
            data = self.stream.read(desc.n)
            if len(data) != desc.n:
                raise _ScanError(f"{op.name}: its {desc.n}-byte argument is truncated")
            return _FIXED[desc.name].unpack(data)[0]
        if desc.n == pickletools.UP_TO_NEWLINE:
            lines = self._line()
            if desc.name == "stringnl_noescape_pair":
                lines += self._line()
            return desc.reader(io.BytesIO(lines))
        fmt, kind = _PREFIXED[desc.name]
        (n,) = struct.unpack(fmt, self._exact(struct.calcsize(fmt), op.name))
        if n < 0:
            raise _ScanError(f"{op.name} declares a negative length {n}")
        if n > self._remaining():
            raise _ScanError(f"{op.name} declares {n} bytes, only {self._remaining()} remain (truncated or corrupt)")
        if n > MAX_INLINE:
            self.stream.seek(n, io.SEEK_CUR)  # never read: the scanner needs only short strings (names)
            return _CONST
        data = self._exact(n, op.name)
        if kind == "str":
            return data.decode("utf-8", "surrogatepass")
        if kind == "str1":
            return data.decode("latin-1")
        return _CONST

    # -- the walk --------------------------------------------------------------------------------------------
    def _pop(self, name: str) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise _ScanError(f"stack underflow at {name}" + (" (it would pop a MARK)" if self.marks else ""))
        return self.stack.pop()

    def _pop_mark(self, name: str) -> list[Any]:
        if not self.marks:
            raise _ScanError(f"{name} without a MARK")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def _call(self, callee: Any, args: Any, how: str) -> None:
        """``callee(*args)`` (REDUCE) or ``callee.__new__(callee, *args)`` (NEWOBJ): check harmless usage."""
        if not isinstance(callee, _Global):
            return
        kind = HARMLESS_GLOBALS.get(callee.name)
        if kind is None:
            return
        if how == "newobj" and isinstance(args, _Tuple) and args.n == 0:
            return
        if how == "reduce" and kind == "enum" and isinstance(args, _Tuple) and args.n == 1:
            return
        self.misused.setdefault(callee.name, None)

    def run(self) -> int:
        """Walk to ``STOP``; returns the opcode count. Raises :class:`_ScanError`."""
        count = 0
        stream, stack = self.stream, self.stack
        while True:
            self.op_at = stream.tell()
            code = stream.read(1)
            if not code:
                raise _ScanError("the pickle ends before its STOP opcode (truncated)")
            op = _OPS[code[0]]
            if op is None:
                raise _ScanError(f"unknown opcode {code!r}")
            count += 1
            if count > self.max_opcodes:
                raise _ScanError(f"more than {self.max_opcodes} opcodes", limit=True)
            generic = _GENERIC[code[0]]
            if generic is not None:  # the common container and constant opcodes: no names, no calls
                has_mark, pops, pushes = generic
                if op.arg is not None:
                    self._arg(op)
                if has_mark:
                    self._pop_mark(op.name)
                if pops > len(stack) - (self.marks[-1] if self.marks else 0):
                    raise _ScanError(f"stack underflow at {op.name}" + (" (it would pop a MARK)" if self.marks else ""))
                if pops:
                    del stack[-pops:]
                stack.extend(pushes)
                if len(stack) > MAX_STACK:
                    raise _ScanError(f"stack deeper than {MAX_STACK}", limit=True)
                continue
            arg = self._arg(op)
            name = op.name
            if name == "STOP":
                self._pop(name)
                return count
            if name == "MARK":
                self.marks.append(len(stack))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack or (self.marks and len(stack) == self.marks[-1]):
                    raise _ScanError(f"{name} with nothing to remember")
                index = len(self.memo) if name == "MEMOIZE" else int(arg)
                # Picklers number memo entries 0, 1, 2, ...; a far larger index would make C unpicklers (DCP's
                # pickle.load of .metadata) allocate a memo array of that size.
                if not 0 <= index <= count:
                    raise _ScanError(f"memo index {index} is beyond the {count} opcodes read so far (picklers number "
                                     "memo entries in order)")
                self.memo[index] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if int(arg) not in self.memo:
                    raise _ScanError(f"{name} of memo entry {arg}, which was never stored")
                stack.append(self.memo[int(arg)])
            elif name == "FRAME":
                if int(arg) > self._remaining():
                    raise _ScanError(f"FRAME declares {arg} bytes, only {self._remaining()} remain")
            elif name == "PROTO":
                if not 0 <= int(arg) <= pickle.HIGHEST_PROTOCOL:
                    raise _ScanError(f"unsupported pickle protocol {arg}")
                self.proto = int(arg)
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                full = global_name(module, attr, self.proto)
                self.found.setdefault(full, None)
                if name == "INST":
                    args = self._pop_mark(name)
                    if args:
                        self._call(_Global(full), _UNKNOWN, "inst")
                    stack.append(_UNKNOWN)
                else:
                    stack.append(_Global(full))
            elif name == "STACK_GLOBAL":
                attr_obj = self._pop(name)
                module_obj = self._pop(name)
                if isinstance(module_obj, str) and isinstance(attr_obj, str):
                    full = global_name(module_obj, attr_obj, self.proto)
                else:
                    full = "<unresolvable STACK_GLOBAL>"
                self.found.setdefault(full, None)
                stack.append(_Global(full))
            elif name in ("EXT1", "EXT2", "EXT4"):
                self.found.setdefault(f"<copyreg extension {arg}>", None)
                stack.append(_UNKNOWN)
            elif name == "REDUCE":
                args = self._pop(name)
                callee = self._pop(name)
                self._call(callee, args, "reduce")
                stack.append(_UNKNOWN)
            elif name == "NEWOBJ":
                args = self._pop(name)
                callee = self._pop(name)
                self._call(callee, args, "newobj")
                stack.append(_UNKNOWN)
            elif name == "NEWOBJ_EX":
                self._pop(name)
                args = self._pop(name)
                callee = self._pop(name)
                self._call(callee, _UNKNOWN, "newobj_ex")
                stack.append(_UNKNOWN)
            elif name == "OBJ":
                items = self._pop_mark(name)
                if not items:
                    raise _ScanError("OBJ without a class")
                if len(items) > 1:
                    self._call(items[0], _UNKNOWN, "obj")
                stack.append(_UNKNOWN)
            elif name == "EMPTY_TUPLE":
                stack.append(_Tuple(0))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = [self._pop(name) for _ in range(n)]
                stack.append(_Tuple(n) if all(_is_const(v) for v in items) else _UNKNOWN)
            elif name == "TUPLE":
                items = self._pop_mark(name)
                stack.append(_Tuple(len(items)) if all(_is_const(v) for v in items) else _UNKNOWN)
            elif name == "POP" and self.marks and len(stack) == self.marks[-1]:
                self.marks.pop()  # POP of a MARK is legal (both unpicklers allow it)
            elif name == "DUP":
                stack.append(self._pop(name))
                stack.append(stack[-1])
            elif name in _STRING_OPS:
                stack.append(arg if isinstance(arg, str) else _CONST)
            elif name in _CONST_OPS:
                stack.append(_CONST)
            else:
                # Everything else: pop what the opcode consumes (to the mark, then the fixed items before it) and
                # push an unknown for what it produces.
                before = op.stack_before
                if pickletools.markobject in before:
                    self._pop_mark(name)
                    fixed = before.index(pickletools.markobject)
                else:
                    fixed = len(before)
                for _ in range(fixed):
                    self._pop(name)
                stack.extend(_UNKNOWN for _ in op.stack_after)
            if len(stack) > MAX_STACK:
                raise _ScanError(f"stack deeper than {MAX_STACK}", limit=True)


_STRING_OPS = frozenset(
    "STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8".split()
)
_SPECIAL_OPS = frozenset(
    "STOP MARK PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET LONG_BINGET FRAME PROTO GLOBAL INST STACK_GLOBAL EXT1 "
    "EXT2 EXT4 REDUCE NEWOBJ NEWOBJ_EX OBJ EMPTY_TUPLE TUPLE1 TUPLE2 TUPLE3 TUPLE POP DUP".split()
) | _STRING_OPS


def _generic(op: pickletools.OpcodeInfo) -> tuple[bool, int, tuple[Any, ...]] | None:
    """(pops to a MARK first, fixed items popped, items pushed) for opcodes whose effect needs no modelling."""
    if op.name in _SPECIAL_OPS:
        return None
    if op.name in _CONST_OPS:
        return False, 0, (_CONST,)
    before = op.stack_before
    has_mark = pickletools.markobject in before
    fixed = before.index(pickletools.markobject) if has_mark else len(before)
    return has_mark, fixed, tuple(_UNKNOWN for _ in op.stack_after)


_GENERIC: list[tuple[bool, int, tuple[Any, ...]] | None] = [
    None if op is None else _generic(op) for op in _OPS
]


def scan(data: bytes | bytearray | memoryview | IO[bytes], allowed: frozenset[str] = ALL_SAFE, *,
         max_opcodes: int = MAX_OPCODES) -> PickleScan:
    """Walk one pickle's opcodes (never executing them) and classify every global it references.

    ``data`` is the pickle's bytes or a seekable stream positioned at its start; a stream is left just past
    ``STOP`` (or where the walk stopped). Offsets in the result are positions in the stream.
    """
    stream: IO[bytes] = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
    walker = _Walker(stream, allowed, max_opcodes)
    error: str | None = None
    error_offset: int | None = None
    limit = False
    try:
        walker.run()
    except _ScanError as exc:
        error, limit = str(exc), exc.limit
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        # pickletools' line readers reject malformed numbers and quotes with ValueError.
        error = f"malformed argument ({exc})"
    if error is not None:
        error_offset = walker.op_at
    end = stream.tell()
    names = tuple(walker.found)
    misused = tuple(walker.misused)
    unsafe: list[str] = []
    harmless: list[str] = []
    for n in names:
        if n in allowed:
            continue
        if n in HARMLESS_GLOBALS and n not in walker.misused:
            harmless.append(n)
        else:
            unsafe.append(n)
    return PickleScan(names, tuple(unsafe), tuple(harmless), error, error_offset, end, limit, misused)


# --------------------------------------------------------------------------------------------------------------
# Restricted unpicklers


class _Capped:
    """A read-only view of a stream that never reads past ``end`` and never reads unbounded lines."""

    def __init__(self, stream: IO[bytes], end: int) -> None:
        self._s = stream
        self._end = end

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._end - self._s.tell())
        return self._s.read(left if n is None or n < 0 else min(n, left))

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readline(self, limit: int = -1) -> bytes:
        left = max(0, self._end - self._s.tell())
        cap = min(left, MAX_LINE + 1) if limit is None or limit < 0 else min(left, limit)
        return self._s.readline(cap)

    def tell(self) -> int:
        return self._s.tell()


_SIZED = frozenset({str, bytes, bytearray, tuple, list, dict, set, frozenset})


class Opaque:
    """An object of a class outside the allowlist, never constructed: the name of its global and the arguments
    and state it would have been built from (themselves loaded under the same rules). What an *inert* load puts
    where ``torch.load(weights_only=False)`` would have run code."""

    __slots__ = ("args", "name", "state")

    def __init__(self, name: str, args: tuple[Any, ...] = (), state: Any = None) -> None:
        self.name, self.args, self.state = name, args, state

    def __repr__(self) -> str:
        return f"<not loaded: {self.name}>"


class _OpaqueGlobal:
    """Stands for a global outside the allowlist in an inert load: calling it (``REDUCE``, ``NEWOBJ``) builds an
    :class:`Opaque` record; nothing of the named module is imported or run."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that resolves globals only through ``table`` (``module.name`` -> object) and never runs
    anything else: no ``EXT``, ``INST`` or ``OBJ``; ``NEWOBJ`` only on classes of the table; ``BUILD`` only on
    instances of ``build_types`` (their own ``__setstate__`` or plain attributes) and, with vetted state, on
    NumPy dtypes and arrays. Calls are charged against a budget of ``CALL_BUDGET_FACTOR`` times the pickle's
    size (see :data:`CALL_BUDGET_FACTOR`).

    Run :func:`scan` first: this class is the second line of defence, and the scan's limits bound its work.
    """

    # Set by pickle._Unpickler.load (typeshed does not declare them).
    stack: list[Any]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    proto: int

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(
        self,
        file: IO[bytes],
        table: dict[str, Any],
        persistent_load: Callable[[Any], Any] | None = None,
        *,
        build_types: Iterable[type] = (collections.OrderedDict,),
        size: int | None = None,
        inert: bool = False,
    ) -> None:
        start = file.tell()
        if size is None:
            file.seek(0, io.SEEK_END)
            size = file.tell() - start
            file.seek(start)
        # In-memory pickles cannot over-read; file streams are capped at the pickle's end.
        super().__init__(file if isinstance(file, io.BytesIO) else _Capped(file, start + size))  # type: ignore[arg-type]
        self._table = table
        self._callables = {id(v) for v in table.values()}
        self._types = {v for v in table.values() if isinstance(v, type)}
        self._build_types = tuple(build_types)
        self._persistent = persistent_load
        self._budget = CALL_BUDGET_FACTOR * size + (16 << 20)
        self._inert = inert
        self._opaque: dict[str, _OpaqueGlobal] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = global_name(module, name, self.proto)  # the same name the scanner vetted
        try:
            return self._table[key]
        except KeyError:
            if self._inert:  # an inert placeholder: the rest of the pickle can be read, nothing is run
                return self._opaque.setdefault(key, _OpaqueGlobal(key))
            raise UnsafeGlobalError(key) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed in this pickle")
        return self._persistent(pid)

    # -- charged calls ----------------------------------------------------------------------------------------
    def _charge(self, *values: Any) -> None:
        for v in values:
            self._budget -= (len(v) if type(v) in _SIZED else 1) + 1
        if self._budget < 0:
            raise PickleLimitError("the pickle's calls build more than the budget allows (a copy amplification)")

    def _load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if isinstance(func, _OpaqueGlobal) and isinstance(args, tuple):
            self._charge(*args)
            stack[-1] = Opaque(func.name, args)
            return
        if id(func) not in self._callables or not isinstance(args, tuple):
            raise pickle.UnpicklingError(f"REDUCE of {type(func).__name__}, which is not an allowed callable")
        self._charge(*args)
        stack[-1] = func(*args)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if isinstance(cls, _OpaqueGlobal) and isinstance(args, tuple):
            self._charge(*args)
            self.append(Opaque(cls.name, args))
            return
        if cls not in self._types or not isinstance(args, tuple):
            raise pickle.UnpicklingError(f"NEWOBJ of {cls!r}, which is not an allowed class")
        self._charge(*args)
        self.append(cls.__new__(cls, *args))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if isinstance(cls, _OpaqueGlobal) and isinstance(args, tuple) and isinstance(kwargs, dict):
            self._charge(*args, *kwargs.values())
            self.append(Opaque(cls.name, args, kwargs))
            return
        if cls not in self._types or not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise pickle.UnpicklingError(f"NEWOBJ_EX of {cls!r}, which is not an allowed class")
        if not all(isinstance(k, str) for k in kwargs):
            raise pickle.UnpicklingError("NEWOBJ_EX with non-string keyword names")
        self._charge(*args, *kwargs.values())
        self.append(cls.__new__(cls, *args, **kwargs))

    def _refuse(self) -> None:
        raise pickle.UnpicklingError("EXT, INST and OBJ opcodes are not allowed (torch.save never writes them)")

    def _load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        data = self.read(n)  # read first (bounded by the stream), never bytearray(n) of a declared size
        if len(data) != n:
            raise pickle.UnpicklingError("BYTEARRAY8 runs past the end of the pickle")
        self.append(bytearray(data))

    def _load_build(self) -> None:
        stack = self.stack
        state = stack.pop()
        inst = stack[-1]
        stack[-1] = self._build(inst, state)

    def _build(self, inst: Any, state: Any) -> Any:
        if isinstance(inst, Opaque):
            inst.state = state  # kept as data, never applied
            return inst
        if isinstance(inst, _OpaqueGlobal):
            return Opaque(inst.name, (), state)
        np = _numpy()
        if np is not None and isinstance(inst, np.dtype):
            return _dtype_from_state(inst, state)
        if isinstance(inst, _NdarrayShell):
            self._charge(state[-1] if isinstance(state, tuple) and state else None)
            return _ndarray_from_state(state)
        if type(inst) not in self._build_types:
            raise pickle.UnpicklingError(f"BUILD on {type(inst).__name__} is not allowed")
        own = type(inst).__dict__.get("__setstate__")
        if own is not None:
            own(inst, state)
            return inst
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if not isinstance(part, dict):
                raise pickle.UnpicklingError(f"BUILD state for {type(inst).__name__} is not a dict")
            for k, v in part.items():
                if not isinstance(k, str) or k.startswith("__"):
                    raise pickle.UnpicklingError(f"BUILD may not set attribute {k!r}")
                object.__setattr__(inst, k, v)
        return inst

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8
    for _code in (pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.INST, pickle.OBJ):
        dispatch[_code[0]] = _refuse


def _numpy() -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return np


def _safe_codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1").
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is only allowed for latin1 byte strings")
    return obj.encode("latin1")


class _NdarrayType:
    """Stands for ``numpy.ndarray`` in a pickle: only ever the first argument of ``_reconstruct``."""

    __slots__ = ()


class _NdarrayShell:
    """What ``_reconstruct`` returns: an empty array waiting for its ``BUILD`` state."""

    __slots__ = ()


def _numeric_dtype(dt: Any) -> Any:
    np = _numpy()
    if not isinstance(dt, np.dtype) or dt.hasobject or dt.kind not in "biufc" or dt.subdtype is not None:
        raise pickle.UnpicklingError(f"numpy dtype {dt!r} is not allowed (only plain numeric dtypes)")
    return dt


def _dtype_from_state(dt: Any, state: Any) -> Any:
    # numpy pickles a dtype as dtype(spec, False, True) + BUILD (3, byteorder, None, None, None, -1, -1, 0).
    ok = (
        isinstance(state, tuple)
        and len(state) in (8, 9)
        and state[0] in (3, 4)
        and state[1] in ("<", ">", "|", "=")
        and state[2:5] == (None, None, None)
        and state[5:8] == (-1, -1, 0)
        and (len(state) == 8 or state[8] is None)
    )
    if not ok:
        raise pickle.UnpicklingError(f"numpy dtype state {state!r} is not that of a plain numeric dtype")
    new = dt.newbyteorder(state[1]) if state[1] in "<>" else dt
    return _numeric_dtype(new)


def _ndarray_from_state(state: Any) -> Any:
    np = _numpy()
    if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
        raise pickle.UnpicklingError("numpy array state is not (1, shape, dtype, fortran, data)")
    _, shape, dtype, fortran, raw = state
    if not (isinstance(shape, tuple) and all(isinstance(d, int) and d >= 0 for d in shape) and len(shape) <= 64):
        raise pickle.UnpicklingError(f"numpy array shape {shape!r} is not a tuple of sizes")
    dtype = _numeric_dtype(dtype)
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise pickle.UnpicklingError("numpy array data is not a byte string")
    data = bytes(raw)
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise pickle.UnpicklingError(f"numpy array data does not match shape {list(shape)} x {dtype}")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _numpy_table() -> dict[str, Any]:
    np = _numpy()

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> _NdarrayShell:
        # numpy always writes _reconstruct(ndarray, (0,), b'b'): an empty array that BUILD fills.
        if subtype is not _NdarrayType or not isinstance(shape, tuple) or math.prod(
            int(d) if isinstance(d, int) else 1 for d in shape
        ) != 0:
            raise pickle.UnpicklingError("only an empty plain numpy.ndarray may be reconstructed")
        return _NdarrayShell()

    def make_dtype(spec: Any, align: bool = False, copy: bool = False) -> Any:
        if not isinstance(spec, str) or len(spec) > 8:
            raise pickle.UnpicklingError(f"numpy dtype spec {spec!r} is not a short type code")
        return _numeric_dtype(np.dtype(spec, align=bool(align), copy=True))

    def scalar(dtype: Any, data: Any = None) -> Any:
        dtype = _numeric_dtype(dtype)
        if not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise pickle.UnpicklingError("numpy scalar data does not match its dtype")
        return np.frombuffer(data, dtype=dtype)[0]

    def frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> Any:
        # Protocol 5 spells an array as _frombuffer(bytes, dtype, shape, order).
        return _ndarray_from_state((1, shape, dtype, order == "F", buf))

    table: dict[str, Any] = {"numpy.ndarray": _NdarrayType, "numpy.dtype": make_dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[f"{mod}._reconstruct"] = reconstruct
        table[f"{mod}.scalar"] = scalar
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        table[f"{mod}._frombuffer"] = frombuffer
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
        "_codecs.encode": _safe_codecs_encode,
        "torch.Size": torch.Size,
        "torch.device": torch.device,
    }
    # (Protocol 2, torch.save's default, spells them __builtin__.set etc.: see global_name.)
    table.update({"builtins.set": set, "builtins.frozenset": frozenset, "builtins.complex": complex,
                  "builtins.slice": slice})
    for d in _TORCH_DTYPES:
        value = getattr(torch, d, None)
        if isinstance(value, torch.dtype):
            table[f"torch.{d}"] = value
    table.update(_numpy_table())
    return table


def dcp_metadata_loads(data: bytes) -> Any:
    """Unpickle a DCP ``.metadata`` file through the DCP allowlist. Call :func:`scan` first for a report.

    Raises :class:`UnsafeGlobalError` for anything outside the allowlist, :class:`PickleLimitError` past a
    limit, ``pickle.UnpicklingError`` or ``ValueError``/``EOFError``/``TypeError`` for malformed data.
    """
    import pathlib

    import torch
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.serialization

    table = base_table()
    classes: list[type] = [collections.OrderedDict, dcp_fs._StorageInfo]
    for name in DCP_METADATA_GLOBALS:
        module, _, attr = name.rpartition(".")
        if module == "torch.distributed.checkpoint.metadata":
            table[name] = getattr(dcp_md, attr)
            if attr != "_MEM_FORMAT_ENCODING":
                classes.append(getattr(dcp_md, attr))
    table["torch.distributed.checkpoint.filesystem._StorageInfo"] = dcp_fs._StorageInfo
    table["torch.serialization._get_layout"] = torch.serialization._get_layout
    table["torch.Size"] = torch.Size
    table["pathlib.PosixPath"] = pathlib.PurePosixPath
    table["pathlib.PurePosixPath"] = pathlib.PurePosixPath
    table["pathlib.PureWindowsPath"] = pathlib.PureWindowsPath
    # Only the names the DCP allowlist admits: drop numpy, devices and the like from the base table.
    table = {k: v for k, v in table.items() if k in DCP_METADATA_GLOBALS}
    md = RestrictedUnpickler(io.BytesIO(data), table, build_types=classes).load()
    problem = check_tree(md)
    if problem is not None:
        raise PickleLimitError(problem)
    return md


_LEAF_TYPES = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None)})


def _children(value: Any) -> list[Any] | tuple[Any, ...] | None:
    """The sub-objects of a container (dataclass instances, such as DCP metadata, through their fields)."""
    if type(value) in _LEAF_TYPES:
        return None
    if isinstance(value, Opaque):
        return [value.args, value.state]
    if isinstance(value, dict):
        return [x for kv in value.items() for x in kv]
    if isinstance(value, list | tuple):
        return value
    if isinstance(value, set | frozenset):
        return list(value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return list(vars(value).values())
    return None


def check_tree(obj: Any, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> str | None:
    """Why a loaded object tree is unsafe to walk recursively, or ``None``: cyclic, nested deeper than
    ``max_depth``, or more than ``max_nodes`` nodes once shared sub-trees are expanded (a pickle can share one
    list a billion times through its memo). Iterative; costs one visit per distinct object, not per path."""
    too_many = f"the loaded object tree has more than {max_nodes} nodes (shared sub-trees counted each time)"
    too_deep = f"the loaded object tree nests deeper than {max_depth} levels"
    root = _children(obj)
    if root is None:
        return None
    done: dict[int, tuple[int, int]] = {}  # id -> (nodes of the expanded sub-tree, height), once visited
    pending: dict[int, tuple[int, int, list[Any]]] = {}  # id -> (own nodes, own height, container children)
    on_path: set[int] = set()
    seen = 0
    todo: list[tuple[Any, Any, bool]] = [(obj, root, False)]
    while todo:
        node, children, finished = todo.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            n, h, containers = pending.pop(key)
            for c in containers:
                cn, ch = done[id(c)]
                n, h = n + cn, max(h, ch + 1)
            done[key] = (n, h)
            if n > max_nodes:
                return too_many
            if h > max_depth:
                return too_deep
            continue
        if key in done:  # a shared sub-tree, already measured
            continue
        if key in on_path:
            return "the loaded object tree contains itself (a cycle)"
        if len(on_path) >= max_depth:
            return too_deep
        seen += len(children) + 1
        if seen > max_nodes:
            return too_many
        on_path.add(key)
        todo.append((node, None, True))
        n, h, containers = 1, 1, []
        for c in children:
            if type(c) in _LEAF_TYPES:
                n += 1
                continue
            if id(c) in done:
                containers.append(c)
                continue
            grand = _children(c)
            if grand is None:
                n += 1
            elif not grand:  # an empty container: counted here, no bookkeeping
                n, h = n + 1, max(h, 2)
            else:
                containers.append(c)
                todo.append((c, grand, False))
        pending[key] = (n, h, containers)
    return None
