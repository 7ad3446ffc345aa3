"""``torch.save`` zip archives, read without ``torch.load``: the object tree with lazy tensors.

A ``torch.save`` file is a zip of ``<name>/data.pkl`` (the object tree, a pickle) and one stored
(uncompressed) member ``<name>/data/<key>`` per storage. Every item of a ``.distcp`` file of
``torch.distributed.checkpoint`` is the same kind of archive, at an offset inside the file, so this reader
works on a byte region of a file.

The pickle is scanned first (:func:`ckptaudit.formats.pickles.scan`); only a pickle whose every global is
allowed is unpickled, through a restricted unpickler that turns each tensor into a :class:`TensorData`
pointing into the file. Storage sizes and tensor views are checked against the archive before anything is
described, so a hostile header cannot make us allocate or read past the file.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats.pickles import PickleScan, RestrictedUnpickler, base_table, scan
from ckptaudit.formats.tensors import DTYPES, DType, Piece, TensorData

__all__ = ["TorchZip", "TorchZipError", "is_zip", "read_torch_zip"]

MAX_PICKLE_BYTES = 512 << 20
"""A ``data.pkl`` larger than this is refused: object trees of real checkpoints are far smaller."""


class TorchZipError(Exception):
    """The archive is not a readable ``torch.save`` zip; ``offset`` is the absolute byte offset if known."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True, slots=True)
class TorchZip:
    """One archive: its pickle scan and, when the scan allowed loading, the object tree."""

    scan: PickleScan
    obj: Any
    """The unpickled tree (dicts, lists, numbers, strings, :class:`TensorData` leaves); ``None`` if not loaded."""
    loaded: bool


class _Region(io.RawIOBase):
    """A read-only, seekable view of ``[start, start+length)`` of an open file."""

    def __init__(self, fh: io.BufferedReader, start: int, length: int) -> None:
        self._fh, self._start, self._len, self._pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def is_zip(path: str, offset: int = 0) -> bool:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(4) == b"PK\x03\x04"


class _StorageType:
    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


@dataclass(frozen=True, slots=True)
class _StorageRef:
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


