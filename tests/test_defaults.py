"""Defaults that had no test (each was broken on purpose once and the suite stayed green): a scheduler step is an
update for plain SGD, a live optimizer over two float dtypes declares each parameter's, not the majority's, empty items spread
evenly over auditing ranks, and the coalesced remote read stops at its size cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.auditing.judge import run_audit


def _plain_sgd(path: Path, steps: int) -> Path:
    """Plain SGD (no momentum: it keeps no state) and a StepLR scheduler, ``steps`` steps taken, the weights
    saved through a bf16 copy (the defect); no train step recorded: only the scheduler says whether updates ran."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    for _ in range(steps):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {k: v.bfloat16().float() for k, v in model.state_dict().items()}
    torch.save({"model": state, "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path)
    return path


def test_plain_sgd_whose_scheduler_stepped_once_is_past_the_first_update(tmp_path: Path) -> None:
    codes = {n: {f.code: f.severity for f in run_audit(str(_plain_sgd(tmp_path / f"sgd{n}.pt", n))).findings}
             for n in (0, 1)}
    # Scheduler at step 0, no optimizer state: bf16-representable weights may be the initial ones (a warning).
    assert codes[0].get("precision.before-first-update") == "warning" and "precision.bf16-rounded" not in codes[0]
    # One scheduler step: an update ran, so rounded weights are the defect, not an initialisation.
    assert codes[1].get("precision.bf16-rounded") == "error" and "precision.before-first-update" not in codes[1]


def test_a_live_optimizer_over_two_float_dtypes_declares_no_majority_contract() -> None:
    from ckptaudit.integrations.guard import Guard
    from ckptaudit.integrations.live_contract import declare_live_contract, live_master_dtype, live_master_dtypes

    def optimizer(fp32: int, bf16: int) -> Any:
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(fp32)]
        params += [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)) for _ in range(bf16)]
        return torch.optim.AdamW(params)

    # Each parameter's master is its own dtype: a single contract for all of them (the majority's) would call the
    # minority's masters wrong, or excuse them; each parameter's dtype is declared instead, in the groups' order.
    assert live_master_dtype(optimizer(3, 1)) is None
    assert live_master_dtype(optimizer(1, 3)) is None
    assert live_master_dtype(optimizer(2, 0)) == ("float32", "AdamW steps 2 float32 parameter tensor(s)")
    assert live_master_dtype(optimizer(0, 2)) == ("bfloat16", "AdamW steps 2 bfloat16 parameter tensor(s)")
    assert live_master_dtypes(optimizer(2, 0)) is None
    assert live_master_dtypes(optimizer(1, 2)) == (("float32", "bfloat16", "bfloat16"),
                                                   "AdamW steps 2 bfloat16 and 1 float32 parameter tensor(s)")
    guard = Guard(background="thread")
    try:
        declare_live_contract(guard, optimizer(3, 1))
        assert guard.audit_options.get("master_dtype", "auto") == "auto"
        assert guard.audit_options["master_dtypes"] == ["float32"] * 3 + ["bfloat16"]
        assert guard.audit_options["master_dtype_from"].startswith("the live run: AdamW steps 1 bfloat16 and 3")
    finally:
        guard.close()


def test_empty_items_are_spread_evenly_over_the_auditing_ranks() -> None:
    from ckptaudit.auditing.distributed import partition

    # Each empty tensor still costs an open and a read: ten of them over four ranks are 3, 3, 2, 2, not ten on one.
    assert sorted(len(s) for s in partition(dict.fromkeys(range(10), 0), 4)) == [2, 2, 3, 3]
    # Beside large items too: the empty ones go to the ranks with the least bytes, one each in turn.
    sizes = {0: 1000, 1: 1000, **dict.fromkeys(range(2, 8), 0)}
    shares = partition(sizes, 2)
    assert [len(s) for s in shares] == [4, 4] and {0, 1} not in [set(s) for s in shares]


class _CountingMemoryFs:
    """fsspec's in-memory filesystem, counting the bytes of each ranged read."""

    def __init__(self) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        self.fs = MemoryFileSystem(skip_instance_cache=True)
        self.reads: list[int] = []

    def cat_file(self, path: str, start: int, end: int) -> bytes:
        self.reads.append(end - start)
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def cat_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        return [self.cat_file(p, s, e) for p, s, e in zip(paths, starts, ends, strict=True)]


def test_the_coalesced_remote_read_is_capped_at_8_mib(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    from ckptaudit.formats.remote.objects import COALESCE_BYTES, RemoteFiles, RemoteObject

    mib = 1 << 20
    counting = _CountingMemoryFs()
    blob = bytes(range(256)) * (20 * mib // 256)
    counting.fs.pipe_file("/bucket/data.distcp", blob)
    files = RemoteFiles(str(tmp_path))
    local = str(tmp_path / "data.distcp")
    files.add(local, RemoteObject(counting, "/bucket/data.distcp", len(blob)))
    # Twelve neighbouring 1 MiB tensors: one read of 8 MiB (the cap), then one of the 4 left; never one of 12.
    with files.prefetched([(local, k * mib, mib) for k in range(12)]) as reads:
        assert reads == 2 and counting.reads == [8 * mib, 4 * mib] and COALESCE_BYTES == 8 * mib
        buf = bytearray(mib)
        assert files.read_into(local, memoryview(buf), 9 * mib) == mib and bytes(buf) == blob[9 * mib : 10 * mib]
    assert counting.reads == [8 * mib, 4 * mib]  # served from the prefetched blocks, no further read
