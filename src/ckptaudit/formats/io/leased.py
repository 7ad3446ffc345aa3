"""Reading a data file's bytes straight from the page cache, without the risk a plain memory map carries.

Hashing a chunk where it lies in the page cache (a memory map) instead of copying it into a buffer first
(``os.preadv``) lets the scan keep up with the disk cache: 1.3-1.6x the chunks per second on two cores
(bench/README.md, "Hashing where the bytes lie"). A plain map is unsafe for a checker: if another process truncates the file while a
thread reads its mapped pages, the read raises ``SIGBUS`` and the process dies (no finding, no report), and an
I/O error on a page does the same where ``pread`` would return ``EIO``.

:class:`LeasedFile` closes both holes on Linux:

- **Truncation**: a chunk is read from the map only while this process holds a *read lease* on the file
  (``fcntl(F_SETLEASE, F_RDLCK)``). The kernel grants one only when nobody has the file open for writing, and
  makes any later open for writing, ``truncate`` or ``O_TRUNC`` wait until the lease is given back (or
  ``/proc/sys/fs/lease-break-time``, 45 s by default, has passed). The lease is held only while at least one
  thread is inside a chunk, and no thread starts a chunk once a break is pending, so a writer waits for at most
  the chunks in flight (under a millisecond each). The lease-break notice is ``SIGURG``, whose default action is
  to ignore it (the default ``SIGIO`` would kill the process); the mapped path is not taken when this process
  has a Python handler of its own for ``SIGURG``.
- **I/O errors**: each chunk's pages are faulted in with ``madvise(MADV_POPULATE_READ)`` (Linux 5.14) first,
  which returns the error instead of raising ``SIGBUS``; such a chunk is then read with ``pread``, whose error
  becomes the tensor's finding as before.

Where a lease cannot be had (another user's file, a network filesystem without leases, a file open for
writing, another OS, an old kernel, a lease-break time under :data:`MIN_LEASE_BREAK_SECONDS`) every chunk is read with ``pread`` as before: the same bytes, the same
hash, slower. The one case left: if this process is stopped (``Ctrl-Z``, a debugger) for longer than the
lease-break time in the middle of a chunk while another process truncates the file, the kernel takes the lease
back and the stopped read faults when it resumes. ``CKPTAUDIT_MAPPED_READS=0`` turns the mapped path off.

Thread-safety: one :class:`LeasedFile` per open data file, shared by the scanning threads (a lock guards the
lease count; the reads themselves run in parallel). The page-table work (``MADV_POPULATE_READ`` before a chunk,
``MADV_DONTNEED`` after it) is about as much CPU as hashing the chunk, and ``mmap.madvise`` does it holding the
GIL, so that two scanning threads took turns at it; it goes through libc's ``madvise`` by ``ctypes``, which
releases the GIL for the call (:func:`madvise`), wherever ``ctypes`` and NumPy (for the map's address) load.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys
import threading
from typing import Any

__all__ = ["MIN_MAPPED_BYTES", "LeasedFile", "madvise", "map_address", "mapped_reads_enabled"]

_F_SETSIG = 10  # Linux's fcntl commands (F_LINUX_SPECIFIC_BASE = 1024); the fcntl module lacks some
_F_SETLEASE = 1024
_F_GETLEASE = 1025
_MADV_POPULATE_READ = 22
MIN_MAPPED_BYTES = 256 << 10
"""Chunks smaller than this are read with ``pread``: the lease and ``madvise`` calls would cost more than the
copy they save."""


MIN_LEASE_BREAK_SECONDS = 5
"""The kernel takes a lease back after ``/proc/sys/fs/lease-break-time`` seconds (45 by default) whether or not
the holder gave it back; below this a chunk read slowly (cold pages on a slow disk) could outlast it."""


_LIBC_MADVISE: Any = None
"""libc's ``madvise`` through ``ctypes`` (``False``: not available here), loaded on first use."""


def _libc_madvise() -> Any:
    global _LIBC_MADVISE
    if _LIBC_MADVISE is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _LIBC_MADVISE = fn
        except (ImportError, OSError, AttributeError):  # no ctypes or no libc symbol: mmap.madvise, with the GIL
            _LIBC_MADVISE = False
    return _LIBC_MADVISE


def madvise(mapped: mmap.mmap, address: int | None, start: int, length: int, advice: int) -> None:
    """``mapped.madvise(advice, start, length)``, without the GIL where ``address`` (of the map's first byte) is
    known: the call through ``ctypes`` releases it, ``mmap.madvise`` holds it for the whole page-table walk.
    Raises ``OSError`` as ``mmap.madvise`` does, ``ValueError`` for a start outside the map; a range past its end
    is cut at the end, as ``mmap.madvise`` cuts it."""
    fn = _libc_madvise()
    if address is None or not fn:
        mapped.madvise(advice, start, length)
        return
    if start < 0 or start >= len(mapped) or length < 0:  # mmap.madvise's checks, and its clipping below
        raise ValueError(f"madvise range {start}+{length} outside the map of {len(mapped)} bytes")
    if fn(address + start, min(length, len(mapped) - start), advice) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def map_address(mapped: mmap.mmap) -> tuple[int, Any] | None:
    """The address of ``mapped``'s first byte and the object that holds it (keep it while the address is used;
    drop it before closing the map), or ``None`` where NumPy is not loaded (then ``madvise`` holds the GIL)."""
    if "numpy" not in sys.modules:  # the scan of large tensors loads it; this module does not load it alone
        return None
    import numpy as np

    held = np.frombuffer(mapped, dtype=np.uint8)
    return int(held.ctypes.data), held


