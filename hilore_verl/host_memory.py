"""This process's and this host's memory as Linux reports it in /proc: what the bench, the GPU check
and budget mode `auto` read on a CPU."""

from __future__ import annotations


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB: VmRSS (resident now), VmHWM (resident high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def available_bytes() -> float:
    """The host's MemAvailable: what it can hand out without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    raise RuntimeError("hilore-verl: /proc/meminfo has no MemAvailable (needed to size a CPU host's memory)")
