from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.dist.launch import launch

# Every JSON report the suite renders, here or in a child process, is validated against the shipped schema
# (ckptaudit/schema/report.schema.json) before it is returned.
os.environ["CKPTAUDIT_VALIDATE_REPORTS"] = "1"


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints from one real 2-rank FSDP2 run (bf16 MixedPrecisionPolicy), saved every way the tests need.

    Read-only: a test that damages a checkpoint copies it first (see ``copy_of``).
    """
    out = tmp_path_factory.mktemp("fsdp")
    fast: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "torch.distributed.fsdp", "fsdp_jobs")}
    info = launch(_jobs().write_variants, 2, (str(out), 6), timeout_s=240, **fast)[0]
    launch(_jobs().write_low_precision, 2, (str(out), 6), timeout_s=240, **fast)
    return {"dir": out, **info}


def _jobs() -> Any:
    import fsdp_jobs

    return fsdp_jobs


@pytest.fixture
def copy_of(tmp_path: Path):  # type: ignore[no-untyped-def]
    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        return dst

    return copy
