"""DCP ``.metadata``, read as plain data: one view that every check and every loader share.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``. It is never unpickled into
torch's classes. The restricted unpickler builds torch-free stand-ins (:class:`~ckptaudit.formats.pickle.unpickler.
PickledRecord`: declared fields only, no ``__dict__``, built once), and :func:`load_dcp_metadata` rebuilds from
them, walking the data itself (``dict.items(d)``, never a method the pickle could have shadowed), a
:class:`DcpMetadata` of frozen, slotted records holding only ``str``, ``int``, ``bool`` and tuples of them.

Everything downstream reads that record: the audit (:func:`ckptaudit.formats.dcp.reader.read_dcp`), the guard
(:func:`ckptaudit.formats.dcp.reader.check_metadata_safe`) and the live loader
(:func:`ckptaudit.formats.torchload.vetted_dcp_load`), which converts it to torch's classes and hands them to
``torch.distributed.checkpoint.load`` instead of letting torch unpickle the file. So what is loaded is exactly
what was vetted. This module imports nothing of torch.
"""

from __future__ import annotations

import collections
import io
import pickle
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptaudit.findings import safe_repr
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS, TORCH_DTYPES
from ckptaudit.formats.pickle.object_tree import check_tree
from ckptaudit.formats.pickle.scan import (
    CALL_BUDGET_FACTOR,
    MAX_NODES,
    PickleLimitError,
    PickleScan,
    UnsafeGlobalError,
)
from ckptaudit.formats.pickle.unpickler import PickledRecord, RestrictedUnpickler

__all__ = [
    "BytesMeta",
    "ChunkMeta",
    "DcpMetadata",
    "IndexKey",
    "MalformedMeta",
    "StorageInfo",
    "StorageMetaInfo",
    "TensorMeta",
    "TensorProps",
    "dcp_metadata_loads",
    "load_dcp_metadata",
]

MAX_RANK = 64
"""Most dimensions of a tensor in the metadata."""
MAX_PATH = 32
"""Longest key path of ``planner_data`` (real ones: under 10)."""
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")
"""``_MEM_FORMAT_ENCODING`` values 0, 1, 2, by torch's name."""
LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn",
                     "jagged"})
_DTYPE_ALIASES = {"double": "float64", "float": "float32", "half": "float16", "long": "int64", "int": "int32",
                  "short": "int16"}


# --------------------------------------------------------------------------------------------------------------
# What the restricted unpickler builds: stand-ins for torch's classes, named as the pickle names them


class _Metadata(PickledRecord):
    # all_local_plans: Megatron-Core's torch_dist save keeps every rank's SavePlan there (an instance attribute
    # of torch's Metadata); unpickled into the stand-ins below and not read further.
    __slots__ = FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version",
                          "all_local_plans")


class _TensorStorageMetadata(PickledRecord):
    __slots__ = FIELDS = ("properties", "size", "chunks")


class _BytesStorageMetadata(PickledRecord):
    __slots__ = FIELDS = ()


class _ChunkStorageMetadata(PickledRecord):
    __slots__ = FIELDS = ("offsets", "sizes")


class _StorageMeta(PickledRecord):
    __slots__ = FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class _MetadataIndex(PickledRecord):
    __slots__ = FIELDS = ("fqn", "offset", "index")


class _StorageInfo(PickledRecord):
    __slots__ = FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


class _SavePlan(PickledRecord):
    __slots__ = FIELDS = ("items", "storage_data", "planner_data", "usable")


class _WriteItem(PickledRecord):
    __slots__ = FIELDS = ("index", "type", "bytes_io_data", "tensor_data")


class _TensorWriteData(PickledRecord):
    __slots__ = FIELDS = ("chunk", "properties", "size")


class _BytesIOWriteData(PickledRecord):
    __slots__ = FIELDS = ("nbytes",)


class _StoragePrefix(PickledRecord):
    __slots__ = FIELDS = ("prefix",)


