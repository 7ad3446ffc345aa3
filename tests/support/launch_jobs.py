"""Rank bodies for the tests of ``ckptaudit.launch`` itself (importable by name, as spawn requires): ranks
that die the ways a real rank dies (glibc's heap check, a segmentation fault, a hang) after saying something on
their standard error."""

from __future__ import annotations

import ctypes
import os
import time

import torch.distributed as dist

from ckptaudit.launch import RankContext


def say(ctx: RankContext, text: str) -> int:
    """(all ranks) Write ``text`` to file descriptor 2 as C code would (no trailing newline on rank 1), return."""
    os.write(2, f"{text} from rank {ctx.rank}".encode() + (b"\n" if ctx.rank == 0 else b""))
    return ctx.rank


def bad_free_on_rank_1(ctx: RankContext) -> None:
    """(2 ranks) Rank 1 hands glibc's ``free`` a pointer it never allocated: glibc aborts the process with its own
    message, as it does on heap corruption. Rank 0 waits for rank 1 in a collective and sees its peer vanish."""
    if ctx.rank == 1:
        os.write(2, b"rank 1 is about to free a pointer malloc never returned\n")
        not_from_malloc = ctypes.create_string_buffer(64)
        ctypes.CDLL(None).free(ctypes.c_void_p(ctypes.addressof(not_from_malloc) + 16))
    dist.barrier()


def segfault_on_rank_0(ctx: RankContext) -> None:
    """(2 ranks) Rank 0 reads address 0 (SIGSEGV) from a named function; rank 1 waits in a collective."""
    if ctx.rank == 0:
        _read_address_zero()
    dist.barrier()


def _read_address_zero() -> None:
    ctypes.string_at(0)


def hang_on_rank_1(ctx: RankContext, seconds: float) -> None:
    """(2 ranks) Rank 1 sleeps outside any collective for ``seconds``; rank 0 returns at once."""
    if ctx.rank == 1:
        _stuck_here(seconds)


def _stuck_here(seconds: float) -> None:
    time.sleep(seconds)


def abort_inside_a_configuration(ctx: RankContext) -> None:
    """(2 ranks) Rank 1 dies by SIGABRT while writing configuration ``s2-fp16``; rank 0 raises inside
    ``faithful.pt``."""
    from configurations import configuration

    if ctx.rank == 1:
        with configuration("s2-fp16"):
            os.abort()
    with configuration("faithful.pt"):
        dist.barrier()
