"""How :func:`ckptaudit.auditing.scan.scan_items` shares a checkpoint's tensors between threads: large tensors largest
first, small ones (up to :data:`~ckptaudit.auditing.scan.BATCH_BYTES`) in batches, the first thread on the batches
while the others stream the large tensors; the outcomes are those of one thread, whatever the schedule.

The checkpoint is a real ``torch.save`` of a training-like state (many small biases and step counters, a few
multi-chunk weights, one of them rounded to bf16), written once for the module. Which thread scanned what is
seen through the ``progress`` callback, which the scanning threads call after each unit of work.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from ckptaudit.auditing.plan import plan_scan
from ckptaudit.auditing.scan import BATCH_BYTES, BATCH_COUNT, ScanOutcome, scan_items
from ckptaudit.auditing.tensor_scan import scan_tensor
from ckptaudit.findings import Precision

CHUNK = 16 << 10
"""Chunk size of these scans: the large tensors span several chunks."""


def _state(small: int, large: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {}
    for i in range(large):
        sd[f"w{i}"] = torch.randn(96 + 32 * i, 1024, generator=g) * 0.02  # 384 KiB and up: many chunks
    sd["w0"] = sd["w0"].bfloat16().float()  # a rounded one: the precision evidence must survive the schedule
    for i in range(small):
        sd[f"b{i}"] = torch.randn(16, generator=g) * 0.02
        sd[f"step{i}"] = torch.tensor(float(i))
    return sd


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``torch.save`` of 6 large tensors and 2 x 700 small ones (several batches)."""
    import torch

    path = tmp_path_factory.mktemp("schedule") / "mixed.pt"
    torch.save(_state(small=700, large=6), path)
    return path


@pytest.fixture(scope="module")
def only_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``torch.save`` of small tensors only, more than one batch's worth of bytes and count."""
    import torch

    g = torch.Generator().manual_seed(1)
    path = tmp_path_factory.mktemp("schedule") / "small.pt"
    torch.save({f"t{i}": torch.randn(4096, generator=g) for i in range(4 * BATCH_COUNT)}, path)  # 16 KiB each
    return path


def _scan(path: Path, jobs: int, progress: Any = None, *,
          quick: bool = False) -> tuple[dict[int, ScanOutcome], dict[int, tuple[str, int]]]:
    """Outcomes, and each scannable item's (name, bytes)."""
    plan = plan_scan(str(path))
    try:
        indices = plan.scannable()
        items = {i: (plan.items[i][0].name, plan.nbytes(i)) for i in indices}
        _DATA.clear()
        _DATA.update({id(plan.items[i][0].data): i for i in indices})
        return scan_items(plan, indices, jobs=jobs, chunk_bytes=CHUNK, progress=progress, quick=quick), items
    finally:
        plan.close()


_DATA: dict[int, int] = {}
"""The last scan's tensors: item index by ``id`` of its data (what ``scan_tensor`` is given)."""


class _FirstScans:
    """Notes, through a profile hook on the scanning threads (``threading.setprofile``), the first tensor each
    thread passes to ``scan_tensor``, and holds each there until ``meet`` threads have arrived: so the test sees
    that they scanned at the same time. If no second thread ever scans, the wait times out, the hook raises
    ``BrokenBarrierError`` inside the scan, and the scan raises it."""

    def __init__(self, meet: int) -> None:
        self.barrier = threading.Barrier(meet, timeout=30)
        self.first: dict[str, int] = {}
        """Thread name -> index of the first item it scanned."""

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code is not scan_tensor.__code__:
            return
        name = threading.current_thread().name
        if name not in self.first:
            self.first[name] = _DATA[id(frame.f_locals["data"])]
            self.barrier.wait()

    def __enter__(self) -> _FirstScans:
        threading.setprofile(self)  # threads started from now on
        return self

    def __exit__(self, *exc: object) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]


def test_any_number_of_threads_gives_the_outcomes_of_one(mixed: Path) -> None:
    one, items = _scan(mixed, 1)
    assert sum(n <= BATCH_BYTES for _, n in items.values()) > 2 * BATCH_COUNT  # several batches
    assert sum(n > 4 * CHUNK for _, n in items.values()) == 6  # multi-chunk large tensors
    sd = _state(small=700, large=6)
    for i, (name, _) in items.items():
        want = xxhash.xxh3_128(np.ascontiguousarray(sd[name.split("/")[-1]].numpy()).tobytes()).hexdigest()
        assert one[i].scan is not None and one[i].scan.hash == want, name
    assert {o.scan.precision for o in one.values() if o.scan} == {Precision.BF16, Precision.EXACT,
                                                                   Precision.INCONCLUSIVE}  # steps 0, 1, 2...
    for jobs in (2, 3, 8):
        many, _ = _scan(mixed, jobs)
        assert many == one, jobs
    quick, _ = _scan(mixed, 1, quick=True)  # the in-loop mode: first chunk only, no hash
    assert all(o.scan is not None and o.scan.hash is None for o in quick.values())
    assert _scan(mixed, 3, quick=True)[0] == quick


def test_small_tensors_are_shared_between_threads(only_small: Path) -> None:
    """A checkpoint of small tensors only: the second thread takes batches too (none is left to one thread)."""
    one, _ = _scan(only_small, 1)
    with _FirstScans(meet=2) as seen:
        two, _ = _scan(only_small, 2)
    assert two == one
    assert sorted(seen.first) == ["ckptaudit-scan-0", "ckptaudit-scan-1"]


def test_one_thread_takes_the_small_tensors_while_another_streams_the_largest(mixed: Path) -> None:
    with _FirstScans(meet=2) as seen:
        outcomes, items = _scan(mixed, 2)
    assert len(outcomes) == len(items)
    first_small = min(i for i, (_, n) in items.items() if n <= BATCH_BYTES)
    largest = max(items, key=lambda i: items[i][1])
    assert seen.first == {"ckptaudit-scan-0": first_small, "ckptaudit-scan-1": largest}


def test_an_error_in_the_progress_callback_stops_every_thread_and_is_raised(mixed: Path) -> None:
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        raise RuntimeError(f"progress bar broke at {done} of {total}")

    with pytest.raises(RuntimeError, match="progress bar broke at"):
        _scan(mixed, 3, progress=progress)
    assert 1 <= len(calls) <= 3  # each thread stops after the unit it was on: not one more
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptaudit-scan")]


def test_progress_rises_to_the_total_one_call_at_a_time(mixed: Path) -> None:
    calls: list[tuple[int, int]] = []
    inside = threading.Lock()

    def progress(done: int, total: int) -> None:
        assert inside.acquire(blocking=False), "two progress calls at once"
        try:
            calls.append((done, total))
        finally:
            inside.release()

    _, items = _scan(mixed, 4, progress=progress)
    total = sum(n for _, n in items.values())
    done = [d for d, _ in calls]
    assert done == sorted(done) and len(set(done)) == len(done)
    assert done[-1] == total and {t for _, t in calls} == {total}
    assert len(calls) == 6 + -(-1400 // BATCH_COUNT)  # one call per large tensor, one per batch