class _TensorProperties(PickledRecord):
    """Pickled as a 5-tuple ``(dtype, layout, requires_grad, memory format encoding, pin_memory)``."""

    __slots__ = FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        if type(state) is not tuple or len(state) != 5:
            raise pickle.UnpicklingError("TensorProperties state is not (dtype, layout, requires_grad, "
                                         "memory_format, pin_memory)")
        for name, value in zip(self.FIELDS, state, strict=True):
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class _TorchName:
    """``torch.float32``, ``torch.strided``: a torch constant, by name."""

    name: str


@dataclass(frozen=True, slots=True)
class _MemFormat:
    value: int


@dataclass(frozen=True, slots=True)
class _WriteItemType:
    """``WriteItemType(value)``: the enum member, by its value (``auto()``: 1 tensor, 2 shard, 3 bytes-io)."""

    value: int


def _write_item_type(value: Any) -> _WriteItemType:
    if type(value) is not int or not 1 <= value <= 3:
        raise pickle.UnpicklingError(f"WriteItemType value {value!r} is not 1, 2 or 3")
    return _WriteItemType(value)


def _size(values: Any = ()) -> tuple[int, ...]:
    if type(values) not in (list, tuple) or len(values) > MAX_RANK:
        raise pickle.UnpicklingError(f"torch.Size of {type(values).__name__}, not a short list of sizes")
    for v in values:
        if type(v) is not int or v < 0:
            raise pickle.UnpicklingError("torch.Size with entries that are not non-negative integers")
    return tuple(values)


def _layout(name: Any) -> _TorchName:
    if type(name) is not str or not name.startswith("torch.") or name[6:] not in LAYOUTS:
        raise pickle.UnpicklingError(f"layout {name!r} is not a torch layout")
    return _TorchName(name[6:])


def _mem_format(value: Any) -> _MemFormat:
    if type(value) is not int or not 0 <= value < len(MEMORY_FORMATS):
        raise pickle.UnpicklingError(f"memory format encoding {value!r} is not 0, 1 or 2")
    return _MemFormat(value)


def _path(*parts: Any) -> str:
    if len(parts) > MAX_PATH * 4 or not all(type(p) is str and len(p) < 4096 for p in parts):
        raise pickle.UnpicklingError("a pathlib path whose parts are not short strings")
    return posixpath.join(*parts) if parts else "."


_STANDINS: dict[str, Any] = {
    "Metadata": _Metadata,
    "TensorStorageMetadata": _TensorStorageMetadata,
    "BytesStorageMetadata": _BytesStorageMetadata,
    "ChunkStorageMetadata": _ChunkStorageMetadata,
    "TensorProperties": _TensorProperties,
    "StorageMeta": _StorageMeta,
    "MetadataIndex": _MetadataIndex,
    "_MEM_FORMAT_ENCODING": _mem_format,
}


def _table() -> dict[str, Any]:
    table: dict[str, Any] = {f"torch.distributed.checkpoint.metadata.{k}": v for k, v in _STANDINS.items()}
    table["torch.distributed.checkpoint.filesystem._StorageInfo"] = _StorageInfo
    table.update({f"torch.distributed.checkpoint.planner.{k}": v for k, v in _PLANNER_STANDINS.items()})
    table["torch.distributed.checkpoint.filesystem._StoragePrefix"] = _StoragePrefix
    table["torch.serialization._get_layout"] = _layout
    table["torch.Size"] = _size
    table["collections.OrderedDict"] = collections.OrderedDict
    for name in ("pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath"):
        table[name] = _path
    for d in TORCH_DTYPES:
        table[f"torch.{d}"] = _TorchName(_DTYPE_ALIASES.get(d, d))
    assert set(table) <= DCP_METADATA_GLOBALS, set(table) - DCP_METADATA_GLOBALS
    return table


_PLANNER_STANDINS: dict[str, Any] = {
    "SavePlan": _SavePlan,
    "WriteItem": _WriteItem,
    "WriteItemType": _write_item_type,
    "TensorWriteData": _TensorWriteData,
    "BytesIOWriteData": _BytesIOWriteData,
}
"""The planner's dataclasses a saver may keep in ``.metadata`` (Megatron-Core's ``all_local_plans``)."""


