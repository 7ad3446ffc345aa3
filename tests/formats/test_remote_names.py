"""A presigned or tokened URL is read as the object it names: the query goes with every request, the fragment
with none, and the staged copy is named by the URL's path, so the readers recognise it as they would the file
(``model.safetensors?X-Amz-Signature=...`` was ``format.unrecognized``). A real local HTTP server that refuses a
request without the signature (``http_servers.ObjectServer(query=...)``), real files of the safetensors
library."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.formats.remote.staging import ShareReader, object_name, request_url
from http_servers import ObjectServer

SIGNED = "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=600&X-Amz-Signature=0a1b%2F2c"


@pytest.fixture(scope="module")
def rounded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("signed") / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"layer.weight": torch.randn(32, 32, generator=g).bfloat16().float()}, str(path))
    return path


def _audit(target: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", target, "--format", "json", "--no-progress", "--jobs", "1"], stdout=out, stderr=err)
    assert code == 1, err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


def test_names_and_requests_of_urls() -> None:
    url = f"https://h.example/d/model.safetensors?{SIGNED}#part"
    assert request_url(url) == f"https://h.example/d/model.safetensors?{SIGNED}"
    assert object_name(url) == object_name(request_url(url)) == "model.safetensors"
    assert object_name("https://h.example/d/my%20model.pt?t=1") == "my model.pt"
    assert request_url("s3://b/k#1?v") == "s3://b/k#1?v" and object_name("s3://b/d/k#1?v") == "k#1?v"  # key chars


@pytest.mark.parametrize("suffix", [f"?{SIGNED}", f"?{SIGNED}#weights"])
def test_a_presigned_url_audits_as_the_local_file(rounded: Path, suffix: str) -> None:
    local = _audit(str(rounded))
    with ObjectServer(rounded.read_bytes(), query=SIGNED) as srv:
        remote = _audit(f"{srv.url}/bucket/model.safetensors{suffix}")
        targets = list(srv.targets)
    assert remote["format"] == "safetensors"
    assert {f["code"] for f in remote["findings"]} == {f["code"] for f in local["findings"]}
    assert "precision.bf16-rounded" in {f["code"] for f in remote["findings"]}
    assert remote["tensors"] == local["tensors"]
    # Every request carried the signature, none the fragment.
    assert targets and all(t == f"/bucket/model.safetensors?{SIGNED}" for t in targets), targets


def test_another_rank_reads_a_presigned_object_with_its_query(rounded: Path) -> None:
    with ObjectServer(rounded.read_bytes(), query=SIGNED) as srv:
        reader = ShareReader(f"{srv.url}/bucket/model.safetensors?{SIGNED}#x", single_file=True)
        try:
            view = reader.view(["model.safetensors"], digest={"model.safetensors"})
        finally:
            reader.close()
    seen = view["model.safetensors"]
    assert not isinstance(seen, str), seen
    assert seen[0] == rounded.stat().st_size
