"""Work that grew faster than the input (issue 25), held to the input's size structurally: what a pickle shares
through its memo is converted once, by the safe loaders as by the audit."""

from __future__ import annotations

import pickle
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import xxhash

import real_checkpoints as rc
from ckptaudit.formats.dcp.reader import check_metadata_safe
from ckptaudit.formats.io.tensors import Piece, tiling_error
from hostile_cases import column_chunks_dcp, shared_chunks_dcp


def test_chunk_lists_shared_through_the_memo_are_converted_once_for_torch(tmp_path: Path) -> None:
    """3000 tensor entries share one list of 3000 chunks (one BINGET each: a few hundred KB of .metadata, 9M
    chunks expanded). vetted_dcp_reader hands torch the metadata with that sharing kept, as torch's own
    pickle.load of the file would: one list, 3000 chunk objects, not 9M (which took ~2 minutes and GBs)."""
    import torch

    from ckptaudit.formats.torchload import vetted_dcp_reader

    n = 3000
    ckpt = shared_chunks_dcp(tmp_path / "ckpt", n)
    assert (ckpt / ".metadata").stat().st_size < 400_000
    check_metadata_safe(str(ckpt))  # nothing unsafe in it: the loader goes on to convert it
    vetted = vetted_dcp_reader(str(ckpt)).read_metadata()
    items = [vetted.state_dict_metadata[f"t{j}"] for j in range(n)]
    assert all(item.chunks is items[0].chunks for item in items)  # one list, as in torch's own reading
    assert len({id(c) for item in items for c in item.chunks}) == n
    assert [(c.offsets, c.sizes) for c in items[0].chunks] == [(torch.Size([i]), torch.Size([1])) for i in range(n)]
    theirs = rc.read_dcp_metadata(ckpt)  # torch's plain unpickle of this (our own) file shares it the same way
    assert theirs.state_dict_metadata["t0"].chunks is theirs.state_dict_metadata[f"t{n - 1}"].chunks


# Tiling of chunks (issue 36): decided once per tensor, in time linear in the chunks


def lines_run(fn: Any, *args: Any) -> int:
    """Python lines executed by ``fn(*args)``: a count of the work done, the same on any machine at any load."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def _columns(n: int) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    return (1, n), tuple(Piece("f", 0, 0, (1, 1), (1, 1), (0, i)) for i in range(n))


def _grid(k: int) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    return (k, k), tuple(Piece("f", 0, 0, (1, 1), (1, 1), (i, j)) for i in range(k) for j in range(k))


def _random_tiling(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A random exact tiling of ``shape`` by guillotine cuts: (offsets, sizes) boxes."""
    boxes = [((0,) * len(shape), shape)]
    for _ in range(rng.randint(0, 6)):
        i = rng.randrange(len(boxes))
        offs, sizes = boxes[i]
        d = rng.randrange(len(shape))
        if sizes[d] < 2:
            continue
        cut = rng.randint(1, sizes[d] - 1)
        a = (offs, (*sizes[:d], cut, *sizes[d + 1:]))
        b = ((*offs[:d], offs[d] + cut, *offs[d + 1:]), (*sizes[:d], sizes[d] - cut, *sizes[d + 1:]))
        boxes[i:i + 1] = [a, b]
    return boxes


def test_the_tiling_check_agrees_with_counting_every_element() -> None:
    import numpy as np

    rng = random.Random(36)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        boxes = _random_tiling(rng, shape)
        if rng.random() < 0.7:  # move, grow, duplicate or drop one box
            i = rng.randrange(len(boxes))
            offs, sizes = boxes[i]
            d = rng.randrange(len(shape))
            how = rng.choice(("move", "grow", "dup", "drop", "swap"))
            if how == "move":
                boxes[i] = ((*offs[:d], offs[d] + rng.choice((-1, 1)), *offs[d + 1:]), sizes)
            elif how == "grow":
                boxes[i] = (offs, (*sizes[:d], sizes[d] + 1, *sizes[d + 1:]))
            elif how == "dup":
                boxes.append(boxes[i])
            elif how == "drop" and len(boxes) > 1:
                boxes.pop(i)
            elif how == "swap" and len(boxes) > 1:  # same volumes, one box moved onto another's place
                j = (i + 1) % len(boxes)
                boxes[i] = (boxes[j][0], sizes)
        pieces = tuple(Piece("f", 0, 0, s, (1,) * len(s), o) for o, s in boxes)
        counts = np.zeros(shape, dtype=np.int64)
        inside = all(0 <= o and o + s <= n for b in boxes for o, s, n in zip(*b, shape, strict=True))
        if inside:
            for o, s in boxes:
                counts[tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))] += 1
        exact = inside and bool((counts == 1).all())
        assert (tiling_error(shape, pieces) is None) == exact, (shape, boxes, tiling_error(shape, pieces))
        seen[exact] += 1
    assert min(seen.values()) > 500, seen


