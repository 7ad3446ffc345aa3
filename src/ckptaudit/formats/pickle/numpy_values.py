"""NumPy objects in pickles (RNG states): plain numeric arrays, scalars and dtypes, rebuilt from vetted state.

numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')`` followed by ``BUILD (1, shape, dtype, fortran,
data)``; protocol 5 as ``_frombuffer(bytes, dtype, shape, order)``. Only plain numeric dtypes are accepted (no
object arrays, no structured dtypes), and shapes are checked against the data before anything is built.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

from ckptaudit.formats.pickle.allowlist import NUMPY_DTYPE_CLASSES

__all__ = ["NUMPY_ON_DEMAND", "NdarrayShell", "dtype_from_state", "ndarray_from_state", "numpy_module", "numpy_table"]

NUMPY_ON_DEMAND = "numpy"
"""A key of an unpickler's table that no global resolves to (every resolved name has a dot): its presence says
that :func:`numpy_table`'s entries are added when a pickle first names a NumPy global, so that reading a
checkpoint without NumPy objects does not import NumPy."""


def numpy_module() -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return np




class _NdarrayType:
    """Stands for ``numpy.ndarray`` in a pickle: only ever the first argument of ``_reconstruct``."""

    __slots__ = ()


class NdarrayShell:
    """What ``_reconstruct`` returns: an empty array waiting for its ``BUILD`` state."""

    __slots__ = ()


def _numeric_dtype(dt: Any) -> Any:
    np = numpy_module()
    if not isinstance(dt, np.dtype) or dt.hasobject or dt.kind not in "biufc" or dt.subdtype is not None:
        raise pickle.UnpicklingError(f"numpy dtype {dt!r} is not allowed (only plain numeric dtypes)")
    return dt


def dtype_from_state(dt: Any, state: Any) -> Any:
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


def ndarray_from_state(state: Any) -> Any:
    np = numpy_module()
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


def numpy_table() -> dict[str, Any]:
    np = numpy_module()

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> NdarrayShell:
        # numpy always writes _reconstruct(ndarray, (0,), b'b'): an empty array that BUILD fills.
        if subtype is not _NdarrayType or not isinstance(shape, tuple) or math.prod(
            int(d) if isinstance(d, int) else 1 for d in shape
        ) != 0:
            raise pickle.UnpicklingError("only an empty plain numpy.ndarray may be reconstructed")
        return NdarrayShell()

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
        return ndarray_from_state((1, shape, dtype, order == "F", buf))

    table: dict[str, Any] = {"numpy.ndarray": _NdarrayType, "numpy.dtype": make_dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[f"{mod}._reconstruct"] = reconstruct
        table[f"{mod}.scalar"] = scalar
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        table[f"{mod}._frombuffer"] = frombuffer
    dtypes_mod = getattr(np, "dtypes", None)
    for cls in NUMPY_DTYPE_CLASSES:
        if dtypes_mod is not None and hasattr(dtypes_mod, cls):
            table[f"numpy.dtypes.{cls}"] = getattr(dtypes_mod, cls)
    return table