def mapped_reads_enabled() -> bool:
    """Whether this process may read chunks through leased maps at all: Linux, leases enabled with a break time
    of at least :data:`MIN_LEASE_BREAK_SECONDS`, ``SIGURG`` left to its default (or ignored), and not switched
    off with ``CKPTAUDIT_MAPPED_READS=0``."""
    if sys.platform != "linux" or os.environ.get("CKPTAUDIT_MAPPED_READS", "1") == "0":
        return False
    import signal  # here: a small audit maps nothing

    try:
        if signal.getsignal(signal.SIGURG) not in (signal.SIG_DFL, signal.SIG_IGN):
            return False
        with open("/proc/sys/fs/leases-enable") as fh:
            if fh.read().strip() != "1":
                return False
        with open("/proc/sys/fs/lease-break-time") as fh:  # how long a writer waits for us, in seconds
            return int(fh.read().strip()) >= MIN_LEASE_BREAK_SECONDS
    except (OSError, ValueError):
        return False


class LeasedFile:
    """Chunks of one data file, read through a shared read-only map under a read lease (see the module's doc).

    ``fd``: a descriptor of the file opened read-only, owned by the caller, open for as long as this object is.
    :meth:`view` gives a chunk's bytes or ``None`` (read that chunk with ``pread``); every view given must be
    handed back with :meth:`done`, which releases it, before the next chunk of this thread.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._users = 0  # threads inside a chunk: the lease is held while this is above zero
        self._off = False  # the mapped path failed once for this file: pread from now on
        self._map: mmap.mmap | None = None
        self._bytes: memoryview | None = None
        self._address: int | None = None
        self._held: Any = None  # what keeps the map's address valid to hand to libc (map_address)
        self.mapped = 0
        """Chunks read through the map so far (for tests and benchmarks)."""

    def view(self, pos: int, n: int) -> memoryview | None:
        """The ``n`` bytes at ``pos``, readable until :meth:`done`; ``None`` where they must be read with
        ``pread`` (no lease, a break pending, past the end of the file or of the map, a page that fails)."""
        if self._off or n < MIN_MAPPED_BYTES:
            return None
        with self._lock:
            if not self._enter(pos + n):
                return None
        assert self._map is not None and self._bytes is not None
        lo = pos - pos % mmap.PAGESIZE
        try:
            madvise(self._map, self._address, lo, pos + n - lo, _MADV_POPULATE_READ)
        except (OSError, ValueError):  # an I/O error on a page, or no MADV_POPULATE_READ: pread reports it
            self._off = True
            self._leave(pos, n)
            return None
        return self._bytes[pos : pos + n]

    def done(self, view: memoryview, pos: int) -> None:
        """Hand back ``view`` (of :meth:`view` at ``pos``), releasing it: its pages leave this process's resident
        set and, when no other thread is inside a chunk, the lease is given back."""
        n = len(view)
        try:
            view.release()
        except BufferError:  # an array on it lives on in a traceback being raised: nothing reads it any more
            pass
        self._leave(pos, n)

    def _enter(self, end: int) -> bool:
        """(lock held) Join the threads inside a chunk ending at ``end``, taking the lease if nobody holds it."""
        fd = self._fd
        try:
            if self._users == 0:
                if self._map is None:
                    size = os.fstat(fd).st_size
                    if size == 0:
                        self._off = True
                        return False
                    self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                    self._bytes = memoryview(self._map)
                    found = map_address(self._map)
                    if found is not None:
                        self._address, self._held = found
                # Before every lease, not once per map: the break signal belongs to the open file description,
                # and one without it (a descriptor number re-opened or dup2'd over) would get SIGIO, which kills.
                import signal  # imported by mapped_reads_enabled: a dictionary look-up here

                fcntl.fcntl(fd, _F_SETSIG, int(signal.SIGURG))
                fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
            if fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK:
                # A writer is waiting: let the chunks in flight finish, start none, and never take the lease
                # again (taking it back between chunks could keep the writer waiting for the whole scan).
                self._off = True
                if self._users == 0:
                    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
                return False
            mapped = self._map
            assert mapped is not None
            if end > len(mapped) or end > os.fstat(fd).st_size:  # grown or shrunk since: pread tells
                if self._users == 0:
                    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
                return False
        except OSError as exc:
            # EAGAIN: open for writing somewhere; EACCES: not our file; EINVAL/ENOLCK: no leases here.
            if exc.errno != errno.EAGAIN:
                self._off = True
            if self._users == 0:  # a lease taken before the call that failed must not keep a writer waiting
                try:
                    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
                except OSError:
                    pass
            return False
        self._users += 1
        self.mapped += 1
        return True

    def _leave(self, pos: int, n: int) -> None:
        assert self._map is not None
        lo = pos - pos % mmap.PAGESIZE
        try:
            madvise(self._map, self._address, lo, pos + n - lo, mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # best effort: the pages are reclaimable anyway
            pass
        with self._lock:
            self._users -= 1
            if self._users == 0:
                try:
                    fcntl.fcntl(self._fd, _F_SETLEASE, fcntl.F_UNLCK)
                except OSError:
                    pass

    def close(self) -> None:
        """Unmap (after every view was handed back)."""
        self._address = self._held = None
        if self._bytes is not None:
            self._bytes.release()
            self._bytes = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still alive somewhere: the GC unmaps it
                pass
            self._map = None
