"""The deferred inf / nan check of a compressed tensor on an asynchronous device.

Reading a payload's non-finite flags at pack time would wait for the device, so the flags travel to
the host by a non-blocking copy and the tensor is held as `Unchecked` (the tensor and its payload)
until that copy lands (`FiniteCheck`): then a flagged tensor stays exact and any other keeps only its
payload. `WaitCount` counts the settles that had to wait (host synchronisations).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class WaitCount:
    """How often settling a check had to wait for the device (a host synchronisation); none when every
    check's copy had landed by the time it was read."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


class FiniteCheck:
    """Whether a payload's groups held inf / nan, on its way to the host: a host scalar filled by a
    non-blocking copy, and the event recorded after it. Reading it never waits for the device unless
    asked to (`settle(wait=True)`). Once settled it corrects the accounting (`charges`: where the
    payload's bytes were counted) and tells its holder, if still alive, which of the two to keep."""

    __slots__ = ("flag", "done", "delta", "charges", "holder", "flagged", "waits")

    def __init__(self, flag: torch.Tensor, done, delta: int, holder: "Unchecked", waits: WaitCount):
        self.flag, self.done, self.waits = flag, done, waits
        self.delta = delta  # bytes the exact tensor takes beyond its payload
        self.charges: list = []  # (StepStats, charge)
        self.holder = weakref.ref(holder)
        self.flagged: bool | None = None

    def settle(self, wait: bool) -> bool:
        """True once settled; False (without waiting) while the copy has not completed and not `wait`."""
        if self.flagged is not None:
            return True
        if not self.done.query():
            if not wait:
                return False
            self.waits.n += 1
            self.done.synchronize()
        self.flagged = bool(self.flag)  # host memory, written by the completed copy
        self.flag = self.done = None
        if self.flagged:
            for stats, charge in self.charges:
                stats.flagged(charge, self.delta)
        self.charges = []
        holder = self.holder()
        if holder is not None and self.flagged:
            holder.payload = None
        elif holder is not None:
            holder.tensor = None
        return True


class Unchecked:
    """A compressed tensor whose inf / nan check has not reached the host yet (an asynchronous device,
    where reading the flags at pack time would wait for it): the tensor and its payload are both held
    until the check settles, then a flagged tensor stays exact (the payload is dropped), any other
    keeps only its payload. Unpack settles the check, waiting if it must (in backward the forward's
    work is done)."""

    __slots__ = ("tensor", "payload", "check", "__weakref__")

    def __init__(self, t: torch.Tensor, payload: Any, flag: torch.Tensor, done, waits: WaitCount):
        self.tensor: torch.Tensor | None = t.detach()
        self.payload = payload  # Compressed or Offloaded
        self.check = FiniteCheck(flag, done, t.numel() * t.element_size() - payload.nbytes, self, waits)

    def charge(self, stats: Any, charge: Any) -> None:
        """Where the payload's bytes were counted: corrected there if the check finds inf / nan."""
        if self.check.flagged is None:
            self.check.charges.append((stats, charge))

    @property
    def nbytes(self) -> int:
        t = self.tensor
        return t.numel() * t.element_size() if self.payload is None else self.payload.nbytes

    def get(self) -> torch.Tensor:
        self.check.settle(wait=True)
        return self.tensor if self.payload is None else self.payload.get()


__all__ = ["FiniteCheck", "Unchecked", "WaitCount"]
