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


# ---------------------------------------------------------------------------------------------------------------
# File order. CKPTAUDIT_TEST_ORDER=reverse runs the test files last-first, =random (or random:SEED) in a shuffled
# order whose seed is printed in the header; the tests inside a file keep their order. CI runs the suite once in
# reversed file order (.ci/run), so that no test passes only because another file ran before it.


def _file_order() -> tuple[str, int | None]:
    import os
    import random

    value = os.environ.get("CKPTAUDIT_TEST_ORDER", "").strip()
    if value in ("", "default"):
        return "default", None
    if value == "reverse":
        return "reverse", None
    if value == "random" or value.startswith("random:"):
        seed = value.partition(":")[2]
        return "random", int(seed) if seed else random.SystemRandom().randrange(1 << 31)
    raise pytest.UsageError(f"CKPTAUDIT_TEST_ORDER={value!r}: use reverse, random or random:SEED")


_ORDER = pytest.StashKey[tuple[str, "int | None"]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_ORDER] = _file_order()


def pytest_report_header(config: pytest.Config) -> str | None:
    mode, seed = config.stash[_ORDER]
    if mode == "default":
        return None
    return f"test file order: {mode}" + (f" (CKPTAUDIT_TEST_ORDER=random:{seed} repeats it)" if seed is not None else "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import random

    mode, seed = config.stash[_ORDER]
    if mode == "default":
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    order = list(files)
    if mode == "reverse":
        order.reverse()
    else:
        random.Random(seed).shuffle(order)
    items[:] = [item for f in order for item in files[f]]


@pytest.fixture(scope="session")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints DeepSpeed itself writes (``lib_writers.py deepspeed``: ZeRO stages 0-3, 2 CPU ranks), once
    per session, shared by test_libs_deepspeed.py and the hostile DeepSpeed tests. Read-only."""
    pytest.importorskip("deepspeed")
    import lib_writers

    out = tmp_path_factory.mktemp("deepspeed")
    lib_writers.run_writer("deepspeed", str(out))
    return out


@pytest.fixture(scope="session")
def scale_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One training state with multi-chunk tensors as torch.save, single-process DCP and safetensors (model),
    written once (see ``real_checkpoints.chunked_checkpoints``). Read-only."""
    from real_checkpoints import chunked_checkpoints

    return chunked_checkpoints(tmp_path_factory.mktemp("chunked"))


# ---------------------------------------------------------------------------------------------------------------
# The hostile-input tests (test_hostile.py, test_hostile2.py): one clean checkpoint of each format per module,
# and a warm audit worker (a child under an address-space cap) that audits damaged copies of them.


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import real_checkpoints as rc

    d = tmp_path_factory.mktemp("bases")
    return {
        "pt": rc.torch_save_checkpoint(d / "ckpt.pt"),
        "dcp": rc.dcp_checkpoint(d / "dcp"),
        "st": rc.safetensors_file(d / "model.safetensors"),
    }


@pytest.fixture(scope="module")
def worker(bases: dict[str, Path]):  # type: ignore[no-untyped-def]
    from audit_worker import AuditWorker

    w = AuditWorker(headroom_mib=1536, timeout_s=90)
    w.start([str(bases["pt"]), str(bases["dcp"]), str(bases["st"])])
    yield w
    w.close()
