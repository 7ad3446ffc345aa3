# The typed surface of the package root (``__init__.py`` resolves these lazily).
import os
from typing import Any

from ckptaudit.api import Report as Report

__version__: str
__all__: list[str]

def audit(path: str | os.PathLike[str], **options: Any) -> Report: ...
def compare(reference: str | os.PathLike[str], candidate: str | os.PathLike[str], **options: Any) -> Report: ...
