"""The pairs' one pass (``ckptaudit.comparing.pairs``): two tensors of one dtype, each one run of bytes in a local
file, are hashed together, window by window where their bytes lie in the page cache, the first chunks' digests
deciding the route. Held here to the general route (``CKPTAUDIT_MAPPED_READS=0``: positional reads, a bitwise probe
of the first chunks, then each side hashed) and to the audit's own hashes, on real torch.save files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.api import audit
from ckptaudit.auditing.tensor_scan import MAPPED_CHUNK_BYTES
from ckptaudit.comparing import run_compare
from ckptaudit.comparing.matching import entries_of, open_side
from ckptaudit.comparing.pairs import classify
from ckptaudit.formats.io.leased import mapped_reads_enabled
from ckptaudit.formats.io.tensors import DEFAULT_CHUNK_BYTES

BIG = 17 * 262144 - 3
"""fp32 elements: 12 bytes short of 17 MiB: after the first chunk, two windows (the second short); hashed whole from
the start, as the general route hashes, it would take three."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    ref = {"big": torch.randn(BIG, generator=g), "small": torch.randn(100, generator=g),
           "mid": torch.randn(300_000, generator=g), "head": torch.randn(BIG // 4, generator=g),
           "tail": torch.randn(BIG // 4, generator=g), "rounded": torch.randn(1024, 512, generator=g),
           "bf16": torch.randn(1024, 256, generator=g).bfloat16(), "view": torch.randn(64, 64, generator=g).t()}
    cand = {k: v.clone() for k, v in ref.items()}
    cand["head"][0] += 1  # differs in the first chunk
    cand["tail"][-1] += 1  # differs in its last bytes only: equal first chunks, different digests
    cand["rounded"] = ref["rounded"].bfloat16().float()
    cand["bf16"] = ref["bf16"].float()  # another dtype: the general route
    out = tmp_path_factory.mktemp("pairs")
    torch.save({"model": ref}, out / "ref.pt")
    torch.save({"model": cand}, out / "cand.pt")
    return out / "ref.pt", out / "cand.pt"


def _pairs(ref: Path, cand: Path) -> dict[str, dict[str, Any]]:
    report = run_compare(str(ref), str(cand))
    return {p["key"]: p for p in report.extra["pairs"]}


def test_the_one_pass_gives_the_general_routes_statuses_and_hashes(pair: tuple[Path, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if not mapped_reads_enabled():
        pytest.skip("leased maps are not available here: both runs would take the general route")
    fast = _pairs(*pair)
    monkeypatch.setenv("CKPTAUDIT_MAPPED_READS", "0")
    general = _pairs(*pair)
    assert fast == general
    assert {k.split("/")[-1]: p["status"] for k, p in fast.items()} == {
        "big": "identical", "small": "identical", "mid": "identical", "head": "different", "tail": "different",
        "rounded": "bf16-rounded", "bf16": "equal-values", "view": "identical"}


def test_the_one_pass_hashes_as_the_audit_does(pair: tuple[Path, Path]) -> None:
    pairs = _pairs(*pair)
    for path, side in zip(pair, ("reference", "candidate"), strict=True):
        audited = {t["name"].split("/")[-1].split(".")[-1]: t["hash"] for t in audit(str(path)).to_dict()["tensors"]}
        compared = {k.split("/")[-1]: p[side]["hash"] for k, p in pairs.items() if (p.get(side) or {}).get("hash")}
        assert compared and compared == {k: audited[k] for k in compared}, side


def test_an_identical_pair_is_read_once_through_the_maps_and_a_differing_one_no_further_than_its_first_chunk(
        pair: tuple[Path, Path]) -> None:
    if not mapped_reads_enabled():
        pytest.skip("leased maps are not available here")
    ref, cand = open_side(str(pair[0])), open_side(str(pair[1]))
    try:
        rents, cents = entries_of(ref), entries_of(cand)
        key = {k[-1]: k for k in rents}
        windows = 1 + -(-(BIG * 4 - DEFAULT_CHUNK_BYTES) // MAPPED_CHUNK_BYTES)  # the first chunk, then windows
        for name, mapped in (("big", windows), ("head", 1)):
            before = ref.ckpt.maps.mapped_chunks(), cand.ckpt.maps.mapped_chunks()
            p = classify(key[name], rents[key[name]], cents[key[name]], ref.ckpt.maps, cand.ckpt.maps,
                         DEFAULT_CHUNK_BYTES)
            assert p.status == ("identical" if name == "big" else "different")
            after = ref.ckpt.maps.mapped_chunks(), cand.ckpt.maps.mapped_chunks()
            assert (after[0] - before[0], after[1] - before[1]) == (mapped, mapped), name
    finally:
        ref.close()
        cand.close()
