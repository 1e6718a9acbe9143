"""Where plimsoll keeps what it builds (demo models, trained tokenizers): one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PLIMSOLL_CACHE``, else ``$XDG_CACHE_HOME/plimsoll``, else ``~/.cache/plimsoll``."""
    if env := os.environ.get("PLIMSOLL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plimsoll"
