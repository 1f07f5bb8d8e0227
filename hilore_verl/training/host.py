"""What a training session needs from its host (the framework it runs in): two small protocols.

    Passes       forward + backward passes on the host's model, for its own micro-batch type; the loss
                 coefficients of a micro-batch; how to forget a failed pass; memory figures
                 (verl's engine: integration/actor/passes.py; the bench: bench/session_passes.py)
    Collectives  reductions over the data-parallel ranks (torch.distributed:
                 integration/actor/collectives.py; one rank: `SingleProcess`)

The session (session.py) calls nothing else of its host, and nothing here calls back into it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from hilore_verl.loss.risk import Gradient
from hilore_verl.runtime import UnitPlan


class Passes(Protocol):
    """What the session asks of the training framework, for its own micro-batch type."""

    element_size: int  # bytes per element of the activations the model saves
    has_coefficients: bool  # whether the loss coefficients are known (a risk model can be calibrated)
    row_attention: bool  # attention computes every pair of a packed row (a dense mask): grows with tokens squared

    def lengths(self, batch) -> list[int]: ...  # tokens per sequence
    def layer_tokens(self, batch) -> int: ...  # tokens the layers compute: sum(lengths), fewer with shared prompts
    def head_rows(self, batch) -> int | None: ...  # rows the head's log-prob code computes; None: layer_tokens
    def select(self, batch, index: list[int]): ...  # the sequences `index` of a micro-batch
    def train_pass(self, batch) -> None: ...  # forward + backward of the training loss, current plan
    def surrogate_gradient(self, plan: dict[str, UnitPlan], batch, c: torch.Tensor) -> Gradient: ...  # risk.py
    def coefficients(self, batch) -> torch.Tensor: ...  # predicted (on-policy) c of a micro-batch
    def exposure_l2(self, batch, log_prob=None) -> float | torch.Tensor: ...  # |c| (+ entropy bound), or 0-d
    def zero_grad(self) -> None: ...
    def recover(self) -> None: ...  # forget a failed forward / backward (no gradient left), free memory
    def empty_cache(self) -> None: ...  # return cached device memory
    def static_bytes(self) -> float: ...  # parameters, gradients and optimizer state on this rank
    def gradient_bytes(self) -> float: ...  # the gradients' part of static_bytes
    def free_bytes(self) -> float: ...  # device memory available to the update (budget mode "auto")


class Collectives(Protocol):
    """Reductions over the data-parallel ranks; each returns the reduced values on every rank."""

    world_size: int

    def reduce(self, values: Sequence[float], op: str = "sum") -> list[float]: ...  # op: sum, max, min
    def gather(self, values: Sequence[float]) -> list[list[float]]: ...  # every rank's values, in rank order
    def sum_(self, t: torch.Tensor) -> None: ...  # in place (the audit's float64 sums)
    def agree_on_failure(self) -> str | None: ...  # by a failing rank: None (retry) or why not (then stopped)
    def stopped_by_peer(self) -> str | None: ...  # why another rank stopped training, where one did
    def watch(self) -> None: ...  # abort this rank's collectives once a rank stops (a monitor)


class SingleProcess:
    """One rank: every reduction is the identity."""

    world_size = 1

    def reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        return [float(v) for v in values]

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        return [[float(v) for v in values]]

    def sum_(self, t: torch.Tensor) -> None:
        pass

    def agree_on_failure(self) -> str | None:
        return None

    def stopped_by_peer(self) -> str | None:
        return None

    def watch(self) -> None:
        pass


__all__ = ["Collectives", "Passes", "SingleProcess"]
