"""What the session asks of verl's FSDP engine (host.Passes).

`VerlPasses` runs the session's probe, calibration and audit passes through the engine's own
`plain_forward_step` (verl's forward, loss and log-probs, without the session's per-micro-batch
hooks); what verl's batch says (tokens, loss coefficients, exposure) it reads through batch.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hilore_verl.integration.actor.batch import sequence_lengths
from hilore_verl.integration.actor.device_memory import available_bytes, compute_device
from hilore_verl.training.snapshots import reset_after_failure
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_torch_device
from verl.workers.utils.padding import no_padding_2_padding

if TYPE_CHECKING:
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine


class VerlPasses:
    """What the session asks of verl's FSDP engine (host.Passes): passes run through verl's own
    forward_step, without the session's per-micro-batch hooks."""

    def __init__(self, engine: "HiLoReFSDPEngine"):
        self.engine = engine
        self.loss_function = None  # the current train_batch's loss

    @property
    def element_size(self) -> int:
        e = self.engine
        return next(e.module.parameters()).element_size() if e._autocast_dtype == torch.float32 else 2

    # verl attends per sequence (flash-attention's varlen kernel over unpadded rows) or per padded row:
    # nothing grows with a micro-batch's tokens squared
    row_attention = False

    @property
    def has_coefficients(self) -> bool:
        return self.engine.actor_config is not None

    def lengths(self, batch) -> list[int]:
        return sequence_lengths(batch)

    def layer_tokens(self, batch) -> int:
        shared = self.engine._shared
        return shared.tokens(batch) if shared is not None else int(batch["input_ids"].values().numel())

    def head_rows(self, batch) -> int | None:
        """verl's log-prob code computes every token of the packed row: the layers' tokens, or with shared
        prompts the row the logits are laid back out as (more than the layers compute)."""
        return int(batch["input_ids"].values().numel()) if self.engine._shared is not None else None

    def select(self, batch, index: list[int]):
        return tu.index_select_tensor_dict(batch, index)

    def _run(self, batch, loss_function) -> None:
        """Forward + backward of one micro-batch; grads are left in .grad, no optimizer step."""
        e = self.engine
        e.optimizer.zero_grad()
        value, _ = e.plain_forward_step(batch, loss_function)
        value.backward()

    def train_pass(self, batch) -> None:
        self._run(batch, self.loss_function)

    def surrogate_gradient(self, plan, batch, c: torch.Tensor) -> list:
        """This rank's gradient shard of sum_t c_t log p_t under `plan`: the live gradients, one tensor per
        parameter (not copied; the next pass's zero_grad drops them from the module, not from the caller)."""
        def surrogate(model_output, data, dp_group=None):
            log_prob = no_padding_2_padding(model_output["log_probs"], data)
            return (log_prob * c.to(log_prob.dtype)).sum(), {}

        self.engine.runtime.set_plan(plan)
        self._run(batch, surrogate)
        return [None if p.grad is None else p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for p in self.engine.module.parameters()]

    def coefficients(self, batch) -> torch.Tensor:
        return self.engine.loss_terms.coefficients(batch)

    def exposure_l2(self, batch, log_prob=None) -> torch.Tensor:
        return self.engine.loss_terms.exposure_l2(batch, log_prob)

    def zero_grad(self) -> None:
        self.engine.optimizer.zero_grad()

    def recover(self) -> None:
        reset_after_failure(self.engine.module, self.engine.optimizer)
        self.empty_cache()

    def empty_cache(self) -> None:
        get_torch_device().empty_cache()

    def static_bytes(self) -> float:
        """Parameter shards, their gradients and two fp32 Adam states per element, on this rank."""
        total = 0.0
        for p in self.engine.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * (2 * local.element_size() + 8)
        return total

    def gradient_bytes(self) -> float:
        """The gradients of the parameter shards on this rank (in the parameters' dtype)."""
        total = 0.0
        for p in self.engine.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
        return total

    def free_bytes(self) -> float:
        # measured now, when the actor trains, on the device it computes on (a parameter may be
        # on the host under FSDP2's parameter offload; see device_memory.py)
        return available_bytes(compute_device(), self.engine.get_data_parallel_group())
