"""Walking a pickle's opcodes without executing them: every global it references, and whether it may be loaded.

:func:`scan` walks the opcodes (decoding, never executing) with a symbolic stack and memo, so it resolves every
global the pickle references, also through ``STACK_GLOBAL`` and memo indirections, and reports those outside the
allowlist (:mod:`ckptaudit.formats.allowlist`). Declared lengths are checked against the bytes that remain before
anything is read (a ``BINBYTES8`` claiming terabytes is an error, not an allocation), long byte strings are
skipped rather than read, memo indices may not run ahead of the opcodes, and opcode count and stack depth have
hard limits. The limits below are shared with the restricted unpickler (:mod:`ckptaudit.formats.unpickler`).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from dataclasses import dataclass, field
from typing import IO, Any

from ckptaudit.formats.allowlist import ALL_SAFE, HARMLESS_GLOBALS, global_name

__all__ = [
    "BUILD_BUDGET_BASE",
    "BUILD_BUDGET_FACTOR",
    "CALL_BUDGET_FACTOR",
    "MAX_DEPTH",
    "MAX_HASH_COLLISIONS",
    "MAX_INLINE",
    "MAX_KEY_NODES",
    "MAX_LINE",
    "MAX_METADATA_OPCODES",
    "MAX_NODES",
    "MAX_OPCODES",
    "MAX_STACK",
    "PickleLimitError",
    "PickleScan",
    "UnsafeBuildError",
    "UnsafeGlobalError",
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
BUILD_BUDGET_FACTOR = 16
"""What the opcodes of a pickle build (containers, strings, memo entries, estimated at CPython's object sizes)
may take at most this many times the pickle's size, plus :data:`BUILD_BUDGET_BASE`. Real pickles take 9-12 times
their size; 1-byte opcodes that each make a 216-byte empty set take 216 times."""
BUILD_BUDGET_BASE = 32 << 20
"""Fixed part of the build budget (bytes)."""
MAX_HASH_COLLISIONS = 64
"""Keys of one dict (or items of one set) that may share one hash value, past the first 32 entries: real
checkpoints have none; 200k integer keys that all hash alike would make building the dict quadratic."""
MAX_KEY_NODES = 256
"""Most nodes of one dict key or set item (a tuple of tuples): hashing a tuple walks it every time."""

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
    plain: bool = False
    """The walk proved the pickle *plain* (see :data:`PLAIN_OPCODES`): an in-memory pickle of protocol 3 or
    later that uses only the opcodes of containers, short constants, memo, globals, ``REDUCE`` and ``NEWOBJ`` of
    a global, and ``BUILD`` once on each object ``NEWOBJ`` made; whose dict keys are all strings or objects
    ``NEWOBJ`` made (so no key hash can be steered into collisions); and whose objects, estimated at CPython's
    sizes, stay within the build budget. Such a pickle may be loaded by the C unpickler with a restricted
    ``find_class`` (:func:`ckptaudit.formats.dcp_metadata.load_dcp_metadata`): every other defence of the
    restricted unpickler is then already guaranteed by the walk."""

    @property
    def loadable(self) -> bool:
        return self.error is None and not self.unsafe and not self.harmless


class UnsafeGlobalError(pickle.UnpicklingError):
    """A restricted unpickler met a global outside its allowlist."""

    def __init__(self, name: str) -> None:
        super().__init__(f"global {name!r} is not in the allowlist; refusing to load it")
        self.name = name


class UnsafeBuildError(pickle.UnpicklingError):
    """A pickle tried to give an object an attribute its class does not declare (it could shadow a method a
    check reads the object through: ``items``, ``values``, ``get``) or to rebuild an object already in use."""


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


class _New:
    """An object ``NEWOBJ`` made (a record class's empty instance): ``built`` once ``BUILD`` gave it state."""

    __slots__ = ("built",)

    def __init__(self) -> None:
        self.built = False


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

def _is_const(value: Any) -> bool:
    return isinstance(value, str | _Const | _Tuple)


class _Walker:
    """One pass over one pickle's opcodes with a symbolic stack and memo."""

    def __init__(self, stream: IO[bytes], allowed: frozenset[str], max_opcodes: int, buf: bytes | None = None) -> None:
        self.stream = stream
        self.buf = buf
        """The stream's bytes when it is an in-memory pickle: walked by index (:meth:`_run_buffer`)."""
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
        # A list indexed by memo slot (8 bytes a slot, slots bounded by the opcodes read), not a dict (~100 bytes
        # an entry): millions of 1-byte MEMOIZE opcodes must not cost the scanner hundreds of MiB.
        self.memo: list[Any] = []
        self.memo_count = 0
        self.op_at = self.start
        self.proto = 0
        self.plain = buf is not None
        """Still plain (:attr:`PickleScan.plain`); decided in :meth:`_run_buffer` and :meth:`_step`."""
        self.cost = 0
        """What a plain pickle's opcodes build, estimated (bytes)."""

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
        if self.buf is not None:
            return self._run_buffer(self.buf)
        count = 0
        stream = self.stream
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
            if self._step(code[0], op, self.op_at - self.start + 1):
                return count

    def _run_buffer(self, buf: bytes) -> int:
        """:meth:`run` over an in-memory pickle: the opcodes that make up nearly all of real pickles (memo, marks,
        tuples, short strings, constants, containers, calls) are walked here by index, with the same checks as
        :meth:`_step`, which walks every other opcode (and any whose argument runs past the end). Also decides
        whether the pickle is plain (:attr:`PickleScan.plain`), charging what each opcode would build.

        Tuned, as it walks every opcode of every pickle (a DCP ``.metadata`` has ~100 per item): opcodes are
        counted only where the pickle has more bytes than the opcode limit (each opcode takes at least one byte),
        an index past the end is the truncation check (``IndexError``), and the memo, dense in every pickle
        ``pickle.dump`` writes, grows by ``append``."""
        stream, stack, marks, memo = self.stream, self.stack, self.marks, self.memo
        push, fixed, ops = stack.append, _FAST_GENERIC, _OPS
        end, max_opcodes = self.size, self.max_opcodes
        pos = start = stream.tell()
        counting = end - start > max_opcodes
        count = cost = 0
        mc = self.memo_count
        try:
            while True:
                c = buf[pos]
                if counting:
                    count += 1
                    if count > max_opcodes:
                        raise _ScanError(f"more than {max_opcodes} opcodes", limit=True)
                if c == 0x94:  # MEMOIZE
                    if not stack or (marks and len(stack) == marks[-1]):
                        raise _ScanError("MEMOIZE with nothing to remember")
                    if mc == len(memo):
                        memo.append(stack[-1])
                        mc += 1
                    else:  # PUT opcodes left gaps or ran ahead: as _step does it
                        if mc > len(memo):
                            memo.extend([None] * (mc - len(memo)))
                        if mc == len(memo):
                            memo.append(None)
                        if memo[mc] is None:
                            memo[mc] = stack[-1]
                            mc += 1
                        else:
                            memo[mc] = stack[-1]
                    cost += 16
                    pos += 1
                    continue
                if c == 0x68:  # BINGET
                    at = buf[pos + 1]
                    if at >= len(memo) or memo[at] is None:
                        raise _ScanError(f"BINGET of memo entry {at}, which was never stored")
                    push(memo[at])
                    cost += 8
                    pos += 2
                    continue
                if c == 0x6A:  # LONG_BINGET
                    (at,) = _U4.unpack_from(buf, pos + 1)
                    if at >= len(memo) or memo[at] is None:
                        raise _ScanError(f"LONG_BINGET of memo entry {at}, which was never stored")
                    push(memo[at])
                    cost += 8
                    pos += 5
                elif c == 0x28:  # MARK
                    marks.append(len(stack))
                    pos += 1
                    continue
                elif c == 0x29:  # EMPTY_TUPLE
                    push(_EMPTY_TUPLE)
                    cost += 8
                    pos += 1
                elif c == 0x81 or c == 0x52:  # NEWOBJ, REDUCE
                    floor = marks[-1] if marks else 0
                    if len(stack) - floor < 2:
                        raise _ScanError(f"stack underflow at {'NEWOBJ' if c == 0x81 else 'REDUCE'}"
                                         + (" (it would pop a MARK)" if marks else ""))
                    args = stack.pop()
                    callee = stack.pop()
                    if type(callee) is _Global:
                        if callee.name in HARMLESS_GLOBALS:
                            self._call(callee, args, "newobj" if c == 0x81 else "reduce")
                    else:
                        self.plain = False
                    push(_New() if c == 0x81 else _UNKNOWN)
                    cost += 96
                    pos += 1
                    if buf[pos] == 0x94 and mc == len(memo):  # and MEMOIZE, as nearly every object is
                        memo.append(stack[-1])
                        mc += 1
                        cost += 16
                        pos += 1
                        if counting:
                            count += 1
                elif c == 0x62:  # BUILD: the instance stays on the stack
                    if len(stack) - (marks[-1] if marks else 0) < 2:
                        raise _ScanError("stack underflow at BUILD" + (" (it would pop a MARK)" if marks else ""))
                    del stack[-1]
                    inst = stack[-1]
                    if type(inst) is _New and not inst.built:
                        inst.built = True
                    else:
                        self.plain = False
                        stack[-1] = _UNKNOWN
                    pos += 1
                elif 0x85 <= c <= 0x87:  # TUPLE1..3
                    n = c - 0x84
                    if len(stack) - (marks[-1] if marks else 0) < n:
                        raise _ScanError(f"stack underflow at {ops[c].name}"  # type: ignore[union-attr]
                                         + (" (it would pop a MARK)" if marks else ""))
                    const = type(stack[-1]) in _CONST_TYPES
                    if n > 1:
                        const = const and type(stack[-2]) in _CONST_TYPES and (
                            n == 2 or type(stack[-3]) in _CONST_TYPES)
                        del stack[1 - n:]
                    stack[-1] = _TUPLES[n] if const else _UNKNOWN
                    cost += 56 + 8 * n
                    pos += 1
                    if buf[pos] == 0x94 and mc == len(memo):  # and MEMOIZE, as nearly every object is
                        memo.append(stack[-1])
                        mc += 1
                        cost += 16
                        pos += 1
                        if counting:
                            count += 1
                elif c == 0x75 or c == 0x73:  # SETITEMS, SETITEM
                    if c == 0x75:
                        items = self._pop_mark("SETITEMS")
                    else:
                        items = [self._pop("SETITEM"), self._pop("SETITEM")][::-1]
                    self._pop("SETITEMS" if c == 0x75 else "SETITEM")
                    for key in items[0::2]:
                        if type(key) is not str and type(key) is not _New:
                            self.plain = False
                            break
                    push(_UNKNOWN)
                    cost += 40 * len(items)
                    pos += 1
                elif c == 0x74:  # TUPLE
                    items = self._pop_mark("TUPLE")
                    push(_tuple_of(items))
                    cost += 56 + 8 * len(items)
                    pos += 1
                elif c == 0x4B and pos + 2 <= end:  # BININT1
                    push(_CONST)
                    cost += 8
                    pos += 2
                elif c == 0x7D:  # EMPTY_DICT
                    push(_UNKNOWN)
                    cost += 64
                    pos += 1
                    if buf[pos] == 0x94 and mc == len(memo):  # and MEMOIZE, as nearly every object is
                        memo.append(stack[-1])
                        mc += 1
                        cost += 16
                        pos += 1
                        if counting:
                            count += 1
                elif c == 0x4D and pos + 3 <= end:  # BININT2
                    push(_CONST)
                    cost += 32
                    pos += 3
                elif (c == 0x72 and pos + 5 <= end) or (c == 0x71 and pos + 2 <= end):  # LONG_BINPUT, BINPUT
                    if not stack or (marks and len(stack) == marks[-1]):
                        raise _ScanError(f"{ops[c].name} with nothing to remember")  # type: ignore[union-attr]
                    if c == 0x72:
                        (index,) = _U4.unpack_from(buf, pos + 1)
                    else:
                        index = buf[pos + 1]
                    if index > pos - start + 1:
                        raise _ScanError(f"memo index {index} is beyond the {pos - start + 1} bytes read so far "
                                         "(picklers number memo entries in order, one per object)")
                    if index >= len(memo):
                        memo.extend([None] * (index + 1 - len(memo)))
                    if memo[index] is None:
                        mc += 1
                    memo[index] = stack[-1]
                    self.plain = False  # (see PLAIN_OPCODES)
                    pos += 5 if c == 0x72 else 2
                    continue
                elif c == 0x58 and pos + 5 <= end and _U4.unpack_from(buf, pos + 1)[0] <= min(
                        MAX_INLINE, end - pos - 5):  # BINUNICODE, a short one
                    (n,) = _U4.unpack_from(buf, pos + 1)
                    push(buf[pos + 5:pos + 5 + n].decode("utf-8", "surrogatepass"))
                    cost += 64 + n
                    pos += 5 + n
                elif c == 0x8C and pos + 2 + buf[pos + 1] <= end:  # SHORT_BINUNICODE
                    n = buf[pos + 1]
                    push(buf[pos + 2:pos + 2 + n].decode("utf-8", "surrogatepass"))
                    cost += 64 + n
                    pos += 2 + n
                    if buf[pos] == 0x94 and mc == len(memo):  # and MEMOIZE, as nearly every object is
                        memo.append(stack[-1])
                        mc += 1
                        cost += 16
                        pos += 1
                        if counting:
                            count += 1
                elif fixed[c] is not None and pos + 1 + fixed[c][0] <= end:  # type: ignore[index]
                    argn, has_mark, pops, pushes, charge = fixed[c]  # type: ignore[misc]
                    if has_mark:
                        self._pop_mark(ops[c].name)  # type: ignore[union-attr]
                    if pops > len(stack) - (marks[-1] if marks else 0):
                        raise _ScanError(f"stack underflow at {ops[c].name}"  # type: ignore[union-attr]
                                         + (" (it would pop a MARK)" if marks else ""))
                    if pops:
                        del stack[-pops:]
                    pos += 1 + argn
                    if charge < 0:
                        self.plain = False
                    cost += charge
                    if not pushes:
                        continue
                    stack.extend(pushes)
                    if buf[pos] == 0x94 and mc == len(memo):  # and MEMOIZE, as nearly every object is
                        memo.append(stack[-1])
                        mc += 1
                        cost += 16
                        pos += 1
                        if counting:
                            count += 1
                else:
                    op = ops[c]
                    if op is None:
                        raise _ScanError(f"unknown opcode {bytes([c])!r}")
                    self.op_at = pos
                    stream.seek(pos + 1)
                    self.memo_count = mc
                    if self._step(c, op, pos - start + 1):
                        return count
                    mc = self.memo_count
                    pos = stream.tell()
                    continue
                if len(stack) > MAX_STACK:
                    raise _ScanError(f"stack deeper than {MAX_STACK}", limit=True)
        except (IndexError, struct.error):
            # The next opcode, or an argument, past the end: _step walks that opcode again and says what it says.
            self.op_at = pos
            if pos >= end:
                stream.seek(pos)
                raise _ScanError("the pickle ends before its STOP opcode (truncated)") from None
            stream.seek(pos + 1)
            self.memo_count = mc
            self._step(buf[pos], ops[buf[pos]], pos - start + 1)  # type: ignore[arg-type]
            raise _ScanError(f"opcode at byte {pos}: its argument runs past the end") from None
        except BaseException:
            self.op_at = pos
            raise
        finally:
            self.cost += cost
            self.memo_count = mc

    def _step(self, code: int, op: pickletools.OpcodeInfo, count: int) -> bool:
        """One opcode, its byte already read (the stream is at its argument); ``True`` at ``STOP``. ``count``
        bounds the memo indices: the bytes read so far, this opcode's included (each object a pickle memoizes
        took at least one byte, so a C unpickler's memo array stays within the pickle's size)."""
        stack = self.stack
        if self.plain:
            if code not in _PLAIN_STEP:
                self.plain = False
            self.cost += 64
        generic = _GENERIC[code]
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
            return False
        arg = self._arg(op)
        name = op.name
        if type(arg) is str:
            self.cost += len(arg)
        if name == "STOP":
            self._pop(name)
            return True
        if name == "MARK":
            self.marks.append(len(stack))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack or (self.marks and len(stack) == self.marks[-1]):
                raise _ScanError(f"{name} with nothing to remember")
            index = self.memo_count if name == "MEMOIZE" else int(arg)
            # Picklers number memo entries 0, 1, 2, ...; a far larger index would make C unpicklers (DCP's
            # pickle.load of .metadata) allocate a memo array of that size.
            if not 0 <= index <= count:
                raise _ScanError(f"memo index {index} is beyond the {count} bytes read so far (picklers number "
                                 "memo entries in order, one per object)")
            if index >= len(self.memo):
                self.memo.extend([None] * (index + 1 - len(self.memo)))
            if self.memo[index] is None:
                self.memo_count += 1
            self.memo[index] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            at = int(arg)
            if at >= len(self.memo) or self.memo[at] is None:
                raise _ScanError(f"{name} of memo entry {arg}, which was never stored")
            stack.append(self.memo[at])
        elif name == "FRAME":
            if int(arg) > self._remaining():
                raise _ScanError(f"FRAME declares {arg} bytes, only {self._remaining()} remain")
        elif name == "PROTO":
            if not 0 <= int(arg) <= pickle.HIGHEST_PROTOCOL:
                raise _ScanError(f"unsupported pickle protocol {arg}")
            self.proto = int(arg)
            if self.proto < 3:
                self.plain = False  # below 3 the unpicklers rename Python 2 globals (see global_name)
        elif name in ("GLOBAL", "INST"):
            if self.proto < 3:
                self.plain = False
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
            if self.proto < 3:
                self.plain = False
            attr_obj = self._pop(name)
            module_obj = self._pop(name)
            if isinstance(module_obj, str) and isinstance(attr_obj, str):
                full = global_name(module_obj, attr_obj, self.proto)
            else:
                full = "<unresolvable STACK_GLOBAL>"
                self.plain = False
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
        return False


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
_PLAIN_CHARGE = {"EMPTY_DICT": 64, "EMPTY_LIST": 56, "APPEND": 8, "APPENDS": 0, "BININT": 32, "BININT1": 8,
                 "BININT2": 32, "BINFLOAT": 24, "NONE": 8, "NEWTRUE": 8, "NEWFALSE": 8}
"""The generic opcodes a plain pickle may use, with what each may build (bytes, CPython's sizes, a dict or list
slot included); the others are charged -1, which marks the pickle not plain."""
_FAST_GENERIC: list[tuple[int, bool, int, tuple[Any, ...], int] | None] = [
    None if g is None or op is None or (op.arg is not None and op.arg.n <= 0) else
    (0 if op.arg is None else op.arg.n, *g, _PLAIN_CHARGE.get(op.name, -1))
    for op, g in zip(_OPS, _GENERIC, strict=True)
]
"""For :meth:`_Walker._run_buffer`: the generic opcodes whose argument, if any, has a fixed size (its value is
not needed: they push constants or unknowns), with their :data:`_PLAIN_CHARGE`."""
PLAIN_OPCODES = frozenset(
    "PROTO FRAME STOP MARK MEMOIZE BINGET LONG_BINGET SHORT_BINUNICODE BINUNICODE GLOBAL "
    "STACK_GLOBAL EMPTY_TUPLE TUPLE1 TUPLE2 TUPLE3 TUPLE REDUCE NEWOBJ BUILD SETITEM SETITEMS LONG1".split()
) | frozenset(_PLAIN_CHARGE)
"""The opcodes of a plain pickle (:attr:`PickleScan.plain`): what ``pickle.dump`` (protocol 4 and later) writes
for dicts, lists, tuples, strings, small numbers and dataclass-like records (DCP ``.metadata``). Not ``PUT``: a
``BINPUT`` may name any memo slot up to the bytes read, and the C unpickler's memo is an array of that size;
``MEMOIZE`` fills it densely."""
_PLAIN_STEP = frozenset(ord(op.code) for op in pickletools.opcodes if op.name in PLAIN_OPCODES)
_U4 = struct.Struct("<I")
_EMPTY_TUPLE = _Tuple(0)
_TUPLES = [_Tuple(n) for n in range(64)]
"""Shared symbolic tuples of the usual lengths (immutable; making one costs more than the opcode's walk)."""
_CONST_TYPES = frozenset({str, _Const, _Tuple})
"""The symbolic values :func:`_is_const` accepts, by exact type."""


def _tuple_of(items: list[Any]) -> Any:
    for v in items:
        if type(v) not in _CONST_TYPES:
            return _UNKNOWN
    n = len(items)
    return _TUPLES[n] if n < len(_TUPLES) else _Tuple(n)


def scan(data: bytes | bytearray | memoryview | IO[bytes], allowed: frozenset[str] = ALL_SAFE, *,
         max_opcodes: int = MAX_OPCODES) -> PickleScan:
    """Walk one pickle's opcodes (never executing them) and classify every global it references.

    ``data`` is the pickle's bytes or a seekable stream positioned at its start; a stream is left just past
    ``STOP`` (or where the walk stopped). Offsets in the result are positions in the stream.
    """
    buf = None
    if isinstance(data, bytes | bytearray | memoryview):
        buf = data if isinstance(data, bytes) else bytes(data)
        stream: IO[bytes] = io.BytesIO(buf)
    else:
        stream = data
    walker = _Walker(stream, allowed, max_opcodes, buf)
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
    plain = (error is None and walker.plain
             and walker.cost <= BUILD_BUDGET_FACTOR * (end - walker.start) + BUILD_BUDGET_BASE)
    return PickleScan(names, tuple(unsafe), tuple(harmless), error, error_offset, end, limit, misused, plain)


