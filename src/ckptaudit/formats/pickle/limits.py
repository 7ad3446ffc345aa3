"""The limits a pickle is read within, shared by the opcode scan (:mod:`ckptaudit.formats.pickle.scan`) and the
restricted unpickler (:mod:`ckptaudit.formats.pickle.unpickler`), and the errors that name them."""

from __future__ import annotations

import pickle

__all__ = [
    "BUILD_BUDGET_BASE",
    "BUILD_BUDGET_CAP",
    "BUILD_BUDGET_FACTOR",
    "CALL_BUDGET_FACTOR",
    "MAX_DEPTH",
    "MAX_HASH_COLLISIONS",
    "MAX_INLINE",
    "MAX_KEY_NODES",
    "MAX_LINE",
    "MAX_NODES",
    "MAX_OPCODES",
    "MAX_STACK",
    "PickleLimitError",
    "UnsafeBuildError",
    "UnsafeGlobalError",
    "build_budget",
    "opcode_limit",
]

# --------------------------------------------------------------------------------------------------------------
# Limits. Real checkpoints stay far below them; a hostile pickle meets them long before it can exhaust memory or
# time. Hitting one is reported as a finding naming the limit, never a crash.

MAX_OPCODES = 5_000_000
"""Opcodes walked per pickle read from a stream (a plain pickle file, the legacy ``torch.save`` format); a pickle
read whole may have more (:func:`opcode_limit`). Walking costs about 1 µs per opcode and loading about 2 µs; each
opcode makes at most one object (at most ~70 bytes), which bounds the memory of what a pickle can build to a few
hundred MiB."""
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
BUILD_BUDGET_FACTOR = 32
"""What the opcodes of a pickle build (containers, strings, memo entries, estimated at CPython's object sizes)
may take at most this many times the pickle's size, plus :data:`BUILD_BUDGET_BASE` (:func:`build_budget`).
Real files, by these estimates: a ``torch.save`` ``data.pkl`` 7-9x (the walk) and 15-17x (the restricted
unpickler, whose memo is a dict), a DCP ``.metadata`` 14-20x and 21-31x (their real peak in the C unpickler:
8-11x); 1-byte opcodes that each make a 216-byte empty set take 216x. At 16x the real ``.metadata`` of a
one-process save of 45k tensors or more was refused as an amplification."""
BUILD_BUDGET_BASE = 32 << 20
"""Fixed part of the build budget (bytes)."""
BUILD_BUDGET_CAP = 8 << 30
"""The largest build budget, whatever the pickle's size: the worst case is where it was at 16x (the largest
``.metadata`` accepted, 512 MiB: 8 GiB)."""


def build_budget(size: int) -> int:
    """Bytes the objects of a pickle of ``size`` bytes may take, estimated (see :data:`BUILD_BUDGET_FACTOR`)."""
    return min(BUILD_BUDGET_FACTOR * size + BUILD_BUDGET_BASE, BUILD_BUDGET_CAP)


def opcode_limit(size: int) -> int:
    """Opcodes walked in an in-memory pickle of ``size`` bytes (a DCP ``.metadata``, a ``torch.save``
    ``data.pkl``): :data:`MAX_OPCODES`, or as many as it has bytes where that is more (every opcode takes at least
    one), so no real file is refused for its count: its size is the bound (``dcp.MAX_METADATA_BYTES``,
    ``zip.archive.MAX_PICKLE_BYTES``).

    A fixed count refused the saves of large jobs: a real ``.metadata`` holds 70-110 opcodes per tensor shard
    (the realistic benchmark's 8-rank save: 535,239 for 7301 shards), so the earlier 20,000,000 stopped at about
    200-270k shards, which a 70B model with Adam state reaches on about 128 ranks; a ``data.pkl`` holds 20-30 per
    tensor, so 5,000,000 stopped at a ``torch.save`` of ~200k tensors (a mixture-of-experts model's full state).
    The walk's cost follows the bytes instead: 0.21 us a byte of a real file, at most 0.57 us for the slowest
    crafted opcodes (about 3x: a crafted 512 MiB ``.metadata`` takes minutes to refuse, as a real one that size
    takes minutes to audit), and its memo at most 8 bytes an opcode (within :func:`build_budget`).
    """
    return max(MAX_OPCODES, size)


MAX_HASH_COLLISIONS = 64
"""Keys of one dict (or items of one set) that may share one hash value, past the first 32 entries: real
checkpoints have none; 200k integer keys that all hash alike would make building the dict quadratic."""
MAX_KEY_NODES = 256
"""Most nodes of one dict key or set item (a tuple of tuples): hashing a tuple walks it every time."""

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

