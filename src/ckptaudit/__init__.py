"""ckptaudit: is this checkpoint really my training state, and can I resume from it?"""

from __future__ import annotations

__version__ = "0.1.0"
