"""A checkpoint's digests: its files, as OpenSSF model-signing's file serialization digests them, and its tensors,
layout-independent.

**Files.** model-signing 1.1.1 (``model_signing.hashing.Config().use_file_serialization``) digests every regular file
under the model path (a single file is named ``.``), relative ``/``-separated names, minus its ignored paths (the
git ones always, ``.git .gitignore .gitattributes .github``, and the ones the signature records); its in-toto
statement's subject is one root digest: SHA-256 over the raw file digests, in the order of the names' parts
(``pathlib.PurePosixPath`` order, which is not plain string order). Its verifier accepts ``sha256`` and ``blake3``
(``blake2`` signs, but 1.1.1's own verifier refuses what it wrote: "Unsupported hashing method blake2b"), so those
are the two :data:`FILE_ALGORITHMS`. Symbolic links are refused, as model-signing's default refuses them.

**Tensors.** Each tensor's digest is of its logical values: the bytes of its elements in row-major order, as the
dtype's little-endian words, read through the same chunked reader the audit's scan hashes (``iter_chunks``), so
the digest is the same whichever files, shards, offsets or strides hold it (a DCP folder and its consolidated
``torch.save`` give the same digests). BLAKE3 where the ``blake3`` package is installed (the ``[sign]`` extra
brings it), else SHA-256; the algorithm is named in each digest.

**In the audit's own pass.** :func:`audit_digests` asks an audit for both (:mod:`ckptaudit.auditing.digesting`):
the tensors' digests from the scan's chunk loop, each chunk hashed by the audit and the digest while it is in
cache; the files' digests on threads beside the scan, each file read once in order (SHA-256 is sequential). So
``attest`` and the guards' passports read each byte from storage once and the tensor bytes from memory once;
:func:`tensor_digests` (a pass of its own) is what ``verify`` uses when a copy's files differ.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptaudit.auditing.digesting import Hasher, ScanDigests
from ckptaudit.formats.io.tensors import row_major_runs
from ckptaudit.ondisk.passport import PASSPORT_NAME, SIGNATURE_NAME, is_passport_name
from ckptaudit.passport.model import FileDigest, PassportError, TensorDigest

__all__ = ["FILE_ALGORITHMS", "GIT_PATHS", "READ_BYTES", "AuditDigests", "Hasher", "audit_digests", "digest_files",
           "file_hasher", "ignore_paths", "list_files", "root_digest", "sort_key", "stat_files", "tensor_algorithm",
           "tensor_digests"]

FILE_ALGORITHMS = ("sha256", "blake3")
"""The file-digest algorithms model-signing's verifier accepts (its ``hash_type`` names)."""
GIT_PATHS = (".git", ".gitignore", ".gitattributes", ".github")
"""What model-signing always leaves out of a model's files (and records among its ``ignore_paths``)."""
READ_BYTES = 8 << 20
"""One read of a file being digested: large enough that a read costs nothing beside hashing it."""


