"""``manifest.json``: what a committed checkpoint of :mod:`ckptaudit.store` holds, and its verification.

The coordinator writes it after every rank has written, fsynced and hashed its files, and before the
commit (the rename). It records:

- ``files``: every file of the checkpoint but itself, with its size and xxh3-128 (``.metadata`` included);
- ``tensors``: per tensor, the dtype and global shape, and per stored shard its offsets, sizes, place in the
  file (``file``, ``offset``, ``length``), the xxh3-128 of its stored bytes and of its values
  (``content_xxh3_128``, the hash :class:`~ckptaudit.findings.TensorRecord` uses, computed from the tensor in
  memory before it was written);
- ``objects``: the same for non-tensor items (scheduler fields, step, per-rank RNG and data progress);
- ``components``: the inventory the writer saved (model, optimizer, scheduler, rng, data-progress, step,
  extras), with the DCP key holding each;
- ``contract``: the master-dtype contract read from the live objects (parameter dtypes, optimizer state
  dtypes), which ``ckptaudit audit`` holds the parameters to;
- ``step``, ``world_size``, ``torch_version``, ``ckptaudit_version``, ``hash_algorithm``.

Pure: reading and hashing files, no torch.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import xxhash

from ckptaudit.catalogue import finding
from ckptaudit.findings import HASH_ALGORITHM, Finding
from ckptaudit.formats.io.safeio import LimitExceeded, open_regular

ReadInto = Callable[[str, memoryview, int], int]
"""``read_into(path, buf, offset) -> bytes read``: a positional reader of files by path."""

__all__ = [
    "FORMAT",
    "VERSION",
    "ManifestError",
    "hash_file",
    "is_manifest",
    "read_manifest",
    "verify_files",
]

FORMAT = "ckptaudit-checkpoint"
VERSION = 1
HASH_BLOCK = 1 << 20
MAX_MANIFEST_BYTES = 256 << 20


class ManifestError(Exception):
    """A ``manifest.json`` that cannot be read or does not follow the schema; the message says where."""


def hash_file(path: str, ranges: Sequence[tuple[int, int]] = (), read_into: ReadInto | None = None,
              ) -> tuple[int, str, list[str | None]]:
    """``(size, xxh3-128 of the whole file, xxh3-128 of each (offset, length) range)``.

    One sequential pass when the ranges do not overlap (DCP items never do): each 1 MiB block feeds the file's
    hash and, while still in cache, its item's. A range that does not fit inside the file gets ``None``.

    The file is read with positional reads into one reused buffer, never mapped: resident memory stays at one
    block whatever the file's size, and holes of a sparse file (an 8 GiB file of 4 KiB) are fed as zeros
    without being read (``SEEK_DATA``). Regular files only, opened without blocking.

    ``read_into(path, buf, offset)``, when given, reads the bytes instead (every byte, holes included): a URL's
    stand-in file, whose bytes are in the object store (:meth:`ckptaudit.formats.io.tensors.FileMaps.read_into`).
    """
    with open_regular(path) as fh:
        return _hash_fd(fh.fileno(), ranges, None if read_into is None else functools.partial(read_into, path))


def _hash_fd(fd: int, ranges: Sequence[tuple[int, int]], read: Any = None) -> tuple[int, str, list[str | None]]:
    size = os.fstat(fd).st_size
    whole = xxhash.xxh3_128()
    parts: list[str | None] = [None] * len(ranges)
    valid = sorted((off, length, i) for i, (off, length) in enumerate(ranges)
                   if off >= 0 and length >= 0 and off + length <= size)
    disjoint = all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(valid))
    if size == 0:
        for _, _, i in valid:
            parts[i] = xxhash.xxh3_128().hexdigest()
        return 0, whole.hexdigest(), parts
    reader = _BlockReader(fd, size, read)
    if disjoint:
        pos = 0
        for off, length, i in valid:
            reader.feed(pos, off, whole)
            item = xxhash.xxh3_128()
            reader.feed(off, off + length, whole, item)
            parts[i] = item.hexdigest()
            pos = off + length
        reader.feed(pos, size, whole)
    else:
        reader.feed(0, size, whole)
        for off, length, i in valid:
            item = xxhash.xxh3_128()
            reader.feed(off, off + length, item)
            parts[i] = item.hexdigest()
    return size, whole.hexdigest(), parts


class _BlockReader:
    """Feeds byte ranges of one file to hashers, a block at a time, through one reused buffer."""

    _ZEROS = bytes(HASH_BLOCK)

    def __init__(self, fd: int, size: int, read: Any = None) -> None:
        self.fd, self.size, self.read = fd, size, read
        self.buf = bytearray(HASH_BLOCK)
        self.data_from = -1  # holes: [pos, data_from) is known to read as zeros (local files only)

    def _next_data(self, pos: int) -> int:
        seek_data = getattr(os, "SEEK_DATA", None)
        if seek_data is None:
            return pos
        try:
            return os.lseek(self.fd, pos, seek_data)
        except OSError as exc:  # ENXIO: only a hole from pos to the end; anything else: read it all
            return self.size if exc.errno == errno.ENXIO else pos

    def feed(self, start: int, stop: int, *hashers: Any) -> None:
        view = memoryview(self.buf)
        pos = start
        while pos < stop:
            n = min(HASH_BLOCK, stop - pos)
            if pos >= self.data_from and self.read is None:
                self.data_from = self._next_data(pos)
            if pos < self.data_from:  # inside a hole: zeros, not read
                n = min(n, self.data_from - pos)
                chunk: Any = memoryview(self._ZEROS)[:n]
            else:
                got = os.preadv(self.fd, [view[:n]], pos) if self.read is None else self.read(view[:n], pos)
                if got <= 0:
                    raise OSError(f"read of {n} bytes at {pos} returned {got} (the file shrank)")
                n = got
                chunk = view[:n]
            for h in hashers:
                h.update(chunk)
            pos += n


def is_manifest(value: Any) -> bool:
    """Whether a parsed JSON value is one of our manifests (other tools also write ``manifest.json``)."""
    return isinstance(value, dict) and value.get("format") == FORMAT


def read_manifest(path: str) -> dict[str, Any]:
    """Read and check ``path`` (a ``manifest.json``); :class:`ManifestError` says what is wrong."""
    from ckptaudit.formats.io.safejson import read_json_limited  # here: an audit without a manifest reads no JSON

    try:
        # Regular files only, opened without blocking (a FIFO or /dev/zero as manifest.json never hangs `latest`),
        # size and shape bounded before parsing.
        value = read_json_limited(path, MAX_MANIFEST_BYTES, path)
    except LimitExceeded as exc:
        raise ManifestError(f"{path}: {exc}; more than any manifest this tool writes") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:  # not JSON, past a nesting or container limit
        raise ManifestError(str(exc)) from None
    problem = schema_problem(value)
    if problem:
        raise ManifestError(f"{path}: {problem}")
    return value  # type: ignore[no-any-return]


def schema_problem(value: Any) -> str | None:
    """What makes ``value`` not a usable manifest, or ``None``. Checks only what verification relies on."""
    if not is_manifest(value):
        return f"not a {FORMAT} manifest (no \"format\": \"{FORMAT}\")"
    if value.get("version") != VERSION:
        return f"manifest version {value.get('version')!r}; this ckptaudit reads version {VERSION}"
    if value.get("hash_algorithm") != HASH_ALGORITHM:
        return f"hash algorithm {value.get('hash_algorithm')!r}; expected {HASH_ALGORITHM}"
    files = value.get("files")
    if not isinstance(files, dict) or not files:
        return "\"files\" is missing or empty"
    for name, entry in files.items():
        if not _plain_name(name):
            return f"file name {name!r} is not a plain name inside the checkpoint directory"
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(
            entry.get("xxh3_128"), str
        ):
            return f"files[{name!r}] lacks an integer size or an xxh3_128 string"
    for key in ("tensors", "objects", "components", "contract"):
        if not isinstance(value.get(key), dict):
            return f"\"{key}\" is missing or not an object"
    if not isinstance(value.get("step"), int) or not isinstance(value.get("world_size"), int):
        return "\"step\" or \"world_size\" is missing or not an integer"
    return None


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def _offset(value: Any) -> int:
    """An offset or length from a manifest entry; ``-1`` (not hashed) for anything but a plain integer."""
    return value if type(value) is int else -1


def items_by_file(manifest: Mapping[str, Any]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Stored items (tensor shards and objects) grouped by the file holding them: ``file -> [(label, entry)]``."""
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for fqn, tensor in manifest.get("tensors", {}).items():
        shards = tensor.get("shards") if isinstance(tensor, dict) else None
        if not isinstance(shards, list):  # malformed entries are skipped, never raised
            continue
        for shard in shards:
            if isinstance(shard, dict) and isinstance(shard.get("file"), str):
                label = fqn if len(shards) == 1 else f"{fqn} (shard at {shard.get('offsets')})"
                out.setdefault(shard["file"], []).append((label, shard))
    for fqn, obj in manifest.get("objects", {}).items():
        if isinstance(obj, dict) and isinstance(obj.get("file"), str):
            out.setdefault(obj["file"], []).append((fqn, obj))
    return out


