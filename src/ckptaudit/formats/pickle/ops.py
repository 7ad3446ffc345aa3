"""The opcode tables and symbolic values of the pickle walk (:mod:`ckptaudit.formats.pickle.walk`): what each
opcode pops and pushes, what it may build, and which opcodes a plain pickle may use."""

from __future__ import annotations

import pickletools
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["PLAIN_OPCODES"]

# --------------------------------------------------------------------------------------------------------------
# Symbolic values


class _Mark:
    __slots__ = ()


class _Const:
    """A constant (number, bool, None, bytes, or a string too long to keep)."""

    __slots__ = ()


class _Unknown:
    """Any value the scanner does not model (the result of a call, a container)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class GlobalRef:
    """A global the pickle names (``module.name``), as the scanner models it."""

    name: str


@dataclass(frozen=True, slots=True)
class TupleRef:
    """A tuple whose items are all constants or strings, of length ``n``."""

    n: int


class NewCall:
    """An object ``NEWOBJ`` made (a record class's empty instance): ``built`` once ``BUILD`` gave it state."""

    __slots__ = ("built",)

    def __init__(self) -> None:
        self.built = False


_MARK, CONST, UNKNOWN = _Mark(), _Const(), _Unknown()
OPS: list[pickletools.OpcodeInfo | None] = [None] * 256
for _op in pickletools.opcodes:
    OPS[ord(_op.code)] = _op

# Length-prefixed arguments: (struct format of the length, kind of value).
PREFIXED = {
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
FIXED = {name: struct.Struct(fmt) for name, fmt in
          {"uint1": "<B", "uint2": "<H", "int4": "<i", "uint4": "<I", "uint8": "<Q", "float8": ">d"}.items()}
CONST_OPS = frozenset(
    "NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT BINBYTES SHORT_BINBYTES "
    "BINBYTES8 BYTEARRAY8".split()
)


STRING_OPS = frozenset(
    "STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8".split()
)
_SPECIAL_OPS = frozenset(
    "STOP MARK PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET LONG_BINGET FRAME PROTO GLOBAL INST STACK_GLOBAL EXT1 "
    "EXT2 EXT4 REDUCE NEWOBJ NEWOBJ_EX OBJ EMPTY_TUPLE TUPLE1 TUPLE2 TUPLE3 TUPLE POP DUP".split()
) | STRING_OPS


def _generic(op: pickletools.OpcodeInfo) -> tuple[bool, int, tuple[Any, ...]] | None:
    """(pops to a MARK first, fixed items popped, items pushed) for opcodes whose effect needs no modelling."""
    if op.name in _SPECIAL_OPS:
        return None
    if op.name in CONST_OPS:
        return False, 0, (CONST,)
    before = op.stack_before
    has_mark = pickletools.markobject in before
    fixed = before.index(pickletools.markobject) if has_mark else len(before)
    return has_mark, fixed, tuple(UNKNOWN for _ in op.stack_after)


GENERIC: list[tuple[bool, int, tuple[Any, ...]] | None] = [
    None if op is None else _generic(op) for op in OPS
]
_PLAIN_CHARGE = {"EMPTY_DICT": 64, "EMPTY_LIST": 56, "APPEND": 8, "APPENDS": 0, "BININT": 32, "BININT1": 8,
                 "BININT2": 32, "BINFLOAT": 24, "NONE": 8, "NEWTRUE": 8, "NEWFALSE": 8}
"""The generic opcodes a plain pickle may use, with what each may build (bytes, CPython's sizes, a dict or list
slot included); the others are charged -1, which marks the pickle not plain."""
FAST_GENERIC: list[tuple[int, bool, int, tuple[Any, ...], int] | None] = [
    None if g is None or op is None or (op.arg is not None and op.arg.n <= 0) else
    (0 if op.arg is None else op.arg.n, *g, _PLAIN_CHARGE.get(op.name, -1))
    for op, g in zip(OPS, GENERIC, strict=True)
]
"""For :meth:`ckptaudit.formats.pickle.walk.Walker._run_buffer`: the generic opcodes whose argument, if any, has a fixed size (its value is
not needed: they push constants or unknowns), with their :data:`_PLAIN_CHARGE`."""
PLAIN_OPCODES = frozenset(
    "PROTO FRAME STOP MARK MEMOIZE BINGET LONG_BINGET SHORT_BINUNICODE BINUNICODE GLOBAL "
    "STACK_GLOBAL EMPTY_TUPLE TUPLE1 TUPLE2 TUPLE3 TUPLE REDUCE NEWOBJ BUILD SETITEM SETITEMS LONG1".split()
) | frozenset(_PLAIN_CHARGE)
"""The opcodes of a plain pickle (:attr:`PickleScan.plain`): what ``pickle.dump`` (protocol 4 and later) writes
for dicts, lists, tuples, strings, small numbers and dataclass-like records (DCP ``.metadata``). Not ``PUT``: a
``BINPUT`` may name any memo slot up to the bytes read, and the C unpickler's memo is an array of that size;
``MEMOIZE`` fills it densely."""
PLAIN_STEP = frozenset(ord(op.code) for op in pickletools.opcodes if op.name in PLAIN_OPCODES)
U4 = struct.Struct("<I")
EMPTY_TUPLE_REF = TupleRef(0)
TUPLES = [TupleRef(n) for n in range(64)]
"""Shared symbolic tuples of the usual lengths (immutable; making one costs more than the opcode's walk)."""
CONST_TYPES = frozenset({str, _Const, TupleRef})
"""The symbolic values a constant tuple may hold (strings, constants, constant tuples), by exact type."""


def tuple_of(items: list[Any]) -> Any:
    """The symbolic tuple of ``items``: a constant tuple of their length, or unknown."""
    for v in items:
        if type(v) not in CONST_TYPES:
            return UNKNOWN
    n = len(items)
    return TUPLES[n] if n < len(TUPLES) else TupleRef(n)

