"""Where meshpipe keeps things on disk."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """MESHPIPE_CACHE, else $XDG_CACHE_HOME/meshpipe, else ~/.cache/meshpipe."""
    explicit = os.environ.get("MESHPIPE_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "meshpipe"

