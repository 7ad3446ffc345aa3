"""Where users already are: the store's loader (``require_passport``), ``ckptaudit.testing``'s assertion, ``latest
--require passport`` and the serving export's passport.

Run: ``.venv/bin/python -m pytest -q tests/passport/test_passport_commands.py``
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptaudit.ondisk.passport import PASSPORT_NAME, passport_path
from ckptaudit.passport import attest, read_passport
from ckptaudit.recipes.tinygpt import plain_recipe
from ckptaudit.store import CheckpointLoadError, load_checkpoint, save_checkpoint
from ckptaudit.testing import PassportFailed, assert_passport_verifies
from store_jobs import CTX, one_thread, trained  # noqa: F401  (one_thread: the fixture pytestmark uses)

pytestmark = pytest.mark.usefixtures("one_thread")


def _flip(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(path.stat().st_size // 2)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run root holding step-000002 (attested) and step-000004 (no passport)."""
    root = tmp_path_factory.mktemp("run")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = trained(2)
        save_checkpoint(job, root)
        attest(str(root / "step-000002"))
        plain_recipe.step(job)
        plain_recipe.step(job)
        save_checkpoint(job, root)
    finally:
        torch.set_num_threads(before)
    return root


def test_the_loader_requires_a_passport_that_verifies(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    with pytest.raises(CheckpointLoadError, match=r"require_passport: .*no passport"):
        load_checkpoint(trained(0), root, require_passport=True)  # the newest, step-000004, has none
    attest(str(root / "step-000004"))
    loaded = load_checkpoint(trained(0), root / "step-000004", require_passport=True)
    assert loaded.step == 4
    data = max((root / "step-000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(data)
    with pytest.raises(CheckpointLoadError, match=rf"{data.name}: its bytes differ"):
        load_checkpoint(trained(0), root / "step-000004", require_passport=True)


def test_assert_passport_verifies(saved: Path, tmp_path: Path) -> None:
    result = assert_passport_verifies(saved / "step-000002")
    assert result.ok and result.signature == "unsigned"
    with pytest.raises(PassportFailed, match=r"passport\.missing") as err:
        assert_passport_verifies(saved / "step-000004")
    assert err.value.result is not None and not err.value.result.ok
    copy = tmp_path / "step-000002"
    shutil.copytree(saved / "step-000002", copy)
    (copy / "extra.bin").write_bytes(b"x")
    with pytest.raises(PassportFailed, match=r"extra\.bin: in the copy, not attested"):
        assert_passport_verifies(copy)
    (copy / PASSPORT_NAME).write_text("{")
    with pytest.raises(PassportFailed, match="not valid JSON"):
        assert_passport_verifies(copy)


def test_latest_require_passport(saved: Path, tmp_path: Path) -> None:
    from ckptaudit.latest import find_latest

    root = tmp_path / "run"
    shutil.copytree(saved, root)
    assert find_latest(str(root)).latest.name == "step-000004"  # type: ignore[union-attr]
    result = find_latest(str(root), require=["passport"])
    assert result.latest is not None and result.latest.name == "step-000002"
    assert any(f.code == "passport.missing" for f in result.checked[0].findings)
    attest(str(root / "step-000004"))
    assert find_latest(str(root), require=["passport"]).latest.name == "step-000004"  # type: ignore[union-attr]
    _flip(max((root / "step-000004").glob("*.distcp"), key=lambda p: p.stat().st_size))
    result = find_latest(str(root), require=["passport"])
    assert result.latest is not None and result.latest.name == "step-000002"


def test_cli_latest_require_passport(saved: Path) -> None:
    import io

    from ckptaudit.cli import main

    out = io.StringIO()
    code = main(["latest", str(saved), "--require", "passport", "--no-progress"], stdout=out, stderr=io.StringIO())
    assert code == 0 and "step-000002" in out.getvalue() and "passport.missing" in out.getvalue(), out.getvalue()
    assert read_passport(passport_path(str(saved / "step-000002"))).verdict == "pass"