def file_hasher(algorithm: str, threads: int = 1) -> Hasher:
    """A new hasher of a model-signing algorithm name; ``blake3`` needs the ``blake3`` package (the ``[sign]``
    extra) and spreads one large update over ``threads`` (SHA-256 is sequential: one core per file)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            import blake3
        except ImportError:
            from ckptaudit.extras import install_line

            raise PassportError(f"digest algorithm blake3 needs the blake3 package: {install_line('sign')} (or use "
                                "--digest sha256)") from None
        h: Hasher = blake3.blake3(max_threads=max(1, threads))
        return h
    raise PassportError(f"digest algorithm {algorithm!r} is not one model-signing verifies; use one of "
                        f"{', '.join(FILE_ALGORITHMS)}")


def tensor_algorithm() -> str:
    """``blake3`` where it is installed (2-4x SHA-256's speed here, and one file spreads over cores), else
    ``sha256``: the default of the tensors' digests and of the files' (both accepted by model-signing)."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "sha256"
    return "blake3"


def ignore_paths(is_dir: bool) -> list[str]:
    """The ``ignore_paths`` ckptaudit's model-signing statement records: model-signing's own git paths and, for a
    directory, the passport and its signature (which it carries inside, :mod:`ckptaudit.ondisk.passport`)."""
    return [PASSPORT_NAME, SIGNATURE_NAME, *GIT_PATHS] if is_dir else list(GIT_PATHS)


def sort_key(name: str) -> tuple[str, ...]:
    """model-signing's order of file names (``PurePosixPath``'s: by parts, so ``a/b`` comes before ``a.b``)."""
    return tuple(p for p in name.split("/") if p not in ("", "."))


def root_digest(files: Iterable[FileDigest]) -> str:
    """model-signing's root digest (the in-toto subject): SHA-256 over the raw file digests in :func:`sort_key`
    order, ``sha256:<hex>``."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: sort_key(f.name)):
        h.update(bytes.fromhex(f.digest))
    return "sha256:" + h.hexdigest()


def _ignored(rel: str, is_dir: bool) -> bool:
    first = rel.split("/", 1)[0]
    return first in GIT_PATHS or (is_dir and "/" not in rel and is_passport_name(rel))


def list_files(path: str) -> list[tuple[str, str, int]]:
    """``(name, local path, size)`` of every file of the local checkpoint at ``path`` that its digests cover,
    sorted; a single file is named ``.``. Raises :class:`PassportError` for a symbolic link or a special file
    (model-signing refuses them too) and ``FileNotFoundError``."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return [(".", path, st.st_size)]
    if not stat.S_ISDIR(st.st_mode):
        raise PassportError(f"{path}: neither a regular file nor a directory; a passport covers only those")
    out: list[tuple[str, str, int]] = []
    for top, dirs, names in os.walk(path):
        rel_top = os.path.relpath(top, path).replace(os.sep, "/")
        prefix = "" if rel_top == "." else rel_top + "/"
        for name in sorted(dirs):
            full = os.path.join(top, name)
            if _ignored(prefix + name, True):
                dirs.remove(name)
            elif os.path.islink(full):
                raise PassportError(f"{full}: a symbolic link inside the checkpoint; a passport (like model-signing) "
                                    "covers regular files only: copy the target in, or attest the target")
        for name in names:
            rel = prefix + name
            if _ignored(rel, True):
                continue
            full = os.path.join(top, name)
            fst = os.lstat(full)
            if not stat.S_ISREG(fst.st_mode):
                what = "a symbolic link" if stat.S_ISLNK(fst.st_mode) else "not a regular file"
                raise PassportError(f"{full}: {what} inside the checkpoint; a passport (like model-signing) covers "
                                    "regular files only")
            out.append((rel, full, fst.st_size))
    return sorted(out, key=lambda t: sort_key(t[0]))


def _digest_one(path: str, algorithm: str, stop: threading.Event | None, threads: int = 1) -> tuple[str, int]:
    h = file_hasher(algorithm, threads)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PassportError(f"{path}: not a regular file")
        buf = bytearray(READ_BYTES)
        view = memoryview(buf)
        size = 0
        while True:
            if stop is not None and stop.is_set():
                raise InterruptedError("stopped")
            n = os.readv(fd, [view])
            if not n:
                break
            h.update(view[:n])  # hashlib and blake3 release the GIL on large updates: threads run in parallel
            size += n
        return h.hexdigest(), size
    finally:
        os.close(fd)


def digest_files(files: Sequence[tuple[str, str, int]], algorithm: str, *, jobs: int = 1,
                 progress: Callable[[int], None] | None = None,
                 stop: threading.Event | None = None) -> list[FileDigest]:
    """The digest of each ``(name, local path, size)`` (one streaming read of each file; ``jobs`` files at once,
    largest first). The size recorded is the bytes read. ``stop``: set, the reads end early (``InterruptedError``)."""
    file_hasher(algorithm)  # the algorithm's error before any thread starts
    order = sorted(range(len(files)), key=lambda i: -files[i][2])
    stop = stop or threading.Event()
    results: dict[int, tuple[str, int]] = {}

    big = sum(1 for f in files if f[2] >= BIG_FILE_BYTES) or 1
    threads = max(1, jobs // big)  # BLAKE3: the cores the large files leave, spread over each of them

    def one(i: int) -> None:
        results[i] = _digest_one(files[i][1], algorithm, stop, threads)
        if progress is not None:
            progress(results[i][1])

    if jobs <= 1 or len(files) <= 1:
        for i in order:
            one(i)
    else:
        with ThreadPoolExecutor(max_workers=min(jobs, len(files)), thread_name_prefix="ckptaudit-digest") as pool:
            futures = [pool.submit(one, i) for i in order]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                stop.set()
                raise
    return [FileDigest(files[i][0], results[i][0], results[i][1]) for i in range(len(files))]


def stat_files(files: Sequence[tuple[str, str, int]]) -> list[tuple[str, int, int]]:
    """``(name, size, mtime_ns)`` of each listed file now: taken before and after a passport's digests, a file
    written meanwhile (a save still running) shows."""
    out = []
    for name, full, _ in files:
        st = os.stat(full)
        out.append((name, st.st_size, st.st_mtime_ns))
    return out


BIG_FILE_BYTES = 64 << 20
"""A file this large keeps a core busy for a while: :func:`digest_files` spreads BLAKE3 over the cores the large
files leave, and :func:`audit_digests` leaves one core to each large file's SHA-256 beside the scan."""


@dataclass(frozen=True, slots=True)
class AuditDigests:
    """The digests of a local checkpoint's passport asked of its audit (:func:`audit_digests`): give
    :attr:`scan` to :func:`~ckptaudit.auditing.judge.run_audit` (``digests=``), then this to
    :func:`~ckptaudit.passport.attest` (``report=``, ``digests=``)."""

    path: str
    algorithm: str
    """The files' digest algorithm (:data:`FILE_ALGORITHMS`)."""
    files: tuple[tuple[str, str, int], ...]
    """:func:`list_files` of :attr:`path` when it was asked."""
    before: tuple[tuple[str, int, int], ...]
    """:func:`stat_files` of them then."""
    scan: ScanDigests
    """What the audit fills: the tensors' digests, and the files' (its ``beside_result``)."""

    def file_digests(self) -> list[FileDigest]:
        """The files' digests, once the audit ran; raises what computing them raised, or :class:`PassportError`
        when no audit filled :attr:`scan`."""
        if not self.scan.done:
            raise PassportError(f"{self.path}: the digests were asked of an audit that has not run; pass "
                                "digests.scan to run_audit(..., digests=) first")
        if self.scan.beside_error is not None:
            raise self.scan.beside_error
        result: list[FileDigest] = self.scan.beside_result
        return result

    def tensor_digests(self) -> list[TensorDigest]:
        """The tensors' digests the audit's scan gave (none after a quick audit: :attr:`ScanDigests.skipped`)."""
        return [TensorDigest(t.name, t.dtype, t.shape, t.digest) for t in self.scan.tensors]


def audit_digests(path: str, algorithm: str | None = None, *, jobs: int = 1) -> AuditDigests:
    """A request for the audit of the local checkpoint at ``path`` to give its passport's digests from its own pass
    (see the module docstring): the files' in ``algorithm`` (``None``: :func:`tensor_algorithm`'s), the tensors' in
    :func:`tensor_algorithm`'s. ``jobs``: the audit's threads; beside a file's SHA-256 the scan runs on one core
    fewer per large file (at least one). Raises :class:`PassportError` (an algorithm model-signing does not verify,
    a symbolic link inside) and ``FileNotFoundError``."""
    algorithm = algorithm or tensor_algorithm()
    if algorithm not in FILE_ALGORITHMS:
        raise PassportError(f"--digest {algorithm!r}: model-signing verifies {', '.join(FILE_ALGORITHMS)}")
    file_hasher(algorithm)
    files = tuple(list_files(path))
    before = tuple(stat_files(files))
    tensors = tensor_algorithm()
    big = sum(1 for f in files if f[2] >= BIG_FILE_BYTES)
    # SHA-256 is sequential: each large file's digest is one core's work from start to end, the longest path;
    # BLAKE3 spreads over whatever cores it finds.
    reserve = min(big, jobs - 1) if algorithm == "sha256" else 0

    def beside(stop: threading.Event) -> list[FileDigest]:
        return digest_files(files, algorithm, jobs=jobs, stop=stop)

    def new_hasher() -> Hasher:
        return hashlib.sha256() if tensors == "sha256" else file_hasher(tensors)

    return AuditDigests(path, algorithm, files, before, ScanDigests(tensors, new_hasher, beside, reserve))


def _hash_span(maps: Any, span: tuple[str, int, int], h: Hasher, buffer: Any) -> None:
    """Hash one run where its bytes lie in the page cache (the scan's lease-guarded map), else by positional reads
    into ``buffer``; the short-read error the scan gives."""
    path, pos, remaining = span
    leased: Any = maps.leased(path) if remaining >= (256 << 10) else None
    raw = buffer.data.cast("B")
    while remaining:
        n = min(READ_BYTES, remaining)
        view = leased.view(pos, n) if leased is not None else None
        if view is not None:
            try:
                h.update(view)
            finally:
                leased.done(view, pos)
        else:
            n = min(n, len(raw))
            got = maps.read_into(path, raw[:n], pos)
            if got != n:
                raise ValueError(f"{path}: {got} of {n} bytes at offset {pos}: the file ends early (truncated, or "
                                 "changed while being read)")
            h.update(raw[:n])
        pos += n
        remaining -= n


def tensor_digests(refs: Sequence[Any], maps: Any, *, jobs: int = 1, algorithm: str | None = None,
                   chunk_bytes: int = 4 << 20) -> tuple[list[TensorDigest], dict[str, str]]:
    """Each readable tensor's layout-independent digest (see the module docstring), and why each unreadable one has
    none. ``refs``: the audit's :class:`~ckptaudit.layouts.TensorRef` list; ``maps``: its checkpoint's file maps."""
    from ckptaudit.formats.io.tensors import TensorData, iter_chunks, scratch_buffer

    algorithm = algorithm or tensor_algorithm()
    local = threading.local()
    items = [(r.name, r.data) for r in refs if isinstance(r.data, TensorData)]

    def one(item: tuple[str, Any]) -> tuple[str, Any, str | None, str]:
        name, data = item
        h = hashlib.sha256() if algorithm == "sha256" else file_hasher(algorithm)
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = scratch_buffer(chunk_bytes)
        try:
            spans = row_major_runs(data)
            if spans is not None:  # the common case: contiguous runs, hashed in place
                for span in spans:
                    _hash_span(maps, span, h, buffer)
                return name, data, f"{algorithm}:{h.hexdigest()}", ""
            for chunk in iter_chunks(data, maps, chunk_bytes, buffer):
                flat = chunk if chunk.flags.c_contiguous else chunk.copy()
                h.update(flat.reshape(-1).view("u1").data)  # the chunk's bytes, as the audit's scan hashes them
        except (ValueError, OSError) as exc:
            return name, data, None, str(exc)
        return name, data, f"{algorithm}:{h.hexdigest()}", ""

    if jobs > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckptaudit-tensor-digest") as pool:
            done = list(pool.map(one, sorted(items, key=lambda it: -it[1].nbytes)))
    else:
        done = [one(it) for it in items]
    digests = {name: TensorDigest(name, data.dtype.name, tuple(data.shape), d)
               for name, data, d, _ in done if d is not None}
    errors = {name: why for name, _, d, why in done if d is None}
    return [digests[name] for name, _ in items if name in digests], errors
