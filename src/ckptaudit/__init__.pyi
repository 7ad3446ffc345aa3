# The typed surface of the package root (``__init__.py`` resolves these lazily, from ckptaudit.api). The keyword
# parameters are those of the option table, ckptaudit.options (AUDIT_OPTIONS, COMPARE_OPTIONS): names, types and
# defaults; tests/test_options.py holds this file to it.
import os
from collections.abc import Iterable
from typing import Literal

from ckptaudit import load as load
from ckptaudit.api import Report as Report

__version__: str
__all__: list[str]

def audit(
    path: str | os.PathLike[str],
    *,
    master_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    expect: Literal["training", "serving"] = "training",
    require: str | Iterable[str] = (),
    master_dtype_from: str = "",
    master_dtypes: Iterable[str] = (),
    fail_on: Literal["error", "warning", "info"] = "error",
    ignore: str | Iterable[str] = (),
    quick: bool = False,
    run_evidence: bool = True,
    jobs: int | None = None,
    chunk_bytes: int = 1048576,
) -> Report: ...
def compare(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    *,
    fail_on: Literal["error", "warning", "info"] = "error",
    ignore: str | Iterable[str] = (),
    jobs: int | None = None,
    threads: int | None = None,
    chunk_bytes: int = 1048576,
    max_moment_checks: int = 256,
) -> Report: ...