def verify_files(directory: str, manifest: Mapping[str, Any], *, hashes: bool = True,
                 only: Iterable[str] | None = None, subject_prefix: str = "",
                 read_into: ReadInto | None = None) -> list[Finding]:
    """Check the files ``manifest`` records against ``directory``: present, of their size, of their hash.

    A missing or shorter file is ``integrity.incomplete``; a longer one or one whose hash differs is
    ``integrity.corrupt``, naming the stored items whose bytes changed. ``hashes=False`` checks sizes only;
    ``only`` restricts the check to some files (ranks share the hashing at load time). ``read_into``: see
    :func:`hash_file`.
    """
    findings: list[Finding] = []
    files: dict[str, Any] = dict(manifest["files"])
    wanted = set(only) if only is not None else None
    by_file = items_by_file(manifest) if hashes else {}
    for name in sorted(files):
        if wanted is not None and name not in wanted:
            continue
        entry = files[name]
        subject = subject_prefix + name
        full = os.path.join(directory, name)
        real_dir = os.path.realpath(directory)
        if os.path.commonpath([real_dir, os.path.realpath(full)]) != real_dir:
            findings.append(finding("integrity.path-escape", subject, f"{name} is a link leading outside "
                                    f"{directory}; not read", file=name))
            continue
        if not os.path.isfile(full):
            findings.append(finding("integrity.incomplete", subject,
                                    f"{name} is recorded in the manifest ({entry['size']} bytes) but missing",
                                    file=name, expected_size=entry["size"]))
            continue
        size = os.path.getsize(full)
        if size != entry["size"]:
            code = "integrity.incomplete" if size < entry["size"] else "integrity.corrupt"
            what = "truncated" if size < entry["size"] else "longer than written"
            findings.append(finding(code, subject, f"{name} has {size} bytes, the manifest records "
                                    f"{entry['size']}: {what}", file=name, size=size, expected_size=entry["size"]))
            continue
        if not hashes:
            continue
        items = by_file.get(name, [])
        ranges = [(_offset(e.get("offset")), _offset(e.get("length"))) for _, e in items]
        try:
            _, digest, item_digests = hash_file(full, ranges, read_into)
        except (OSError, ValueError) as exc:
            findings.append(finding("integrity.corrupt", subject, f"{name}: cannot read to verify its hash ({exc})",
                                    file=name))
            continue
        if digest == entry["xxh3_128"]:
            continue
        changed = [label for (label, e), d in zip(items, item_digests, strict=True) if d != e.get("xxh3_128")]
        detail = (f"; changed item(s): {', '.join(changed[:5])}" + (f" and {len(changed) - 5} more"
                                                                      if len(changed) > 5 else "")
                  if changed else "")
        findings.append(finding("integrity.corrupt", subject,
                                f"{name}: content differs from the manifest (xxh3-128 {digest[:16]}…, recorded "
                                f"{entry['xxh3_128'][:16]}…){detail}", file=name, changed_items=changed,
                                xxh3_128=digest, expected_xxh3_128=entry["xxh3_128"]))
    return findings
