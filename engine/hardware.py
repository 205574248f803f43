"""What this machine offers: cores and memory. (The memory planner grows this into a full probe.)"""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Physical cores (not hyper-threads): llama.cpp decodes fastest with one thread per core."""
    import psutil

    n = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        # Respect a CPU affinity mask (containers, taskset): never more threads than usable CPUs.
        n = min(n, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        pass
    return max(1, n)
