"""host_memory_bytes: the memory this server may use, for the limits derived from it."""
from __future__ import annotations

import os
from pathlib import Path

# cgroup v2, then v1: a container's limit is what the OS kills at, not the machine's RAM
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_memory_bytes() -> int:
    """This machine's memory, or the container's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
