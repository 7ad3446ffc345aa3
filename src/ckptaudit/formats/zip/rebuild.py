"""The tensor side of the restricted unpickler of ``data.pkl``: storages and tensor rebuilds, torch-free.

:func:`ckptaudit.formats.zip.archive.read_torch_zip` unpickles a scanned ``data.pkl`` with
:class:`~ckptaudit.formats.pickle.unpickler.RestrictedUnpickler` and the table :func:`torch_table` gives: each storage
reference becomes a :class:`StorageRef` (located and checked inside the archive by the caller's
``persistent_load``), each tensor rebuild a :class:`~ckptaudit.formats.io.tensors.TensorData` whose view is checked
against its storage and charged to a :class:`ViewBudget`, so overlapping views cannot turn a small archive into an
endless scan. Nothing here imports torch.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats.io.tensors import DTYPES, DType, Piece, TensorData
from ckptaudit.formats.pickle.scan import PickleLimitError
from ckptaudit.formats.pickle.unpickler import base_table

__all__ = ["VIEW_BUDGET_FACTOR", "StorageRef", "StorageType", "ViewBudget", "torch_table"]

VIEW_BUDGET_FACTOR = 4
"""The tensors of one archive may address at most this many times the archive's bytes (plus 64 MiB): tied
weights share a storage, but no real checkpoint views the same bytes more than a few times."""


class StorageType:
    """What ``torch.<dtype>Storage`` (and the untyped storages) stand for in the table: the element dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:  # error messages quote storage references: no memory addresses in them
        return f"<{self.dtype.name} storage type>"


@dataclass(frozen=True, slots=True)
class StorageRef:
    """One storage of the archive, located: element dtype, absolute data offset, elements."""

    dtype: DType
    data_offset: int
    numel: int


_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


class ViewBudget:
    """Bytes the tensors of one archive may address in total (see :data:`VIEW_BUDGET_FACTOR`)."""

    def __init__(self, archive_bytes: int) -> None:
        self.left = VIEW_BUDGET_FACTOR * archive_bytes + (64 << 20)

    def rebuild_tensor(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> TensorData:
        if not isinstance(storage, StorageRef):
            raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
        if not isinstance(size, tuple | list) or not isinstance(stride, tuple | list) or len(size) > 64:
            raise pickle.UnpicklingError(f"bad tensor view: size={size!r} stride={stride!r}")
        ints = [storage_offset, *size, *stride]
        if not all(type(v) is int and v >= 0 for v in ints) or len(size) != len(stride):
            raise pickle.UnpicklingError(f"bad tensor view: offset={storage_offset} size={size} stride={stride}")
        size_t, stride_t = tuple(size), tuple(stride)
        numel = math.prod(size_t)
        if numel:
            last = storage_offset + sum((s - 1) * st for s, st in zip(size_t, stride_t, strict=True))
            if last >= storage.numel:
                raise pickle.UnpicklingError(
                    f"tensor view of shape {list(size_t)} reaches element {last}, its storage has {storage.numel}"
                )
        self.left -= numel * storage.dtype.itemsize
        if self.left < 0:
            raise PickleLimitError(
                f"the archive's tensors address more than {VIEW_BUDGET_FACTOR}x its bytes (overlapping views of "
                f"the same storage, e.g. a tensor of shape {list(size_t)} with strides {list(stride_t)})"
            )
        piece = Piece(
            file="",
            data_offset=storage.data_offset,
            storage_offset=int(storage_offset),
            sizes=size_t,
            stride=stride_t,
            offsets=(0,) * len(size_t),
        )
        return TensorData(storage.dtype, size_t, (piece,))


def _rebuild_parameter(data: Any, requires_grad: Any = False, hooks: Any = None, state: Any = None) -> Any:
    return data


class _TensorType:
    __slots__ = ()


def _rebuild_from_type(budget: ViewBudget) -> Any:
    def rebuild(func: Any, new_type: Any, args: Any, state: Any) -> Any:
        if new_type is not _TensorType or func != budget.rebuild_tensor or not isinstance(args, tuple):
            raise pickle.UnpicklingError("only plain tensors and parameters may be rebuilt")
        return func(*args)

    return rebuild


def torch_table(budget: ViewBudget) -> dict[str, Any]:
    table = base_table()
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
        table[f"torch._utils.{name}"] = budget.rebuild_tensor
    table["torch._utils._rebuild_parameter"] = _rebuild_parameter
    table["torch._utils._rebuild_parameter_with_state"] = _rebuild_parameter
    table["torch._utils._rebuild_from_type_v2"] = table["torch._tensor._rebuild_from_type_v2"] = (
        _rebuild_from_type(budget)
    )
    table["torch.Tensor"] = _TensorType
    table["torch.nn.parameter.Parameter"] = _TensorType
    for storage_name, dtype_name in _STORAGE_DTYPES.items():
        table[f"torch.{storage_name}"] = StorageType(DTYPES[dtype_name])
    table["torch.storage.UntypedStorage"] = StorageType(DTYPES["uint8"])
    table["torch.storage.TypedStorage"] = StorageType(DTYPES["uint8"])
    return table
