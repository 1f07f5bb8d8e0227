"""How quiet the machine was while the bench ran: what else took the CPU, read from the system's counters.

A job beside the bench widens its per-round spread several times (docs/benchmarks/bench_cpu.md), and
a spread from a busy machine says nothing about the product. So the bench reads, at its start and end:

    busy     the system's CPU seconds other than idle and iowait (psutil.cpu_times), all cores
    own      this process's CPU seconds, and those of its finished children (the fresh-process peaks)
    other    busy - own: what other processes (and the kernel on their behalf) used meanwhile

and reports other / (wall seconds x cores) with the one-minute load average at both ends; above
QUIET_SHARE it warns that the figures come from a busy machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil

QUIET_SHARE = 0.05  # other processes' share of the machine's CPU time above which the run is not quiet


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _own_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class MachineLoad:
    """`start()` before the work, `stop()` after it: the figures above (a dict for the report)."""

    cpus: int = field(default_factory=lambda: psutil.cpu_count() or 1)
    _start: tuple[float, float, float, float] | None = None

    def start(self) -> None:
        self._start = (time.monotonic(), _busy_s(), _own_s(), os.getloadavg()[0])

    def stop(self) -> dict:
        if self._start is None:
            raise RuntimeError("MachineLoad.stop() before start()")
        wall0, busy0, own0, load0 = self._start
        wall, busy, own = time.monotonic() - wall0, _busy_s() - busy0, _own_s() - own0
        capacity = max(wall * self.cpus, 1e-9)
        other = max(busy - own, 0.0) / capacity
        out = {"cpus": self.cpus, "wall_s": wall, "own_cpu_share": own / capacity, "other_cpu_share": other,
               "load_avg_1m": [load0, os.getloadavg()[0]], "quiet": other <= QUIET_SHARE}
        out["warning"] = None if out["quiet"] else warning(out)
        return out


def warning(load: dict) -> str:
    return (f"other processes took {100 * load['other_cpu_share']:.0f}% of the machine's CPU time during the run "
            f"(above {100 * QUIET_SHARE:.0f}%; load average {load['load_avg_1m'][0]:.2f} -> {load['load_avg_1m'][1]:.2f} "
            f"on {load['cpus']} cores): the rounds' spread and ratios come from a busy machine; rerun with nothing "
            "else running")


__all__ = ["MachineLoad", "QUIET_SHARE", "warning"]