def _rebuild_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any
) -> TensorData:
    if not isinstance(storage, _StorageRef):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    ints = [storage_offset, *size, *stride]
    if not all(isinstance(v, int) and v >= 0 for v in ints) or len(size) != len(stride):
        raise pickle.UnpicklingError(f"bad tensor view: offset={storage_offset} size={size} stride={stride}")
    size_t, stride_t = tuple(size), tuple(stride)
    numel = 1
    for s in size_t:
        numel *= s
    if numel:
        last = storage_offset + sum((s - 1) * st for s, st in zip(size_t, stride_t, strict=True))
        if last >= storage.numel:
            raise pickle.UnpicklingError(
                f"tensor view of shape {list(size_t)} reaches element {last}, its storage has {storage.numel}"
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
    pass


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _TensorType or func is not _rebuild_tensor:
        raise pickle.UnpicklingError("only plain tensors and parameters may be rebuilt")
    return func(*args)


def _torch_table() -> dict[str, Any]:
    table = base_table()
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
        table[f"torch._utils.{name}"] = _rebuild_tensor
    table["torch._utils._rebuild_parameter"] = _rebuild_parameter
    table["torch._utils._rebuild_parameter_with_state"] = _rebuild_parameter
    table["torch._utils._rebuild_from_type_v2"] = _rebuild_from_type
    table["torch._tensor._rebuild_from_type_v2"] = _rebuild_from_type
    table["torch.Tensor"] = _TensorType
    table["torch.nn.parameter.Parameter"] = _TensorType
    for storage_name, dtype_name in _STORAGE_DTYPES.items():
        table[f"torch.{storage_name}"] = _StorageType(DTYPES[dtype_name])
    table["torch.storage.UntypedStorage"] = _StorageType(DTYPES["uint8"])
    table["torch.storage.TypedStorage"] = _StorageType(DTYPES["uint8"])
    return table


_SCAN_CACHE: dict[bytes, PickleScan] = {}


def _scan_cached(data: bytes) -> PickleScan:
    """:func:`scan`, memoised on the pickle's bytes: every DCP item of a given shape carries the same small
    ``data.pkl``, and a checkpoint has thousands of items but few distinct shapes."""
    hit = _SCAN_CACHE.get(data)
    if hit is None:
        hit = scan(data)
        if len(data) <= 4096:
            if len(_SCAN_CACHE) >= 4096:
                _SCAN_CACHE.clear()
            _SCAN_CACHE[data] = hit
    return hit


def _local_data_offset(fh: Any, region_start: int, info: zipfile.ZipInfo) -> int:
    """Absolute offset of a stored member's data (after its local header)."""
    header_at = region_start + info.header_offset
    fh.seek(header_at)
    header = fh.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise TorchZipError(f"bad local header for {info.filename}", header_at)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return header_at + 30 + name_len + extra_len


def read_torch_zip(path: str, offset: int = 0, length: int | None = None, *, load: bool = True) -> TorchZip:
    """Read the ``torch.save`` archive stored at ``[offset, offset+length)`` of ``path``.

    Raises :class:`TorchZipError` for anything malformed: not a zip, no ``data.pkl``, compressed storages,
    big-endian data, storages or views larger than the archive, a truncated pickle.
    """
    file_size = os.path.getsize(path)
    if length is None:
        length = file_size - offset
    if offset < 0 or length < 0 or offset + length > file_size:
        raise TorchZipError(
            f"archive at offset {offset} with length {length} exceeds the file ({file_size} bytes)", offset
        )
    with open(path, "rb") as raw:
        fh = io.BufferedReader(raw)  # type: ignore[arg-type]
        try:
            zf = zipfile.ZipFile(_Region(fh, offset, length))  # type: ignore[arg-type]
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise TorchZipError(f"not a readable zip archive ({exc})", offset) from None
        with zf:
            infos = zf.infolist()
            pkl = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") <= 1]
            if not pkl:
                raise TorchZipError("zip archive without data.pkl: not a torch.save file", offset)
            prefix = pkl[0].filename[: -len("data.pkl")]
            by_name = {i.filename: i for i in infos}
            bo = by_name.get(prefix + "byteorder")
            if bo is not None and bo.file_size < 16:
                try:
                    order = zf.read(bo).decode("ascii", "replace").strip()
                except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                    raise TorchZipError(f"cannot read byteorder ({exc})", offset) from None
                if order != "little":
                    raise TorchZipError(f"byte order {order!r} is not supported (only little-endian)", offset)
            if pkl[0].file_size > MAX_PICKLE_BYTES:
                raise TorchZipError(f"data.pkl declares {pkl[0].file_size} bytes; refusing", offset)
            try:
                data = zf.read(pkl[0])
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
                raise TorchZipError(f"cannot read data.pkl ({exc})", offset) from None
            result = _scan_cached(data)
            if result.error is not None:
                raise TorchZipError(f"data.pkl: {result.error}", offset)
            if not load or not result.loadable:
                return TorchZip(result, None, False)

            def persistent_load(pid: Any) -> Any:
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                    raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
                _, stype, key, _location, numel = pid
                if not isinstance(stype, _StorageType) or not isinstance(numel, int) or numel < 0:
                    raise pickle.UnpicklingError(f"bad storage reference {pid!r}")
                info = by_name.get(f"{prefix}data/{key}")
                if info is None:
                    raise pickle.UnpicklingError(f"storage {key!r} is missing from the archive")
                if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                    raise pickle.UnpicklingError(f"storage {key!r} is compressed; torch.save never does that")
                if numel * stype.dtype.itemsize > info.file_size:
                    raise pickle.UnpicklingError(
                        f"storage {key!r} declares {numel} {stype.dtype.name} elements, "
                        f"the archive holds {info.file_size} bytes"
                    )
                start = _local_data_offset(fh, offset, info)
                if start + numel * stype.dtype.itemsize > offset + length:
                    raise pickle.UnpicklingError(f"storage {key!r} runs past the end of the archive")
                return _StorageRef(stype.dtype, start, numel)

            try:
                obj = RestrictedUnpickler(io.BytesIO(data), _torch_table(), persistent_load).load()
            except TorchZipError:
                raise
            except Exception as exc:  # noqa: BLE001 - anything the pickle does wrong is a corrupt archive
                raise TorchZipError(f"data.pkl: {exc}", offset) from None
    return TorchZip(result, _bind_file(obj, os.path.abspath(path)), True)


def _bind_file(obj: Any, path: str) -> Any:
    """Fill in the file of every tensor piece (the unpickler does not know it)."""
    if isinstance(obj, TensorData):
        return TensorData(obj.dtype, obj.shape, tuple(_with_file(p, path) for p in obj.pieces))
    if isinstance(obj, dict):
        return type(obj)((k, _bind_file(v, path)) for k, v in obj.items()) if type(obj) is not dict else {
            k: _bind_file(v, path) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_bind_file(v, path) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_bind_file(v, path) for v in obj)
    return obj


def _with_file(p: Piece, path: str) -> Piece:
    return Piece(path, p.data_offset, p.storage_offset, p.sizes, p.stride, p.offsets)
