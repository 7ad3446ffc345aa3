from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import cpu_features
from configurations import Written, fixture_launch
from shared_fixtures import build_once, worker_id

# CKPTAUDIT_TEST_CPU=avx2: this machine as a CPU without oneDNN's fp16/bf16 kernels (see cpu_features.py). Set
# before anything in this process starts oneDNN; every process the tests start inherits it.
try:
    CPU_PROFILE = cpu_features.apply()
except (ValueError, RuntimeError) as exc:
    raise pytest.UsageError(str(exc)) from None

# DeepSpeed JIT-compiles one C++ op at first use into TORCH_EXTENSIONS_DIR (default: one directory per user, shared
# by every checkout, each of which would rebuild it over the others' build with its own source paths): one per
# interpreter instead, compiled once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.path.expanduser("~"), ".cache", "ckptaudit-torch-extensions",
    hashlib.blake2b(sys.prefix.encode(), digest_size=6).hexdigest()))

# DeepSpeed runs on the CPU everywhere in the suite (its writers, and its converters and schedulers in this process):
# without this it probes for accelerators at import and warns.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Every JSON report the suite renders, here or in a child process, is validated against the shipped schema
# (ckptaudit/schema/report.schema.json) before it is returned.
os.environ["CKPTAUDIT_VALIDATE_REPORTS"] = "1"

FSDP_FAST: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "torch.distributed.fsdp", "fsdp_jobs")}


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints from one real 2-rank FSDP2 run (bf16 MixedPrecisionPolicy), saved every way the tests need.

    Read-only: a test that damages a checkpoint copies it first (see ``copy_of``).
    """
    out, info = build_once(tmp_path_factory, "fsdp", lambda out: fixture_launch(
        "fsdp_run", _jobs().write_variants, 2, (str(out), 6), timeout_s=240, **FSDP_FAST)[0], wait_s=WRITER_SETUP_S)
    return {"dir": out, **info}


@pytest.fixture(scope="session")
def fsdp_low_precision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank FSDP2 run with bf16 masters by design (the model cast to bf16 before ``fully_shard``), saved
    the documented way: its own launch, so that neither run's failure takes the other's tests with it."""
    def build(out: Path) -> None:
        fixture_launch("fsdp_low_precision", _jobs().write_low_precision, 2, (str(out), 6), timeout_s=240,
                       **FSDP_FAST)

    out, _ = build_once(tmp_path_factory, "fsdp-low-precision", build, wait_s=WRITER_SETUP_S)
    return out / "low-precision-masters"


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
    mode, seed = config.stash[_ORDER] = _file_order()
    if mode == "random" and not worker_id():
        # pytest-xdist's workers (started after this, with this environment) must collect in the same order.
        os.environ["CKPTAUDIT_TEST_ORDER"] = f"random:{seed}"


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [cpu_features.describe()]
    mode, seed = config.stash[_ORDER]
    if mode != "default":
        lines.append(f"test file order: {mode}" + (f" (CKPTAUDIT_TEST_ORDER=random:{seed} repeats it)"
                                                   if seed is not None else ""))
    return lines


WRITER_FIXTURES = frozenset({"ds", "hf", "ckpts", "fsdp_run", "fsdp_low_precision", "megatron", "titan", "dcp_jobs",
                             "hf_story", "lightning_story", "deepspeed_story", "deepspeed_zero_story",
                             "torchtitan_story"})
"""Session (and module) fixtures whose setup launches a library's writer under deadlines of its own (``fixture_launch``'s
``timeout_s``, ``lib_writers.run_writer``'s 850 s): pytest-timeout counts a fixture's setup in the first test
that uses it, so such tests get :data:`WRITER_SETUP_S` more than the suite's per-test timeout. A hang is still
a failure: the writer's own deadline ends it first, naming the configuration."""
WRITER_SETUP_S = 900


def _lengthen_writer_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    base = float(config.getini("timeout") or 0)
    if base <= 0:
        return
    for item in items:
        if WRITER_FIXTURES.intersection(getattr(item, "fixturenames", ())) and item.get_closest_marker(
                "timeout") is None:
            item.add_marker(pytest.mark.timeout(base + WRITER_SETUP_S))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import random

    _lengthen_writer_timeouts(config, items)
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
def ds(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """The checkpoints DeepSpeed itself writes (``lib_writers.py deepspeed``: ZeRO stages 0-3, 2 CPU ranks), once
    per session, shared by test_libs_deepspeed.py and the hostile DeepSpeed tests. Read-only. Every
    configuration is its own 2-rank launch: ``ds / "s2-fp16"`` skips where DeepSpeed refuses fp16 on this CPU
    (its accelerator's ``is_fp16_supported()``, oneDNN's), and fails naming it if its launch failed."""
    pytest.importorskip("deepspeed")
    import lib_writers

    out, _ = build_once(tmp_path_factory, "deepspeed", lambda out: str(lib_writers.run_writer("deepspeed", str(out))),
                        wait_s=WRITER_SETUP_S)
    return Written(out, "deepspeed")


@pytest.fixture(scope="session")
def scale_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One training state with multi-chunk tensors as torch.save, single-process DCP and safetensors (model),
    written once (see ``real_checkpoints.chunked_checkpoints``). Read-only."""
    from real_checkpoints import chunked_checkpoints

    _, paths = build_once(tmp_path_factory, "chunked",
                          lambda out: {k: str(v) for k, v in chunked_checkpoints(out).items()}, wait_s=WRITER_SETUP_S)
    return {k: Path(v) for k, v in paths.items()}


# ---------------------------------------------------------------------------------------------------------------
# The hostile-input tests (test_hostile.py, test_hostile_views_and_bounds.py): one clean checkpoint of each format per module,
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
