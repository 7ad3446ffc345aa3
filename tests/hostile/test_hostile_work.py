"""Work that grew faster than the input (issue 25), held to the input's size structurally: what a pickle shares
through its memo is converted once, by the safe loaders as by the audit."""

from __future__ import annotations

from pathlib import Path

import real_checkpoints as rc
from ckptaudit.formats.dcp.reader import check_metadata_safe
from hostile_cases import shared_chunks_dcp


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
