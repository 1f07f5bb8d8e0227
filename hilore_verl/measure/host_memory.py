"""This process's and this host's memory: what the bench, the GPU check and budget mode `auto` read
on a CPU."""

from __future__ import annotations

import psutil


def resident_bytes() -> int:
    """This process's resident size now (VmRSS)."""
    return psutil.Process().memory_info().rss


def peak_resident_bytes(pid: int | str = "self") -> int:
    """A process's resident high-water mark (VmHWM), since it started or since 5 was last written to its
    /proc/<pid>/clear_refs.

    Read from /proc/<pid>/status: psutil has no peak field, and getrusage's ru_maxrss is not VmHWM:
    writing clear_refs does not reset it (the bench and PeakMeter reset the mark before the step they
    measure), it keeps the peak of the process before an exec, it is rounded differently (a few KiB
    above VmHWM), and it covers only this process (the demo reads its rank processes')."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def available_bytes() -> float:
    """The host's MemAvailable: what it can hand out without swapping."""
    return float(psutil.virtual_memory().available)


def status_kib(field: str) -> int:
    """VmRSS or VmHWM in KiB, as /proc/self/status gives them (what bench/peak.py and PeakMeter read)."""
    if field == "VmRSS":
        return resident_bytes() // 1024
    if field == "VmHWM":
        return peak_resident_bytes() // 1024
    raise ValueError(f"hilore-verl: status_kib reads VmRSS or VmHWM, not {field}")
