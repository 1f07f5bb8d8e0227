"""The measured-peak feedback: later plans planned under a smaller budget where a mini-batch's measured
peak overshot both the budget and what its plans predicted, loosened back once the model holds again.

With r = measured / predicted (the mini-batch's largest predicted peak; the measured one the maximum
over ranks, so every rank adjusts alike):

    r > 1 and measured > budget + noise   factor = max(min(factor, 1 / r), MIN_PEAK_FACTOR): the same
                                          error then lands on the budget
    r <= 1 and factor < 1                 factor moves halfway back towards 1 (1 within 1e-3)
    otherwise                             unchanged (the model errs, but the plans fit; or an overshoot
                                          within the measurement's own noise, peak_memory.py)

    feedback = PeakFeedback()
    feedback.update(measured, predicted, budget, noise)   # True where the factor changed (plans change)
    feedback.factor                                        # what the controller's budget is multiplied by
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PEAK_FACTOR = 0.5  # the feedback plans under at least half the budget


@dataclass
class PeakFeedback:
    factor: float = 1.0
    measured: tuple[float, float] | None = None  # the last mini-batch's (measured, predicted) peak

    def update(self, measured_bytes: float, predicted_bytes: float, budget_bytes: float,
               noise_bytes: float = 0.0) -> bool:
        """One mini-batch's measured and largest predicted peak against its budget; whether the factor changed."""
        self.measured = (float(measured_bytes), predicted_bytes)
        ratio = measured_bytes / predicted_bytes
        if ratio > 1 and measured_bytes > budget_bytes + noise_bytes:
            self.factor = max(min(self.factor, 1 / ratio), MIN_PEAK_FACTOR)
        elif ratio <= 1 and self.factor < 1:
            self.factor = min(1.0, self.factor + 0.5 * (1 - self.factor))
            if self.factor > 1 - 1e-3:
                self.factor = 1.0
        else:
            return False
        return True

    def metrics(self) -> dict[str, float]:
        if self.measured is None:
            return {}
        return {"hilore/memory/measured_peak_gib": self.measured[0] / 2**30,
                "hilore/memory/predicted_peak_gib": self.measured[1] / 2**30, "hilore/memory/peak_factor": self.factor}


__all__ = ["MIN_PEAK_FACTOR", "PeakFeedback"]