@pytest.mark.parametrize("build", [_columns, _grid], ids=["columns", "grid"])
def test_the_tiling_check_grows_linearly_with_the_chunks(build: Any) -> None:
    sizes = (1600, 6400) if build is _columns else (40, 80)  # 1,600 and 6,400 chunks either way
    work = []
    for n in sizes:
        shape, pieces = build(n)
        assert tiling_error(shape, pieces) is None
        work.append(lines_run(tiling_error, shape, pieces))
    assert work[1] < 5 * work[0], work  # 4x the chunks: ~4x the work (pairwise: 16x)
    shape, pieces = build(sizes[0])
    moved = (*pieces[:-1], Piece("f", 0, 0, (1, 1), (1, 1), pieces[0].offsets))
    assert "overlap" in (tiling_error(shape, moved) or "")


def test_the_tiling_is_decided_once_per_tensor_by_the_whole_audit(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.formats.io import tensors

    calls: list[int] = []
    real = tensors.tiling_error

    def counted(shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> str | None:
        calls.append(len(pieces))
        return real(shape, pieces)

    monkeypatch.setattr(tensors, "tiling_error", counted)
    report = run_audit(str(column_chunks_dcp(tmp_path / "cols", 300)))
    assert calls == [300], calls  # the reader, the scan and the reads ask; it is decided once
    (rec,) = report.tensors
    assert rec.name == "w" and rec.hash is not None


def test_ten_thousand_column_chunks_audit_within_a_small_multiple_of_dcp_load(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptaudit.auditing.judge import run_audit

    n = 10_000
    ckpt = column_chunks_dcp(tmp_path / "cols", n)
    start = time.perf_counter()
    report = run_audit(str(ckpt))
    audit_s = time.perf_counter() - start
    assert not [f for f in report.findings if f.code.startswith(("integrity.", "security."))], report.findings
    state = {"w": torch.zeros(1, n)}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)  # our own .metadata: plain pickle is fine
    load_s = time.perf_counter() - start
    assert bool((state["w"] == 0.5).all())
    (rec,) = report.tensors
    raw = state["w"].contiguous().view(torch.uint8).numpy().tobytes()
    assert rec.hash == xxhash.xxh3_128_hexdigest(raw)  # the audit hashed what dcp.load loads
    assert audit_s < 3 * load_s + 2, (audit_s, load_s)  # measured: 0.2x at load 11 (pairwise: 151 s at 5,000)


def test_items_naming_a_directory_are_reported_in_linear_time(tmp_path: Path) -> None:
    """Storage entries that name a directory, beside many that escape the checkpoint: each directory reported
    once, without scanning the findings for it per entry (that was quadratic)."""
    from ckptaudit.formats.dcp.reader import read_dcp

    def build(n: int) -> Path:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

        root = tmp_path / f"dir-items-{n}"
        (root / "sub").mkdir(parents=True)
        sd: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for i in range(n):
            sd[f"b{i}"] = BytesStorageMetadata()
            storage[MetadataIndex(f"b{i}")] = _StorageInfo("sub" if i % 2 else "../escape", i, 1)
        del torch
        (root / ".metadata").write_bytes(pickle.dumps(Metadata(sd, None, storage)))
        return root

    work = []
    for n in (1000, 4000):
        root = build(n)
        read = read_dcp(str(root))
        assert len([f for f in read.findings if f.subject == "sub"]) == 1
        work.append(lines_run(read_dcp, str(root)))
    assert work[1] < 5 * work[0], work


def test_compare_finds_moment_sources_in_linear_time() -> None:
    """A candidate whose optimizer moments all differ from their own parameter's, among thousands of same-shape
    layers: each looks for an equal reference moment by its hash (a lookup), never by scanning every same-shape
    moment (that was quadratic)."""
    from ckptaudit.comparing.matching import Entry
    from ckptaudit.comparing.pairs import Pair, find_moment_sources
    from ckptaudit.formats.io.tensors import DTYPES, FileMaps, TensorData

    def run(n: int) -> tuple[int, list[Pair]]:
        data = TensorData(DTYPES["float32"], (4,), (Piece("f", 0, 0, (4,), (1,), (0,)),))
        refs = [Entry(("optimizer", f"p{i}", "exp_avg"), "optimizer", f"p{i}", "tensor", "exp_avg", f"p{i}", data,
                      hash=f"h{i}") for i in range(n)]
        # the candidate's moment of p{i} equals the reference's of p{i+1} for half; the rest equal nothing
        pairs = [Pair(r.key, r, Entry(r.key, "optimizer", r.name, "tensor", "exp_avg", r.param, data,
                                      hash=f"h{(i + 1) % n}" if i % 2 else f"x{i}"), "different")
                 for i, r in enumerate(refs)]
        with FileMaps() as maps:
            work = lines_run(lambda: find_moment_sources(pairs, refs, maps, maps, 1 << 20, max_value_checks=0))
        return work, pairs

    small, _ = run(400)
    large, pairs = run(1600)
    assert large < 5 * small, (small, large)
    found = [p for p in pairs if p.source is not None]
    assert len(found) == 800 and all(p.source is not None and p.source[1] == "identical" for p in found)
    assert all(p.source is not None and p.source[0].param != p.key[1] for p in found)