_RECORD_TYPES: tuple[type, ...] = (*[v for v in (*_STANDINS.values(), *_PLANNER_STANDINS.values())
                                     if isinstance(v, type)], _StorageInfo, _StoragePrefix, collections.OrderedDict)


# --------------------------------------------------------------------------------------------------------------
# What everything else reads: frozen records of plain data


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One shard of a tensor: the block ``offsets[i] : offsets[i] + sizes[i]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorProps:
    dtype: str
    """Torch's name without the prefix (``float32``)."""
    layout: str
    requires_grad: bool
    memory_format: str
    """One of :data:`MEMORY_FORMATS`."""
    pin_memory: bool


@dataclass(frozen=True, slots=True)
class TensorMeta:
    properties: TensorProps
    size: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]


@dataclass(frozen=True, slots=True)
class BytesMeta:
    """A non-tensor item (DCP pickles it with ``torch.save``)."""


@dataclass(frozen=True, slots=True)
class MalformedMeta:
    """An entry of ``state_dict_metadata`` that is neither a well-formed tensor nor a bytes item."""

    reason: str


@dataclass(frozen=True, slots=True)
class IndexKey:
    """Where an item is in ``storage_data``: its key and, for a tensor shard, the shard's offsets."""

    fqn: str
    offset: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where an item's bytes are; ``problem`` says why the entry is malformed (then the rest is empty)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] | None = None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class StorageMetaInfo:
    checkpoint_id: str | None
    save_id: str | None
    load_id: str | None
    modules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    """DCP ``.metadata`` as plain data. The mappings are our own ``dict``s with ``str`` / :class:`IndexKey`
    keys, built here; nothing in them comes from the pickle but values checked field by field."""

    state_dict_metadata: Mapping[str, TensorMeta | BytesMeta | MalformedMeta]
    storage_data: Mapping[IndexKey, StorageInfo]
    planner_data: Mapping[str, tuple[str | int, ...]]
    """Where each key sits in the nested state dict: only paths that agree with their keys (see
    :attr:`planner_problems`); a key without one sits at the top."""
    storage_meta: StorageMetaInfo | None
    version: str | None
    save_plans: int = 0
    """How many ranks' save plans (``SavePlan``) the saver kept in ``.metadata`` (Megatron-Core's ``all_local_plans``); they
    are vetted like the rest and not read further."""
    planner_problems: tuple[str, ...] = ()
    """Where ``planner_data`` disagrees with the keys DCP loads by (:func:`_planner`): each is an
    ``integrity.corrupt`` finding of the audit and a refusal of the live loader; ``planner_data`` is then empty."""


class MetadataShapeError(ValueError):
    """The unpickled metadata is not shaped like ``Metadata`` (the message names the field and the value)."""


def _short(value: Any) -> str:
    return safe_repr(value, 80) if type(value) in (str, int, bool, type(None)) else type(value).__name__


