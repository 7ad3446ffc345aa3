"""The restricted unpickler: loads a pickle the scanner accepted, running nothing outside the allowlist.

:class:`RestrictedUnpickler` is a pure-Python unpickler whose ``find_class`` maps each allowed name to a vetted
implementation (the allowlist is checked a second time), which refuses ``EXT``/``INST``/``OBJ``, lets ``BUILD``
touch only instances of vetted classes with vetted state, and charges every call against a budget proportional
to the pickle's size (so a small pickle cannot make a huge object by calling allowed functions in a loop).
:func:`ckptaudit.formats.pickle.object_tree.check_tree` then bounds the depth and the expanded size of what was loaded (no cycles, no exponential
sharing), so every later recursive walk is safe.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
from collections.abc import Callable, Collection, Iterable
from typing import IO, Any, ClassVar

from ckptaudit.formats.pickle.allowlist import global_name
from ckptaudit.formats.pickle.numpy_values import (
    NUMPY_ON_DEMAND,
    NdarrayShell,
    dtype_from_state,
    ndarray_from_state,
    numpy_table,
)
from ckptaudit.formats.pickle.scan import (
    BUILD_BUDGET_BASE,
    BUILD_BUDGET_FACTOR,
    CALL_BUDGET_FACTOR,
    MAX_HASH_COLLISIONS,
    MAX_KEY_NODES,
    MAX_LINE,
    PickleLimitError,
    UnsafeBuildError,
    UnsafeGlobalError,
    build_budget,
)
from ckptaudit.formats.pickle.torch_values import torch_values_table

__all__ = ["BUILD_ATTRIBUTES", "Opaque", "PickledRecord", "RestrictedUnpickler", "base_table"]

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
_KEY_SCALARS = frozenset({str, bytes, int, float, complex, bool, type(None)})

BUILD_ATTRIBUTES: dict[type, frozenset[str]] = {collections.OrderedDict: frozenset({"_metadata"})}
"""The only instance attributes ``BUILD`` may set on allowlisted classes without their own ``__setstate__``:
``nn.Module.state_dict()`` returns an ``OrderedDict`` carrying ``_metadata`` (module versions). Nothing else, so
no pickle can give a container an attribute that shadows one of its methods (``items``, ``values``, ``get``)."""

_OPCODE_COST: dict[int, int] = {
    pickle.EMPTY_DICT[0]: 64,
    pickle.EMPTY_LIST[0]: 56,
    pickle.EMPTY_SET[0]: 216,
    pickle.MEMOIZE[0]: 100,
    pickle.PUT[0]: 100,
    pickle.BINPUT[0]: 100,
    pickle.LONG_BINPUT[0]: 100,
    pickle.TUPLE1[0]: 56,
    pickle.TUPLE2[0]: 64,
    pickle.TUPLE3[0]: 72,
    pickle.REDUCE[0]: 64,
    pickle.NEWOBJ[0]: 64,
    pickle.NEWOBJ_EX[0]: 64,
    pickle.BUILD[0]: 64,
    pickle.LONG1[0]: 32,
    pickle.LONG4[0]: 32,
    pickle.BININT[0]: 32,
    pickle.BINFLOAT[0]: 24,
}
_SIZED_RESULT = frozenset(
    op[0] for op in (pickle.STRING, pickle.BINSTRING, pickle.SHORT_BINSTRING, pickle.UNICODE, pickle.BINUNICODE,
                     pickle.SHORT_BINUNICODE, pickle.BINUNICODE8, pickle.BINBYTES, pickle.SHORT_BINBYTES,
                     pickle.BINBYTES8, pickle.BYTEARRAY8, pickle.LONG4)
)


def _charged(fn: Callable[[Any], None], cost: int, sized: bool) -> Callable[[Any], None]:
    if sized:
        def run_sized(self: Any) -> None:
            self._spend(cost + 50)
            fn(self)
            top = self.stack[-1]
            if type(top) in _SIZED:
                self._spend(len(top))
        return run_sized

    def run(self: Any) -> None:
        # RestrictedUnpickler._spend, inlined: this runs once per opcode (half a million for a large DCP .metadata).
        self._build_left -= cost
        if self._build_left < 0:
            self._spend(0)  # raises, with the message
        fn(self)
    return run


class Opaque:
    """An object of a class outside the allowlist, never constructed: the name of its global and the arguments
    and state it would have been built from (themselves loaded under the same rules). What an *inert* load puts
    where ``torch.load(weights_only=False)`` would have run code."""

    __slots__ = ("args", "name", "state")

    def __init__(self, name: str, args: tuple[Any, ...] = (), state: Any = None) -> None:
        self.name, self.args, self.state = name, args, state

    def __repr__(self) -> str:
        return f"<not loaded: {self.name}>"


def set_declared(inst: Any, state: Any, declared: Collection[str]) -> None:
    """Apply ``BUILD`` state (a dict, or ``(dict, slots dict)``) to ``inst``, setting only the ``declared``
    attributes: any other name could become an instance attribute shadowing a method that a check reads the
    object through. Raises :class:`UnsafeBuildError` naming the attribute and what is allowed."""
    slots = None
    if type(state) is tuple and len(state) == 2:
        state, slots = state
    for part in (state, slots):
        if part is None:
            continue
        if type(part) is not dict:
            raise pickle.UnpicklingError(f"BUILD state for {type(inst).__name__} is not a plain dict")
        for k, v in dict.items(part):
            if type(k) is not str or k not in declared:
                raise UnsafeBuildError(
                    f"BUILD may not set attribute {k!r} on {type(inst).__name__} (allowed: "
                    f"{', '.join(sorted(declared)) or 'none'}): an instance attribute could shadow a method "
                    "that a check reads the object through")
            object.__setattr__(inst, k, v)


class PickledRecord:
    """A stand-in for a class a pickle may build, with one view only: ``__slots__`` hold exactly the declared
    ``FIELDS`` (no ``__dict__``, so no attribute can shadow a method), ``NEWOBJ`` makes it empty and one ``BUILD``
    sets declared fields; it is never called, and it hashes by identity (a pickle cannot make its keys collide)."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()

    __hash__ = object.__hash__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise pickle.UnpicklingError(f"{type(self).__name__} is only rebuilt from pickled state, never called")

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict:  # what picklers write: the fields by name, each set through its slot
            fields = self.FIELDS
            for k in state:
                if type(k) is not str or k not in fields:
                    break
            else:
                for k, v in dict.items(state):
                    object.__setattr__(self, k, v)
                return
        set_declared(self, state, self.FIELDS)  # anything else, with its checks and messages

    def get(self, name: str) -> Any:
        """The value of field ``name``, ``None`` where the pickle left it unset."""
        return getattr(self, name, None) if name in self.FIELDS else None

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f, None) for f in self.FIELDS)


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
    pop_mark: Callable[[], list[Any]]
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
        self._build_left = self._build_budget = build_budget(size)
        self._inert = inert
        self._opaque: dict[str, _OpaqueGlobal] = {}
        self._built: set[int] = set()
        self._collisions: dict[int, tuple[Any, dict[int, int]]] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = global_name(module, name, self.proto)  # the same name the scanner vetted
        if key.startswith("numpy.") and NUMPY_ON_DEMAND in self._table:
            self._add_numpy()
        try:
            return self._table[key]
        except KeyError:
            if self._inert:  # an inert placeholder: the rest of the pickle can be read, nothing is run
                return self._opaque.setdefault(key, _OpaqueGlobal(key))
            raise UnsafeGlobalError(key) from None

    def _add_numpy(self) -> None:
        """The table's NumPy entries, made when a pickle first names a NumPy global (importing NumPy costs ~0.1 s,
        and most checkpoints hold no NumPy object); entries the table already has are kept."""
        table = {**numpy_table(), **self._table}
        del table[NUMPY_ON_DEMAND]
        self._table = table
        self._callables = {id(v) for v in table.values()}
        self._types = {v for v in table.values() if isinstance(v, type)}

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
        if func is set or func is frozenset or func is collections.OrderedDict:
            stack[-1] = self._container(func, args)
            return
        stack[-1] = func(*args)

    def _container(self, cls: Any, args: tuple[Any, ...]) -> Any:
        """``set(items)``, ``frozenset(items)``, ``OrderedDict(pairs)``, built one vetted item at a time."""
        if len(args) > 1 or (args and type(args[0]) not in (list, tuple)):
            raise pickle.UnpicklingError(f"{cls.__name__} called with {len(args)} arguments that are not a list")
        items = args[0] if args else ()
        if cls is collections.OrderedDict:
            od: collections.OrderedDict[Any, Any] = collections.OrderedDict()
            for pair in items:
                if type(pair) not in (list, tuple) or len(pair) != 2:
                    raise pickle.UnpicklingError("OrderedDict called with items that are not (key, value) pairs")
                self._setitem(od, pair[0], pair[1])
            return od
        out: set[Any] = set()
        for item in items:
            self._add(out, item)
        return out if cls is set else frozenset(out)

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
        np = sys.modules.get("numpy")  # not imported: no NumPy object exists
        if np is not None and isinstance(inst, np.dtype):
            return dtype_from_state(inst, state)
        if isinstance(inst, NdarrayShell):
            self._charge(state[-1] if isinstance(state, tuple) and state else None)
            return ndarray_from_state(state)
        if type(inst) not in self._build_types:
            raise pickle.UnpicklingError(f"BUILD on {type(inst).__name__} is not allowed")
        if id(inst) in self._built:  # a second BUILD through the memo would change an object already in use
            raise UnsafeBuildError(f"a second BUILD on one {type(inst).__name__} (picklers build each object once; "
                                   "a second one would change an object already in use, e.g. a dict key)")
        self._built.add(id(inst))
        if isinstance(inst, PickledRecord):
            type(inst).__setstate__(inst, state)
            return inst
        own = type(inst).__dict__.get("__setstate__")
        if own is not None:
            own(inst, state)
            return inst
        set_declared(inst, state, BUILD_ATTRIBUTES.get(type(inst), frozenset()))
        return inst

    # -- containers: exact types, vetted keys, charged sizes -------------------------------------------------
    def _spend(self, cost: int) -> None:
        self._build_left -= cost
        if self._build_left < 0:
            raise PickleLimitError(
                f"the objects this pickle builds exceed {BUILD_BUDGET_FACTOR}x its size + {BUILD_BUDGET_BASE >> 20} "
                f"MiB ({self._build_budget >> 20} MiB; an opcode amplification: many small opcodes, large objects)")

    def _key_hash(self, key: Any) -> int:
        """``hash(key)`` for a key whose hashing is cheap and cannot be steered into collisions unnoticed."""
        t = type(key)
        if t in _KEY_SCALARS or t is frozenset or t.__hash__ is object.__hash__:
            return hash(key)
        if isinstance(key, tuple):  # tuple, torch.Size: hashing walks it every time, so bound its size
            nodes, todo = 0, [key]
            while todo:
                v = todo.pop()
                nodes += 1
                if nodes > MAX_KEY_NODES:
                    raise PickleLimitError(f"a dict key or set item with more than {MAX_KEY_NODES} nodes")
                if isinstance(v, tuple):
                    todo.extend(v)
                elif not (type(v) in _KEY_SCALARS or type(v) is frozenset or type(v).__hash__ is object.__hash__):
                    raise pickle.UnpicklingError(f"a {type(v).__name__} inside a dict key or set item")
            return hash(key)
        np = sys.modules.get("numpy")  # not imported: no NumPy object exists
        if np is not None and isinstance(key, np.generic) and key.dtype.kind in "biufc":
            return hash(key)
        raise pickle.UnpicklingError(f"a {t.__name__} may not be a dict key or set item")

    def _admit(self, container: Any, key: Any) -> None:
        """Vet ``key`` before it goes into ``container``: cheap to hash, and not the next of many keys sharing
        one hash value (each would be compared with all the others: quadratic)."""
        h = self._key_hash(key)
        self._spend(48)
        if len(container) < 32:
            return
        entry = self._collisions.get(id(container))
        if entry is None or entry[0] is not container:
            entry = self._collisions[id(container)] = (container, {})
        counts = entry[1]
        c = counts.get(h, 0) + 1
        if c > MAX_HASH_COLLISIONS:
            raise PickleLimitError(
                f"more than {MAX_HASH_COLLISIONS} keys of one {type(container).__name__} share the hash value {h} "
                "(a hash-collision attack: building it would take quadratic time)")
        counts[h] = c
        self._spend(64)

    def _setitem(self, d: Any, key: Any, value: Any) -> None:
        if not isinstance(d, dict):
            raise pickle.UnpicklingError(f"SETITEM on a {type(d).__name__}, not a dict")
        self._admit(d, key)
        d[key] = value  # dict's own __setitem__ (looked up on the type, never on the instance)

    def _add(self, s: set[Any], item: Any) -> None:
        self._admit(s, item)
        set.add(s, item)

    def _load_setitem(self) -> None:
        stack = self.stack
        value = stack.pop()
        key = stack.pop()
        self._setitem(stack[-1], key, value)

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError("SETITEMS with an odd number of items")
        d = self.stack[-1]
        for i in range(0, len(items), 2):
            self._setitem(d, items[i], items[i + 1])

    def _load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError("DICT with an odd number of items")
        self._spend(64)
        d: dict[Any, Any] = {}
        for i in range(0, len(items), 2):
            self._setitem(d, items[i], items[i + 1])
        self.append(d)

    def _load_append(self) -> None:
        value = self.stack.pop()
        target = self.stack[-1]
        if type(target) is not list:
            raise pickle.UnpicklingError(f"APPEND to a {type(target).__name__}, not a list")
        self._spend(8)
        list.append(target, value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not list:
            raise pickle.UnpicklingError(f"APPENDS to a {type(target).__name__}, not a list")
        self._spend(8 * len(items))
        list.extend(target, items)

    def _load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            raise pickle.UnpicklingError(f"ADDITEMS to a {type(target).__name__}, not a set")
        for item in items:
            self._add(target, item)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        self._spend(216)
        out: set[Any] = set()
        for item in items:
            self._add(out, item)
        self.append(frozenset(out))

    def _load_tuple(self) -> None:
        items = self.pop_mark()
        self._spend(40 + 8 * len(items))
        self.append(tuple(items))

    def _load_list(self) -> None:
        items = self.pop_mark()
        self._spend(56 + 8 * len(items))
        self.append(items)

    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset
    dispatch[pickle.TUPLE[0]] = _load_tuple
    dispatch[pickle.LIST[0]] = _load_list
    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8
    for _code in (pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.INST, pickle.OBJ):
        dispatch[_code[0]] = _refuse
    # Every other opcode is charged what it builds (estimated at CPython's object sizes) before it runs; strings
    # and byte strings are charged their length after.
    for _op, _fn in list(dispatch.items()):
        if _fn not in (_load_setitem, _load_setitems, _load_dict, _load_append, _load_appends, _load_additems,
                       _load_frozenset, _load_tuple, _load_list):
            dispatch[_op] = _charged(_fn, _OPCODE_COST.get(_op, 16), _op in _SIZED_RESULT)
    del _op, _fn


def _safe_codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1").
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is only allowed for latin1 byte strings")
    return obj.encode("latin1")


def base_table() -> dict[str, Any]:
    """Harmless builtins and containers shared by every restricted unpickler, torch's plain values (dtypes,
    ``torch.device``, ``torch.Size``) as the torch-free stand-ins of :mod:`ckptaudit.formats.pickle.torch_values`, and
    NumPy's arrays, scalars and dtypes (:func:`~ckptaudit.formats.pickle.numpy_values.numpy_table`, made on demand)."""
    table: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "_codecs.encode": _safe_codecs_encode,
    }
    # (Protocol 2, torch.save's default, spells them __builtin__.set etc.: see global_name.)
    table.update({"builtins.set": set, "builtins.frozenset": frozenset, "builtins.complex": complex,
                  "builtins.slice": slice})
    table.update(torch_values_table())
    table[NUMPY_ON_DEMAND] = numpy_table  # numpy_table() itself when a pickle names NumPy (find_class)
    return table
