"""Peak resident memory of a process, as Linux records it (VmHWM)."""

from __future__ import annotations

import os


def peak_rss(pid: int | None = None) -> int:
    """Bytes; 0 where /proc is not available."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