def _sizes(value: Any, what: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or len(value) > MAX_RANK:
        raise MetadataShapeError(f"{what} is {_short(value)}, not a tuple of sizes")
    for v in value:
        if type(v) is not int or v < 0:
            raise MetadataShapeError(f"{what} holds entries that are not non-negative integers")
    return tuple(value)


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise MetadataShapeError(f"{what} is {_short(value)}, not a string")


class _Expansion:
    """What :func:`rebuild` has made so far, shared sub-objects counted every time they are reached (a pickle can
    reference one list of a million chunks from a million entries through its memo): each distinct chunk list
    is converted once, and the expanded count is bounded by :data:`MAX_NODES`, as
    :func:`~ckptaudit.formats.pickle.object_tree.check_tree` bounds it, so every consumer's walk stays bounded."""

    __slots__ = ("chunks", "props", "total")

    def __init__(self) -> None:
        self.chunks: dict[int, tuple[Any, tuple[ChunkMeta, ...]]] = {}
        self.props: dict[tuple[Any, ...], TensorProps] = {}
        self.total = 0

    def charge(self, n: int) -> None:
        self.total += n
        if self.total > MAX_NODES:
            raise PickleLimitError(f"the metadata has more than {MAX_NODES} entries and chunks (shared sub-trees "
                                   "counted each time)")


def _chunks(chunks_raw: list[Any], seen: _Expansion) -> tuple[ChunkMeta, ...]:
    got = seen.chunks.get(id(chunks_raw))
    if got is not None and got[0] is chunks_raw:
        seen.charge(len(got[1]))
        return got[1]
    seen.charge(len(chunks_raw))
    chunks = []
    for c in chunks_raw:
        if type(c) is not _ChunkStorageMetadata:
            raise MetadataShapeError(f"a chunk is {_short(c)}, not ChunkStorageMetadata")
        chunks.append(ChunkMeta(_sizes(getattr(c, "offsets", None), "chunk offsets"),
                                _sizes(getattr(c, "sizes", None), "chunk sizes")))
    out = tuple(chunks)
    seen.chunks[id(chunks_raw)] = (chunks_raw, out)  # the list is kept: its id stays its own
    return out


def _tensor(fqn: str, raw: _TensorStorageMetadata, seen: _Expansion) -> TensorMeta | MalformedMeta:
    try:
        props = getattr(raw, "properties", None)
        if type(props) is not _TensorProperties:
            raise MetadataShapeError(f"properties is {_short(props)}, not TensorProperties")
        dtype, layout = getattr(props, "dtype", None), getattr(props, "layout", None)
        fmt = getattr(props, "memory_format", None)
        if type(dtype) is not _TorchName or type(layout) is not _TorchName or type(fmt) is not _MemFormat:
            raise MetadataShapeError("properties do not hold a torch dtype, layout and memory format")
        grad, pin = getattr(props, "requires_grad", None), getattr(props, "pin_memory", None)
        if type(grad) is not bool or type(pin) is not bool:
            raise MetadataShapeError("requires_grad / pin_memory are not booleans")
        key = (dtype.name, layout.name, grad, fmt.value, pin)
        tp = seen.props.get(key)
        if tp is None:
            tp = seen.props[key] = TensorProps(dtype.name, layout.name, grad, MEMORY_FORMATS[fmt.value], pin)
        raw_size = getattr(raw, "size", None)
        if type(raw_size) is list:
            # torch compares it with the loading tensor's torch.Size, which never equals a list: dcp.load refuses
            raise MetadataShapeError("size is a list, not torch.Size (torch.distributed.checkpoint.load refuses it)")
        size = _sizes(raw_size, "size")
        chunks_raw = getattr(raw, "chunks", None)
        if type(chunks_raw) is not list:
            raise MetadataShapeError(f"chunks is {_short(chunks_raw)}, not a list")
        return TensorMeta(tp, size, _chunks(chunks_raw, seen))
    except MetadataShapeError as exc:
        return MalformedMeta(f"tensor entry {fqn}: {exc}")


def _storage(raw: Any, seen: _Expansion) -> StorageInfo:
    if type(raw) is not _StorageInfo:
        return StorageInfo("", 0, 0, problem=f"storage entry is {_short(raw)}, not _StorageInfo")
    rel, offset = getattr(raw, "relative_path", None), getattr(raw, "offset", None)
    length = getattr(raw, "length", None)
    if type(rel) is not str:
        return StorageInfo("", 0, 0, problem=f"data file {_short(rel)} is not a path")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return StorageInfo("", 0, 0, problem=f"bad offset/length {_short(offset)}/{_short(length)}")
    transforms = getattr(raw, "transform_descriptors", None)
    if transforms is not None:
        seen.charge(len(transforms) if type(transforms) in (list, tuple) else 1)
        if type(transforms) not in (list, tuple) or not all(type(t) is str for t in transforms):
            return StorageInfo("", 0, 0, problem="transform descriptors are not a list of names")
        transforms = tuple(transforms)
    return StorageInfo(rel, offset, length, transforms)


def _storage_meta(raw: Any) -> StorageMetaInfo | None:
    if raw is None:
        return None
    if type(raw) is not _StorageMeta:
        raise MetadataShapeError(f"storage_meta is {_short(raw)}, not StorageMeta")
    modules = raw.get("modules") or []
    if type(modules) is not list or not all(type(m) is str for m in modules):
        raise MetadataShapeError("storage_meta.modules is not a list of names")
    return StorageMetaInfo(_opt_str(raw.get("checkpoint_id"), "storage_meta.checkpoint_id"),
                           _opt_str(raw.get("save_id"), "storage_meta.save_id"),
                           _opt_str(raw.get("load_id"), "storage_meta.load_id"), tuple(modules))


MAX_PLANNER_PROBLEMS = 20
"""Disagreements of ``planner_data`` named one by one; the rest are counted."""


class _Node:
    """A node of the key-path trie :func:`_planner` checks paths with."""

    __slots__ = ("children", "kind", "leaf")

    def __init__(self) -> None:
        self.children: dict[str | int, _Node] = {}
        self.kind: type | None = None  # str (a mapping's names) or int (a list's indices), never both
        self.leaf: str | None = None  # the key whose path ends here


MAX_LIST_INDEX = 1 << 31
"""Largest list index a key path may hold (no saved list is longer; ``str()`` of it is short)."""


def _path_problem(key: str, path: Any) -> str | None:
    """Why ``path`` is not a key path torch's flattening (``_nested_dict.flatten_state_dict``) could have written
    for ``key``: a tuple whose first element is a name (``str(k)`` of a top-level key), the rest names (mapping
    keys, ``str(k)``) or list indices (``0 <= i <`` :data:`MAX_LIST_INDEX`), joined by dots back to ``key``
    exactly (``".".join(map(str, path))``); ``None`` when it is one."""
    if type(path) not in (tuple, list) or not 0 < len(path) <= MAX_PATH:
        return f"is {_short(path) if type(path) is not tuple else 'a tuple of ' + str(len(path))}, not a key path"
    if type(path[0]) is not str:
        return f"starts with {_short(path[0])}: torch's flattening starts every path with a name"
    length = len(path) - 1
    for p in path:
        if type(p) is str:
            length += len(p)
        elif type(p) is int and 0 <= p < MAX_LIST_INDEX:
            length += len(str(p))  # bounded: a short number
        else:
            return f"holds {_short(p)}, neither a name nor a list index below 2**31"
    if length != len(key) or ".".join(p if type(p) is str else str(p) for p in path) != key:
        return f"is {safe_repr(tuple(path), 200)}, which joins to another key than {_short(key)}"
    return None


def _planner(raw: Any, keys: Mapping[str, Any]) -> tuple[dict[str, tuple[str | int, ...]], tuple[str, ...]]:
    """The key paths of ``planner_data`` that agree with the keys they are filed under, and the disagreements.

    DCP loads every item by its flattened key (``state_dict_metadata``'s and ``storage_data``'s ``fqn``: what
    ``dcp.load`` and ``FileSystemReader`` look up); ``planner_data`` only says where a key sits in the nested
    dict. A path is accepted only where it agrees with its key (:func:`_path_problem`); the accepted paths of all
    keys (a key without one sits at the top, ``(key,)``) must place no two keys at one path, no key inside
    another's value and no list index beside a name. Anything else is a disagreement: then no path is used (every
    key at the top), so no item can stand in another's place."""
    if raw is None:
        return {}, ()
    if type(raw) is not dict:
        return {}, (f"planner_data is {_short(raw)}, not a mapping of keys to key paths",)
    problems: list[str] = []
    extra = 0

    def problem(text: str) -> None:
        nonlocal extra
        if len(problems) < MAX_PLANNER_PROBLEMS:
            problems.append(text)
        else:
            extra += 1

    accepted: dict[str, tuple[str | int, ...]] = {}
    for key, path in dict.items(raw):
        if type(key) is not str:
            problem(f"planner_data files a path under {_short(key)}, which is not a key")
            continue
        if key not in keys:
            continue  # no item is loaded by it: neither reading uses it
        why = _path_problem(key, path)
        if why is not None:
            problem(f"planner_data's path of {_short(key)} {why}")
            continue
        accepted[key] = tuple(path)
    root = _Node()
    for key in keys:
        path = accepted.get(key, (key,))
        node = root
        clash: str | None = None
        for depth, p in enumerate(path):
            if node.leaf is not None:
                clash = f"inside the value of {_short(node.leaf)}"
                break
            kind = type(p)
            if node.kind is not None and node.kind is not kind:
                clash = (f"where a list index and a name sit side by side (at "
                         f"{safe_repr(tuple(path[:depth + 1]), 200)})")
                break
            node.kind = kind
            child = node.children.get(p)
            if child is None:
                child = node.children[p] = _Node()
            node = child
        else:
            if node.leaf is not None:
                clash = f"at the path of {_short(node.leaf)}"
            elif node.children:
                clash = "where other keys' values sit inside it"
            else:
                node.leaf = key
        if clash is not None:
            problem(f"planner_data puts {_short(key)} at {safe_repr(path, 200)}, {clash}")
    if extra:
        problems.append(f"... and {extra} more disagreements of planner_data")
    return ({} if problems else accepted), tuple(problems)


def rebuild(raw: Any) -> DcpMetadata:
    """The plain-data :class:`DcpMetadata` of what the restricted unpickler built; raises
    :class:`MetadataShapeError` for anything not shaped like ``Metadata``."""
    if type(raw) is not _Metadata:
        raise MetadataShapeError(f"the pickle holds {_short(raw)}, not Metadata")
    sd_raw, st_raw = raw.get("state_dict_metadata"), raw.get("storage_data")
    if not isinstance(sd_raw, dict) or not isinstance(st_raw, dict):
        raise MetadataShapeError("state_dict_metadata or storage_data is not a dict")
    seen = _Expansion()
    seen.charge(len(sd_raw) + len(st_raw))
    sd: dict[str, TensorMeta | BytesMeta | MalformedMeta] = {}
    for fqn, item in dict.items(sd_raw):
        if type(fqn) is not str:
            raise MetadataShapeError(f"state_dict_metadata has a key {_short(fqn)} that is not a name")
        if type(item) is _TensorStorageMetadata:
            sd[fqn] = _tensor(fqn, item, seen)
        elif type(item) is _BytesStorageMetadata:
            sd[fqn] = BytesMeta()
        else:
            sd[fqn] = MalformedMeta(f"entry {fqn} is {_short(item)}, neither tensor nor bytes metadata")
    storage: dict[IndexKey, StorageInfo] = {}
    for index, info in dict.items(st_raw):
        fqn = getattr(index, "fqn", None) if type(index) is _MetadataIndex else None
        if type(fqn) is not str:
            raise MetadataShapeError(f"storage_data has a key {_short(index)} that is not a MetadataIndex")
        offset = getattr(index, "offset", None)
        if type(offset) is list:  # torch cannot even hash that key: its unpickling of .metadata fails
            raise MetadataShapeError(f"storage_data has a key of {_short(fqn)} whose offset is a list, not torch.Size")
        key = IndexKey(fqn, None if offset is None else _sizes(offset, "MetadataIndex.offset"))
        before = len(storage)
        storage[key] = _storage(info, seen)  # hashed once (thousands of entries); a repeat leaves the size as it was
        if len(storage) == before:
            raise MetadataShapeError(f"storage_data lists item {key.fqn} at offsets {key.offset} twice")
    version = raw.get("version")
    plans = raw.get("all_local_plans")
    save_plans = (sum(1 for p in plans if type(p) is _SavePlan) if type(plans) is list else 0)
    planner, planner_problems = _planner(raw.get("planner_data"), sd)
    return DcpMetadata(sd, storage, planner, _storage_meta(raw.get("storage_meta")), _opt_str(version, "version"),
                       save_plans, planner_problems)


_SIZED = frozenset({str, bytes, tuple, list, dict})


class _Charged:
    """A function of the table as the C unpickler calls it (``REDUCE``): every call is charged against the
    load's call budget, as :class:`~ckptaudit.formats.pickle.unpickler.RestrictedUnpickler` charges its calls (so a
    small pickle cannot make huge strings by joining one shared path a million times)."""

    __slots__ = ("_fn", "_left")

    def __init__(self, fn: Any, left: list[int]) -> None:
        self._fn, self._left = fn, left

    def __call__(self, *args: Any) -> Any:
        cost = len(args)
        for a in args:
            cost += len(a) if type(a) in _SIZED else 1
        self._left[0] -= cost
        if self._left[0] < 0:
            raise PickleLimitError("the pickle's calls build more than the budget allows (a copy amplification)")
        return self._fn(*args)


class _PlainLoader(pickle.Unpickler):
    """The C unpickler, resolving globals only through the fast table (:func:`_fast_table`). Used only on a
    pickle the scan proved plain (:attr:`~ckptaudit.formats.pickle.scan.PickleScan.plain`)."""

    def __init__(self, data: bytes, table: dict[str, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._table = table

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"  # a plain pickle is protocol 3 or later: no Python 2 renaming
        try:
            return self._table[key]
        except KeyError:
            raise UnsafeGlobalError(key) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def _fast_table(size: int) -> dict[str, Any]:
    """The DCP table for :class:`_PlainLoader`: its functions charged (:class:`_Charged`), and no
    ``OrderedDict`` (its items are not the scan's vetted keys; a pickle naming it takes the reference load)."""
    left = [CALL_BUDGET_FACTOR * size + (16 << 20)]
    table = _table()
    del table["collections.OrderedDict"]
    return {k: _Charged(v, left) if callable(v) and not isinstance(v, type) else v for k, v in table.items()}


def load_dcp_metadata(data: bytes, scanned: PickleScan | None = None) -> DcpMetadata:
    """Unpickle a DCP ``.metadata`` file through the DCP allowlist into torch-free stand-ins and rebuild it as
    plain data. Call :func:`~ckptaudit.formats.pickle.scan.scan` first for a report, and pass its result as
    ``scanned``: when the scan proved the pickle plain (:attr:`~ckptaudit.formats.pickle.scan.PickleScan.plain`,
    true of what ``torch.distributed.checkpoint`` writes), the C unpickler loads it with the same table, about
    ten times faster than the pure-Python restricted unpickler; whatever that fast load refuses, the restricted
    unpickler loads again and decides, so both paths give the same result and the same errors (but for values
    nested past ``MAX_DEPTH`` or cyclic in fields the rebuild never reads: only the restricted path's tree
    check refuses those; see docs/security.md).

    Raises :class:`~ckptaudit.formats.pickle.scan.UnsafeGlobalError` for anything outside the allowlist,
    :class:`PickleLimitError` past a limit, :class:`MetadataShapeError` for metadata of the wrong shape, and
    ``pickle.UnpicklingError`` or ``ValueError``/``EOFError``/``TypeError`` for malformed data.
    """
    if scanned is not None and scanned.plain and scanned.loadable:
        try:
            # No check_tree here: rebuild reads fixed fields, never recursively, each distinct list once, and
            # bounds what it makes (_Expansion); nothing else ever sees this tree.
            return rebuild(_PlainLoader(data, _fast_table(len(data))).load())
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001, S110 - the reference load below decides, and says why
            pass
    raw = RestrictedUnpickler(io.BytesIO(data), _table(), build_types=_RECORD_TYPES).load()
    problem = check_tree(raw)
    if problem is not None:
        raise PickleLimitError(problem)
    return rebuild(raw)


dcp_metadata_loads = load_dcp_metadata
"""The name earlier versions used."""
