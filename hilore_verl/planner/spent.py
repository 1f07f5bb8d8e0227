"""The risk each micro-batch actually spent: its plan's risk at the exact exposure of its real log-probs.

A metric only: no plan depends on it. So a micro-batch's exact exposure may come as a float, a device
tensor, or a function that computes one (after its forward, before its backward), and is read later:
all of a mini-batch's at once, in one transfer, when the metrics (or the next mini-batch, or an audit)
need them. Nothing between a micro-batch's forward and its backward waits for the device.

    spent = SpentRisk(price)          # price(plan, exposure_l2) -> the risk the plan spends at that exposure
    spent.note(record, exact)         # record.spent_risk now (a float, or an exact plan), or once read
    spent.read()                      # every unread exposure in one transfer; records filled
    spent.discard()                   # a failed mini-batch's: left unrecorded
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from hilore_verl.loss.exposure import read_floats

Exact = Union[float, torch.Tensor, Callable[[], Union[float, torch.Tensor]]]  # an exact exposure, maybe not read yet


class SpentRisk:
    def __init__(self, price: Callable[[dict, float], float]):
        self.price = price
        self._unread: list[tuple[object, Exact]] = []  # (plan record, exact exposure) not recorded yet

    def note(self, record, exact: Exact) -> None:
        """`record` (a PlanRecord) spent risk at the exact exposure `exact`."""
        if all(p.exact for p in record.plan.values()):
            record.spent_risk = 0.0  # an exact plan spends nothing, whatever the exposure: nothing to compute
        elif isinstance(exact, (int, float)):
            record.spent_risk = self.price(record.plan, float(exact))
        else:
            self._unread.append((record, exact))

    def read(self) -> None:
        """Read the exact exposures kept (every tensor in one transfer) and record what each record spent."""
        unread, self._unread = self._unread, []
        if not unread:
            return
        values = read_floats([value() if callable(value) else value for _, value in unread])
        for (record, _), l2 in zip(unread, values):
            record.spent_risk = self.price(record.plan, l2)

    def discard(self) -> None:
        self._unread = []


__all__ = ["Exact", "SpentRisk"]
