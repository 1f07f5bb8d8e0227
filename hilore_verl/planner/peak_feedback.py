"""The measured-peak feedback: later plans planned under a smaller budget where a mini-batch's measured
peak overshot both the budget and what its plans predicted, loosened back once the model holds again.

With r = measured / predicted (the mini-batch's largest predicted peak; the measured one the maximum
over ranks, so every rank adjusts alike):

    r > 1 and measured > budget + noise   factor = max(min(factor, 1 / r), MIN_PEAK_FACTOR): the same
                                          error then lands on the budget
    r <= 1 and factor < 1                 a fit: from the LOOSEN_AFTER-th fit in a row on, the factor moves
                                          halfway back towards 1 (1 within 1e-3), once per fit
    otherwise                             unchanged (the model errs, but the plans fit; or an overshoot
                                          within the measurement's own noise, peak_memory.py)

Any mini-batch that is not a fit ends the run of fits. Why a run: a measurement that reads low now and
then (on a CPU the resident size misses what malloc serves from memory it kept) would otherwise loosen
after every low reading and tighten after the next true one, changing the plans between identical
mini-batches; only a model that holds for LOOSEN_AFTER mini-batches in a row earns its room back.

    feedback = PeakFeedback()
    feedback.update(measured, predicted, budget, noise)   # True where the factor changed (plans change)
    feedback.factor                                        # what the controller's budget is multiplied by
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PEAK_FACTOR = 0.5  # the feedback plans under at least half the budget
LOOSEN_AFTER = 3  # fits in a row before the factor moves back towards 1


@dataclass
class PeakFeedback:
    factor: float = 1.0
    measured: tuple[float, float] | None = None  # the last mini-batch's (measured, predicted) peak
    fits: int = 0  # mini-batches in a row, up to the last, whose measured peak was within the prediction

    def update(self, measured_bytes: float, predicted_bytes: float, budget_bytes: float,
               noise_bytes: float = 0.0) -> bool:
        """One mini-batch's measured and largest predicted peak against its budget; whether the factor changed."""
        self.measured = (float(measured_bytes), predicted_bytes)
        ratio = measured_bytes / predicted_bytes
        self.fits = self.fits + 1 if ratio <= 1 else 0
        if ratio > 1 and measured_bytes > budget_bytes + noise_bytes:
            before = self.factor
            self.factor = max(min(self.factor, 1 / ratio), MIN_PEAK_FACTOR)
            return self.factor != before
        elif ratio <= 1 and self.factor < 1 and self.fits >= LOOSEN_AFTER:
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


__all__ = ["LOOSEN_AFTER", "MIN_PEAK_FACTOR", "PeakFeedback"]
