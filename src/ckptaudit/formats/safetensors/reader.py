"""safetensors files, parsed directly: an 8-byte header length, a JSON header, then the raw tensor bytes.

Parsing it ourselves (rather than through ``safe_open``) lets the reader check every declared size against
the file before anything is mapped, and hand out the same lazy :class:`TensorData` as the other formats.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Part
from ckptaudit.formats.io.safeio import open_regular
from ckptaudit.formats.io.safejson import loads_limited
from ckptaudit.formats.io.tensors import DTYPES, Piece, TensorData

__all__ = ["SafetensorsError", "SafetensorsFile", "read_safetensors", "read_safetensors_part"]

MAX_HEADER_BYTES = 100_000_000
"""The safetensors specification's own limit on the JSON header."""

_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}


class SafetensorsError(Exception):
    """A malformed safetensors file; ``offset`` is the byte offset of the problem where known."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    tensors: dict[str, TensorData]
    """In the order of their data in the file."""
    metadata: dict[str, str]


def read_safetensors(path: str) -> SafetensorsFile:
    """Describe every tensor of a safetensors file without reading its data.

    Raises :class:`SafetensorsError` when the header is truncated, larger than the specification's limit, not
    a JSON object of the specified shape, declares offsets outside the file, sizes that do not match
    shape x dtype, or overlapping tensors. Every size is checked before anything is read.
    """
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"file has {size} bytes, too short for the 8-byte header length", 0)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"header declares {n} bytes (the format's limit is {MAX_HEADER_BYTES})", 0)
        if 8 + n > size:
            raise SafetensorsError(f"header declares {n} bytes, only {size - 8} follow", 8)
        raw = fh.read(n)
    if len(raw) != n:
        raise SafetensorsError(f"header declares {n} bytes, read {len(raw)}", 8)
    # The safetensors library parses the header as strict UTF-8 JSON (serde_json); Python's json is laxer, and
    # whatever only the laxer reading accepts is refused (read as the library reads it, or not at all).
    if raw.startswith(b"\xef\xbb\xbf"):
        raise SafetensorsError("header starts with a byte-order mark (the safetensors library refuses it)", 8)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"header is not UTF-8 (byte {exc.start}; the safetensors library refuses it)",
                               8 + exc.start) from None
    try:
        header = loads_limited(raw, "header", unique_keys=True, parse_int=_json_int)
    except ValueError as exc:  # not JSON, a key twice, past a limit (depth, containers), digits past Python's limit
        raise SafetensorsError(f"header is not valid JSON ({exc})", 8) from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object", 8)
    bad = _non_utf8_string(header)
    if bad is not None:
        raise SafetensorsError(f"header holds the string {bad!r}, a lone UTF-16 surrogate escape (the safetensors "
                               "library refuses it)", 8)
    data_start = 8 + n
    data_len = size - data_start
    meta_raw = header.pop("__metadata__", None)
    if meta_raw is None:
        meta_raw = {}
    if not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values()):
        raise SafetensorsError("__metadata__ is not an object of strings", 8)
    metadata = dict(meta_raw)
    entries: list[tuple[int, int, str, TensorData]] = []
    for name, spec in header.items():
        entries.append(_entry(path, name, spec, data_start, data_len))
    entries.sort(key=lambda e: (e[0], e[1]))
    prev_end = 0
    for begin, end, name, _ in entries:
        if begin < prev_end:
            raise SafetensorsError(f"tensor {name!r} overlaps the previous tensor", data_start + begin)
        if begin > prev_end:  # the safetensors library refuses such a file (InvalidOffset)
            raise SafetensorsError(f"tensor {name!r} starts at byte {begin} of the data, leaving bytes "
                                   f"{prev_end}..{begin} that no tensor holds (a gap)", data_start + prev_end)
        prev_end = end
    if prev_end != data_len:  # MetadataIncompleteBuffer in the safetensors library
        raise SafetensorsError(f"the tensors end at byte {prev_end} of the data section, which has {data_len} "
                               "bytes (bytes that no tensor holds)", data_start + prev_end)
    return SafetensorsFile({name: td for _, _, name, td in entries}, metadata)


_U64 = (1 << 64) - 1


def _json_int(text: str) -> int | float:
    """JSON integers as serde_json reads them: ``-0`` and other negative literals are not unsigned integers (serde
    reads ``-0`` as a float), so they never pass as a shape or an offset."""
    return float(text) if text.startswith("-") else int(text)


def _non_utf8_string(tree: Any) -> str | None:
    """A key or string of the parsed header that UTF-8 cannot encode (a lone surrogate escape), or ``None``."""
    todo = [tree]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(dict.keys(v))
            todo.extend(dict.values(v))
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v
    return None


def _entry(path: str, name: str, spec: Any, data_start: int, data_len: int) -> tuple[int, int, str, TensorData]:
    if not isinstance(spec, dict):
        raise SafetensorsError(f"entry {name!r} is not an object", 8)
    dtype_name = _DTYPES.get(str(spec.get("dtype")))
    if dtype_name is None:
        raise SafetensorsError(f"tensor {name!r} has unknown dtype {spec.get('dtype')!r}", 8)
    shape = spec.get("shape")
    offsets = spec.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and 0 <= d <= _U64 for d in shape)):
        raise SafetensorsError(f"tensor {name!r} has a bad shape {shape!r}", 8)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and 0 <= o <= _U64
                                                                     for o in offsets)):
        raise SafetensorsError(f"tensor {name!r} has bad data_offsets {offsets!r}", 8)
    begin, end = offsets
    dtype = DTYPES[dtype_name]
    count = 1
    for d in shape:  # the library multiplies left to right in 64 bits and refuses an overflow, even before a 0
        count *= d
        if count > _U64:
            raise SafetensorsError(f"tensor {name!r}: shape {shape} overflows 64 bits (the safetensors library "
                                   "refuses it)", 8)
    if count * dtype.itemsize * 8 > _U64:
        raise SafetensorsError(f"tensor {name!r}: shape {shape} x {dtype_name} overflows 64 bits", 8)
    expected = math.prod(shape) * dtype.itemsize
    if begin < 0 or end < begin or end - begin != expected:
        raise SafetensorsError(
            f"tensor {name!r}: data_offsets {offsets} hold {end - begin} bytes, shape {shape} x {dtype_name} "
            f"needs {expected}",
            8,
        )
    if end > data_len:
        raise SafetensorsError(
            f"tensor {name!r} ends at byte {data_start + end}, the file has {data_start + data_len}",
            data_start + begin,
        )
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    piece = Piece(
        file=os.path.abspath(path),
        data_offset=data_start + begin,
        storage_offset=0,
        sizes=tuple(shape),
        stride=tuple(reversed(strides)),
        offsets=(0,) * len(shape),
    )
    return begin, end, name, TensorData(dtype, tuple(shape), (piece,))


def read_safetensors_part(probe: Any, findings: list[Finding]) -> Part | None:
    """The safetensors reader (:mod:`ckptaudit.formats.contract`): the file as one ``safetensors`` part."""
    try:
        st = read_safetensors(probe.path)
    except SafetensorsError as exc:
        findings.append(
            finding("integrity.corrupt", probe.subject, f"{probe.subject}: not a readable safetensors file: {exc}",
                    offset=exc.offset)
        )
        return None
    return Part(probe.name, "safetensors", dict(st.tensors), metadata=st.metadata, order_known=False)
