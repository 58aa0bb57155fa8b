"""A process's resident memory from Linux's /proc (the memory probes' one source): the
current resident bytes, the peak, and resetting the peak to now."""

from __future__ import annotations

import os


def rss_bytes() -> float:
    """This process's resident bytes now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> float:
    """Reset the peak resident size to now (Linux >= 4.0); the current resident bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_bytes() -> float:
    """The peak resident bytes since the process started or the last `reset_peak`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return 1024.0 * int(line.split()[1])
    raise OSError("no VmHWM in /proc/self/status")
