"""The pickle walk: one pass over a pickle's opcodes with a symbolic stack and memo, never executing anything
(:func:`ckptaudit.formats.pickle.scan.scan` runs it and reports what it found)."""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from typing import IO, Any

from ckptaudit.formats.pickle.allowlist import HARMLESS_GLOBALS, global_name
from ckptaudit.formats.pickle.limits import MAX_INLINE, MAX_LINE, MAX_STACK
from ckptaudit.formats.pickle.ops import (
    CONST,
    CONST_OPS,
    CONST_TYPES,
    EMPTY_TUPLE_REF,
    FAST_GENERIC,
    FIXED,
    GENERIC,
    OPS,
    PLAIN_STEP,
    PREFIXED,
    STRING_OPS,
    TUPLES,
    U4,
    UNKNOWN,
    GlobalRef,
    NewCall,
    TupleRef,
    tuple_of,
)

__all__ = ["ScanError", "Walker"]


class ScanError(Exception):
    def __init__(self, message: str, limit: bool = False) -> None:
        super().__init__(message)
        self.limit = limit



class Walker:
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
            raise ScanError(f"{what} declares {n} bytes, only {self._remaining()} remain (truncated or corrupt)")
        data = self.stream.read(n)
        if len(data) != n:
            raise ScanError(f"{what}: needs {n} bytes, read {len(data)}")
        return data

    def _line(self) -> bytes:
        line = self.stream.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            if len(line) > MAX_LINE:
                raise ScanError(f"a line argument is longer than {MAX_LINE} bytes", limit=True)
            raise ScanError("line argument without newline (truncated)")
        return line

    def _arg(self, op: pickletools.OpcodeInfo) -> Any:
        desc = op.arg
        if desc is None:
            return None
        if desc.n > 0:  # a few bytes: read them, no allocation to check
            data = self.stream.read(desc.n)
            if len(data) != desc.n:
                raise ScanError(f"{op.name}: its {desc.n}-byte argument is truncated")
            return FIXED[desc.name].unpack(data)[0]
        if desc.n == pickletools.UP_TO_NEWLINE:
            lines = self._line()
            if desc.name == "stringnl_noescape_pair":
                lines += self._line()
            return desc.reader(io.BytesIO(lines))
        fmt, kind = PREFIXED[desc.name]
        (n,) = struct.unpack(fmt, self._exact(struct.calcsize(fmt), op.name))
        if n < 0:
            raise ScanError(f"{op.name} declares a negative length {n}")
        if n > self._remaining():
            raise ScanError(f"{op.name} declares {n} bytes, only {self._remaining()} remain (truncated or corrupt)")
        if n > MAX_INLINE:
            self.stream.seek(n, io.SEEK_CUR)  # never read: the scanner needs only short strings (names)
            return CONST
        data = self._exact(n, op.name)
        if kind == "str":
            return data.decode("utf-8", "surrogatepass")
        if kind == "str1":
            return data.decode("latin-1")
        return CONST

    # -- the walk --------------------------------------------------------------------------------------------
    def _pop(self, name: str) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise ScanError(f"stack underflow at {name}" + (" (it would pop a MARK)" if self.marks else ""))
        return self.stack.pop()

    def _pop_mark(self, name: str) -> list[Any]:
        if not self.marks:
            raise ScanError(f"{name} without a MARK")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def _call(self, callee: Any, args: Any, how: str) -> None:
        """``callee(*args)`` (REDUCE) or ``callee.__new__(callee, *args)`` (NEWOBJ): check harmless usage."""
        if not isinstance(callee, GlobalRef):
            return
        kind = HARMLESS_GLOBALS.get(callee.name)
        if kind is None:
            return
        if how == "newobj" and isinstance(args, TupleRef) and args.n == 0:
            return
        if how == "reduce" and kind == "enum" and isinstance(args, TupleRef) and args.n == 1:
            return
        self.misused.setdefault(callee.name, None)

    def run(self) -> int:
        """Walk to ``STOP``; returns the opcode count. Raises :class:`ScanError`."""
        if self.buf is not None:
            return self._run_buffer(self.buf)
        self.plain = False  # only the walk by index decides it (BUILD, keys, costs)
        count = 0
        stream = self.stream
        while True:
            self.op_at = stream.tell()
            code = stream.read(1)
            if not code:
                raise ScanError("the pickle ends before its STOP opcode (truncated)")
            op = OPS[code[0]]
            if op is None:
                raise ScanError(f"unknown opcode {code!r}")
            count += 1
            if count > self.max_opcodes:
                raise ScanError(f"more than {self.max_opcodes} opcodes", limit=True)
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
        push, fixed, ops = stack.append, FAST_GENERIC, OPS
        end, max_opcodes = self.size, self.max_opcodes
        pos = start = stream.tell()
        counting = end - start > max_opcodes
        # Each opcode walked here takes a byte and leaves at most one more item on the stack: a pickle of no more
        # bytes than MAX_STACK cannot grow it past the limit.
        checking = end - start > MAX_STACK
        count = cost = 0
        mc = self.memo_count
        try:
            while True:
                c = buf[pos]
                if counting:
                    count += 1
                    if count > max_opcodes:
                        raise ScanError(f"more than {max_opcodes} opcodes", limit=True)
                if c == 0x94:  # MEMOIZE
                    if not stack or (marks and len(stack) == marks[-1]):
                        raise ScanError("MEMOIZE with nothing to remember")
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
                        raise ScanError(f"BINGET of memo entry {at}, which was never stored")
                    push(memo[at])
                    cost += 8
                    pos += 2
                    continue
                if c == 0x6A:  # LONG_BINGET
                    (at,) = U4.unpack_from(buf, pos + 1)
                    if at >= len(memo) or memo[at] is None:
                        raise ScanError(f"LONG_BINGET of memo entry {at}, which was never stored")
                    push(memo[at])
                    cost += 8
                    pos += 5
                elif c == 0x28:  # MARK
                    marks.append(len(stack))
                    pos += 1
                    continue
                elif c == 0x29:  # EMPTY_TUPLE
                    push(EMPTY_TUPLE_REF)
                    cost += 8
                    pos += 1
                elif c == 0x81 or c == 0x52:  # NEWOBJ, REDUCE
                    floor = marks[-1] if marks else 0
                    if len(stack) - floor < 2:
                        raise ScanError(f"stack underflow at {'NEWOBJ' if c == 0x81 else 'REDUCE'}"
                                         + (" (it would pop a MARK)" if marks else ""))
                    args = stack.pop()
                    callee = stack.pop()
                    if type(callee) is GlobalRef:
                        if callee.name in HARMLESS_GLOBALS:
                            self._call(callee, args, "newobj" if c == 0x81 else "reduce")
                    else:
                        self.plain = False
                    push(NewCall() if c == 0x81 else UNKNOWN)
                    cost += 96
                    pos += 1
                elif c == 0x62:  # BUILD: the instance stays on the stack
                    if len(stack) - (marks[-1] if marks else 0) < 2:
                        raise ScanError("stack underflow at BUILD" + (" (it would pop a MARK)" if marks else ""))
                    del stack[-1]
                    inst = stack[-1]
                    if type(inst) is NewCall and not inst.built:
                        inst.built = True
                    else:
                        self.plain = False
                        stack[-1] = UNKNOWN
                    pos += 1
                elif 0x85 <= c <= 0x87:  # TUPLE1..3
                    n = c - 0x84
                    if len(stack) - (marks[-1] if marks else 0) < n:
                        raise ScanError(f"stack underflow at {ops[c].name}"  # type: ignore[union-attr]
                                         + (" (it would pop a MARK)" if marks else ""))
                    const = type(stack[-1]) in CONST_TYPES
                    if n > 1:
                        const = const and type(stack[-2]) in CONST_TYPES and (
                            n == 2 or type(stack[-3]) in CONST_TYPES)
                        del stack[1 - n:]
                    stack[-1] = TUPLES[n] if const else UNKNOWN
                    cost += 56 + 8 * n
                    pos += 1
                elif c == 0x75:  # SETITEMS: the keys must be strings or records for a plain pickle
                    if not marks:
                        raise ScanError("SETITEMS without a MARK")
                    at = marks.pop()
                    for key in stack[at::2]:
                        if type(key) is not str and type(key) is not NewCall:
                            self.plain = False
                            break
                    cost += 40 * (len(stack) - at)
                    del stack[at:]
                    if len(stack) <= (marks[-1] if marks else 0):
                        raise ScanError("stack underflow at SETITEMS" + (" (it would pop a MARK)" if marks else ""))
                    stack[-1] = UNKNOWN
                    pos += 1
                elif c == 0x73:  # SETITEM
                    items = [self._pop("SETITEM"), self._pop("SETITEM")]
                    self._pop("SETITEM")
                    if type(items[1]) is not str and type(items[1]) is not NewCall:
                        self.plain = False
                    push(UNKNOWN)
                    cost += 80
                    pos += 1
                elif c == 0x74:  # TUPLE
                    items = self._pop_mark("TUPLE")
                    push(tuple_of(items))
                    cost += 56 + 8 * len(items)
                    pos += 1
                elif c == 0x4B and pos + 2 <= end:  # BININT1
                    push(CONST)
                    cost += 8
                    pos += 2
                elif c == 0x7D:  # EMPTY_DICT
                    push(UNKNOWN)
                    cost += 64
                    pos += 1
                elif c == 0x4D and pos + 3 <= end:  # BININT2
                    push(CONST)
                    cost += 32
                    pos += 3
                elif (c == 0x72 and pos + 5 <= end) or (c == 0x71 and pos + 2 <= end):  # LONG_BINPUT, BINPUT
                    if not stack or (marks and len(stack) == marks[-1]):
                        raise ScanError(f"{ops[c].name} with nothing to remember")  # type: ignore[union-attr]
                    if c == 0x72:
                        (index,) = U4.unpack_from(buf, pos + 1)
                    else:
                        index = buf[pos + 1]
                    if index > pos - start + 1:
                        raise ScanError(f"memo index {index} is beyond the {pos - start + 1} bytes read so far "
                                         "(picklers number memo entries in order, one per object)")
                    if index >= len(memo):
                        memo.extend([None] * (index + 1 - len(memo)))
                    if memo[index] is None:
                        mc += 1
                    memo[index] = stack[-1]
                    self.plain = False  # (see PLAIN_OPCODES)
                    pos += 5 if c == 0x72 else 2
                    continue
                elif c == 0x58 and pos + 5 <= end and U4.unpack_from(buf, pos + 1)[0] <= min(
                        MAX_INLINE, end - pos - 5):  # BINUNICODE, a short one
                    (n,) = U4.unpack_from(buf, pos + 1)
                    push(buf[pos + 5:pos + 5 + n].decode("utf-8", "surrogatepass"))
                    cost += 64 + n
                    pos += 5 + n
                elif c == 0x8C and pos + 2 + buf[pos + 1] <= end:  # SHORT_BINUNICODE
                    n = buf[pos + 1]
                    push(buf[pos + 2:pos + 2 + n].decode("utf-8", "surrogatepass"))
                    cost += 64 + n
                    pos += 2 + n
                elif fixed[c] is not None and pos + 1 + fixed[c][0] <= end:  # type: ignore[index]
                    argn, has_mark, pops, pushes, charge = fixed[c]  # type: ignore[misc]
                    if has_mark:
                        self._pop_mark(ops[c].name)  # type: ignore[union-attr]
                    if pops > len(stack) - (marks[-1] if marks else 0):
                        raise ScanError(f"stack underflow at {ops[c].name}"  # type: ignore[union-attr]
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
                else:
                    op = ops[c]
                    if op is None:
                        raise ScanError(f"unknown opcode {bytes([c])!r}")
                    self.op_at = pos
                    stream.seek(pos + 1)
                    self.memo_count = mc
                    if self._step(c, op, pos - start + 1):
                        return count
                    mc = self.memo_count
                    pos = stream.tell()
                    continue
                # Every branch that gets here left an object on top, above any mark: a MEMOIZE right after it
                # (pickle.dump memoizes nearly every object) is taken here, as its own branch would take it.
                if buf[pos] == 0x94 and mc == len(memo):
                    memo.append(stack[-1])
                    mc += 1
                    cost += 16
                    pos += 1
                    if counting:
                        count += 1
                if checking and len(stack) > MAX_STACK:
                    raise ScanError(f"stack deeper than {MAX_STACK}", limit=True)
        except (IndexError, struct.error):
            # The next opcode, or an argument, past the end: _step walks that opcode again and says what it says.
            self.op_at = pos
            if pos >= end:
                stream.seek(pos)
                raise ScanError("the pickle ends before its STOP opcode (truncated)") from None
            stream.seek(pos + 1)
            self.memo_count = mc
            self._step(buf[pos], ops[buf[pos]], pos - start + 1)  # type: ignore[arg-type]
            raise ScanError(f"opcode at byte {pos}: its argument runs past the end") from None
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
            if code not in PLAIN_STEP:
                self.plain = False
            self.cost += 64
        generic = GENERIC[code]
        if generic is not None:  # the common container and constant opcodes: no names, no calls
            has_mark, pops, pushes = generic
            if op.arg is not None:
                self._arg(op)
            if has_mark:
                self._pop_mark(op.name)
            if pops > len(stack) - (self.marks[-1] if self.marks else 0):
                raise ScanError(f"stack underflow at {op.name}" + (" (it would pop a MARK)" if self.marks else ""))
            if pops:
                del stack[-pops:]
            stack.extend(pushes)
            if len(stack) > MAX_STACK:
                raise ScanError(f"stack deeper than {MAX_STACK}", limit=True)
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
                raise ScanError(f"{name} with nothing to remember")
            index = self.memo_count if name == "MEMOIZE" else int(arg)
            # Picklers number memo entries 0, 1, 2, ...; a far larger index would make C unpicklers (DCP's
            # pickle.load of .metadata) allocate a memo array of that size.
            if not 0 <= index <= count:
                raise ScanError(f"memo index {index} is beyond the {count} bytes read so far (picklers number "
                                 "memo entries in order, one per object)")
            if index >= len(self.memo):
                self.memo.extend([None] * (index + 1 - len(self.memo)))
            if self.memo[index] is None:
                self.memo_count += 1
            self.memo[index] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            at = int(arg)
            if at >= len(self.memo) or self.memo[at] is None:
                raise ScanError(f"{name} of memo entry {arg}, which was never stored")
            stack.append(self.memo[at])
        elif name == "FRAME":
            if int(arg) > self._remaining():
                raise ScanError(f"FRAME declares {arg} bytes, only {self._remaining()} remain")
        elif name == "PROTO":
            if not 0 <= int(arg) <= pickle.HIGHEST_PROTOCOL:
                raise ScanError(f"unsupported pickle protocol {arg}")
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
                    self._call(GlobalRef(full), UNKNOWN, "inst")
                stack.append(UNKNOWN)
            else:
                stack.append(GlobalRef(full))
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
            stack.append(GlobalRef(full))
        elif name in ("EXT1", "EXT2", "EXT4"):
            self.found.setdefault(f"<copyreg extension {arg}>", None)
            stack.append(UNKNOWN)
        elif name == "REDUCE":
            args = self._pop(name)
            callee = self._pop(name)
            self._call(callee, args, "reduce")
            stack.append(UNKNOWN)
        elif name == "NEWOBJ":
            args = self._pop(name)
            callee = self._pop(name)
            self._call(callee, args, "newobj")
            stack.append(UNKNOWN)
        elif name == "NEWOBJ_EX":
            self._pop(name)
            args = self._pop(name)
            callee = self._pop(name)
            self._call(callee, UNKNOWN, "newobj_ex")
            stack.append(UNKNOWN)
        elif name == "OBJ":
            items = self._pop_mark(name)
            if not items:
                raise ScanError("OBJ without a class")
            if len(items) > 1:
                self._call(items[0], UNKNOWN, "obj")
            stack.append(UNKNOWN)
        elif name == "EMPTY_TUPLE":
            stack.append(EMPTY_TUPLE_REF)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = [self._pop(name) for _ in range(n)]
            stack.append(tuple_of(items))
        elif name == "TUPLE":
            items = self._pop_mark(name)
            stack.append(tuple_of(items))
        elif name == "POP" and self.marks and len(stack) == self.marks[-1]:
            self.marks.pop()  # POP of a MARK is legal (both unpicklers allow it)
        elif name == "DUP":
            stack.append(self._pop(name))
            stack.append(stack[-1])
        elif name in STRING_OPS:
            stack.append(arg if isinstance(arg, str) else CONST)
        elif name in CONST_OPS:
            stack.append(CONST)
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
            stack.extend(UNKNOWN for _ in op.stack_after)
        if len(stack) > MAX_STACK:
            raise ScanError(f"stack deeper than {MAX_STACK}", limit=True)
        return False

