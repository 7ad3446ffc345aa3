"""The optional dependencies, by what they enable, and the one line a user sees when one is missing.

ckptaudit is on no package index: it installs from a clone (README, "Set-up"), and every message that tells a user
to install something gives that command (:func:`install_line`). The base install (``pip install .``) is the
torch-free auditor: ``audit``, ``compare`` and ``latest`` (local paths) read
every format with their own readers (numpy, safetensors, rich, xxhash) and never import torch. The extras:

- ``[torch]``: the commands and APIs that run PyTorch (``demo``, ``probe``, ``resume-test``, ``export-serving``,
  the store's writer and loader, the guards, ``assert_resumes_faithfully``, the distributed audit under
  ``torchrun``). A torch already installed (a CUDA build, a nightly) is used as it is: pip keeps it when it
  satisfies :data:`TORCH_MIN`.
- ``[remote]``: checkpoints behind ``s3://``/``gs://`` URLs (fsspec, s3fs, gcsfs).
- ``[sign]``: signed passports (``attest --key``, ``verify --key``): OpenSSF ``model-signing`` (with ``pyOpenSSL``,
  which model-signing 1.1.1 imports without declaring it; it brings ``cryptography`` and ``blake3``).
- ``[all]``: all three.

Imports nothing of ours and nothing heavy: ``find_spec`` looks for torch without importing it.
"""

from __future__ import annotations

import importlib.util

TORCH_MIN = "2.13"
"""The oldest torch release the test suite runs on (the only one our CI machines can install: 2.13.0 CPU);
``pyproject.toml``'s ``[torch]`` extra states the same bound."""


def install_line(extra: str) -> str:
    """The command that installs ``extra`` (``torch``, ``remote``, ``sign``, ``all``), as README's install table
    gives it: from a clone of the repository (the package is on no index, so installing it by name fails)."""
    return f"pip install '.[{extra}]' in a clone of ckptaudit (it is on no package index)"


class MissingExtra(ModuleNotFoundError):
    """A feature needs an optional dependency that is not installed; the message is one line naming the extra."""


def torch_missing(what: str) -> str | None:
    """The one-line message for ``what`` (a command or an API) when torch is not installed, else None."""
    if importlib.util.find_spec("torch") is not None:
        return None
    return (f"{what} needs PyTorch, which is not installed here: {install_line('torch')}, or install your own "
            f"torch >= {TORCH_MIN} (audit, compare and latest work without it)")


def torch_older_than_tested(what: str) -> str | None:
    """A one-line warning for ``what`` when the installed torch is older than :data:`TORCH_MIN` (read from its
    metadata: torch is not imported), else None."""
    import importlib.metadata
    import re

    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if parts >= tuple(int(n) for n in TORCH_MIN.split(".")):
        return None
    return (f"{what}: torch {version} is older than {TORCH_MIN}, the oldest release ckptaudit is tested on; "
            "results may differ")


def require_torch(what: str) -> None:
    """Raise :class:`MissingExtra` with :func:`torch_missing`'s line when torch is not installed."""
    message = torch_missing(what)
    if message is not None:
        raise MissingExtra(message, name="torch")
