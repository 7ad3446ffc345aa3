"""torch's plain values in a ``torch.save`` pickle (dtypes, devices, sizes) as torch-free stand-ins.

``torch.save`` pickles ``torch.bfloat16`` as the global ``torch.bfloat16``, ``torch.device("cuda", 1)`` as a call
of ``torch.device`` and ``torch.Size([2, 3])`` as a call of ``torch.Size``. The restricted unpickler's table
(:func:`ckptaudit.formats.pickle.unpickler.base_table`) maps those names here instead of importing torch, which costs
~200 MiB and seconds of start-up for a 4-element file: the offline paths (``audit``, ``compare``, ``latest``) never
import torch.

Each stand-in holds its declared fields only (``__slots__``, no ``__dict__``, immutable), validates what it is
built from as torch does, stricter where torch is lenient (sizes must be non-negative integers, where torch also
takes negatives and booleans; a device index must be 0-127, where torch silently wraps it into an 8-bit
integer), and reads like the real value: ``repr``, ``str``, ``==`` and ``hash`` as torch's, type names ``dtype``,
``device`` and ``Size``, dtypes compared by identity with ``torch.float`` the same object as ``torch.float32``.
So the records, reports and comparisons are the ones the real objects gave. The live loaders
(:mod:`ckptaudit.formats.torchload`) load with torch itself and never see these.
"""

from __future__ import annotations

import pickle
import re
from typing import Any, ClassVar

from ckptaudit.formats.pickle.allowlist import TORCH_DTYPES

__all__ = ["DEVICE_TYPES", "DTYPE_ALIASES", "MAX_DEVICE_INDEX", "TorchDevice", "TorchDtype", "TorchSize",
           "torch_values_table"]

DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia",
                "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone")
"""The device types ``torch.device`` accepts (torch 2.13, no out-of-tree backend registered)."""
MAX_DEVICE_INDEX = 127
"""torch keeps a device index in 8 signed bits."""
MAX_SIZE_ENTRY = (1 << 63) - 1
"""torch keeps each entry of a ``torch.Size`` in 64 signed bits."""
DTYPE_ALIASES = {"double": "float64", "float": "float32", "half": "float16", "long": "int64", "int": "int32",
                 "short": "int16"}
"""torch's second names for dtypes: ``torch.float is torch.float32``."""

_DEVICE_STRING = re.compile(r"([a-z][a-z0-9_]*)(?::(0|[1-9][0-9]{0,2}))?")


class TorchDtype:
    """``torch.float32`` and the other dtypes: one instance per dtype, compared by identity (as torch's), hashed
    by identity (so it may be a dict key, as torch's); ``str`` and ``repr`` are ``torch.<name>``. Never called."""

    __slots__ = ("name",)
    name: str

    _instances: ClassVar[dict[str, TorchDtype]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> TorchDtype:
        raise TypeError("cannot create 'dtype' instances")

    @classmethod
    def named(cls, name: str) -> TorchDtype:
        """The one stand-in of ``torch.<name>`` (an alias gives its dtype's stand-in)."""
        name = DTYPE_ALIASES.get(name, name)
        if name not in TORCH_DTYPES:
            raise pickle.UnpicklingError(f"torch.{name} is not a dtype")
        hit = cls._instances.get(name)
        if hit is None:
            hit = object.__new__(cls)
            object.__setattr__(hit, "name", name)
            cls._instances[name] = hit
        return hit

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"torch.{self.name} is immutable")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"torch.{self.name} is immutable")

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class TorchDevice:
    """``torch.device(type, index=None)`` or ``torch.device("type:index")``: ``type`` one of
    :data:`DEVICE_TYPES`, ``index`` ``None`` or 0-:data:`MAX_DEVICE_INDEX`. Equal to a device of the same type
    and index; ``str`` is ``cuda:1``, ``repr`` ``device(type='cuda', index=1)``, as torch's."""

    __slots__ = ("index", "type")
    type: str
    index: int | None

    def __new__(cls, type: Any = None, index: Any = None) -> TorchDevice:  # torch.device's keyword names
        if isinstance(type, TorchDevice) and index is None:
            return type
        if type.__class__ is not str:
            raise pickle.UnpicklingError(
                f"torch.device({_short(type)}): the type must be a device name such as 'cpu' or 'cuda' (a bare "
                "index means an accelerator that depends on the machine)")
        m = _DEVICE_STRING.fullmatch(type)
        if m is None or m.group(1) not in DEVICE_TYPES:
            raise pickle.UnpicklingError(
                f"torch.device({_short(type)}): not a device string ('type' or 'type:index', type one of "
                f"{', '.join(DEVICE_TYPES)})")
        if m.group(2) is not None:
            if index is not None:
                raise pickle.UnpicklingError(
                    f"torch.device({type!r}, {_short(index)}): an index both in the string and as an argument")
            index = int(m.group(2))
        if index is not None and (index.__class__ is not int or not 0 <= index <= MAX_DEVICE_INDEX):
            raise pickle.UnpicklingError(
                f"torch.device({type!r}, {_short(index)}): the index must be an integer from 0 to "
                f"{MAX_DEVICE_INDEX}")
        self = object.__new__(cls)
        object.__setattr__(self, "type", m.group(1))
        object.__setattr__(self, "index", index)
        return self

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{self!r} is immutable")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"{self!r} is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TorchDevice):
            return NotImplemented
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __repr__(self) -> str:
        return f"device(type={self.type!r})" if self.index is None else \
            f"device(type={self.type!r}, index={self.index})"

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class TorchSize(tuple[int, ...]):
    """``torch.Size(sizes)``: a tuple of non-negative integers (``==`` and ``hash`` a tuple's, as torch's);
    ``repr`` is ``torch.Size([2, 3])``."""

    __slots__ = ()

    def __new__(cls, sizes: Any = ()) -> TorchSize:
        if sizes.__class__ not in (list, tuple, TorchSize):
            raise pickle.UnpicklingError(f"torch.Size({_short(sizes)}): not a list or tuple of sizes")
        for v in sizes:
            if v.__class__ is not int or not 0 <= v <= MAX_SIZE_ENTRY:
                raise pickle.UnpicklingError(
                    f"torch.Size with the entry {_short(v)}: sizes are integers from 0 to 2**63-1")
        return super().__new__(cls, sizes)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)!r})"


# torch's own type names, so that messages naming a value's type read as they did with torch's objects.
TorchDtype.__name__ = TorchDtype.__qualname__ = "dtype"
TorchDevice.__name__ = TorchDevice.__qualname__ = "device"
TorchSize.__name__ = TorchSize.__qualname__ = "Size"


def _short(value: Any) -> str:
    text = repr(value) if value.__class__ in (str, int, bool, float, type(None)) else value.__class__.__name__
    return text if len(text) <= 60 else text[:57] + "..."


def torch_values_table() -> dict[str, Any]:
    """``torch.Size``, ``torch.device`` and every dtype of :data:`~ckptaudit.formats.pickle.allowlist.TORCH_DTYPES`,
    by the global name a pickle uses, for the restricted unpickler's table."""
    table: dict[str, Any] = {"torch.Size": TorchSize, "torch.device": TorchDevice}
    for d in TORCH_DTYPES:
        table[f"torch.{d}"] = TorchDtype.named(d)
    return table
