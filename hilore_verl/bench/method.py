"""One benchmarked method: a policy copy, its optimizer and how its forward + backward is wrapped.

`Method` runs the baselines (a context manager around forward + backward, or a runtime with one
fixed plan); the planners are `SessionMethod`s (bench/session_passes.py), whose update runs through
the engine's `Session`. Both step the same way:

    step(batch)      forward + backward + optimizer step, timed (device synchronised)
    gradient(batch)  the flattened float64 gradient of one forward + backward, no update
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from hilore_verl.loss import skip
from hilore_verl.bench.actor_update import (BenchConfig, forward_context, head_rows, layer_tokens, loss_of, probe_batch,
                                        tokens_of)
from hilore_verl.planner import Tokens
from hilore_verl.training.host import SingleProcess


@dataclass
class Method:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: BenchConfig = field(default_factory=BenchConfig)
    context: object = None  # a callable returning a context manager around forward + backward
    runtime: object = None  # a runtime running one fixed plan (the runtime-only rows)
    drop: str | None = None  # a per-sequence flag of the batch: those sequences are left out (skip.py)
    skipped_token_share: float = 0.0  # of the last step
    controller = None  # planners only (SessionMethod)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One actor update (forward, backward, optimizer step); returns its seconds."""
        sync()
        start = time.perf_counter()
        self.forward_backward(batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> None:
        batch = self.trained(batch)
        head = (lambda fn, *args: self.runtime.call("head", fn, *args)) if self.runtime is not None else None
        with self.context() if self.context is not None else contextlib.nullcontext():
            with forward_context(self.config):
                loss = loss_of(self.model, batch, batch["coef"], head)
            loss.backward()

    def gradient(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(batch)
        grad = torch.cat([full(p.grad).flatten() for p in self.model.parameters() if p.grad is not None])
        self.optimizer.zero_grad(set_to_none=True)
        return grad.double()

    def trained(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch this method forwards: without the sequences `drop` flags, laid out by skip.form (one
        micro-batch, one rank), as the engine leaves out zero-exposure sequences."""
        if self.drop is None:
            return batch
        zero, lengths = batch[self.drop].tolist(), batch["seq_lens"].tolist()
        layout = skip.form(zero, lengths, lambda kept, at_least: [kept], SingleProcess())
        self.skipped_token_share = layout.tokens / layout.total_tokens
        return batch if layout.micro_batches is None else probe_batch(batch, layout.micro_batches[0])

    def trained_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens of the batch this method forwards (what its planner plans for)."""
        return tokens_of(self.trained(batch))

    def layer_tokens(self, batch: dict[str, torch.Tensor]) -> Tokens:
        """Tokens its layers compute for the batch it forwards (fewer than `trained_tokens` where prompts
        are shared), carrying the rows its head's log-prob code computes (the response tokens)."""
        trained = self.trained(batch)
        return Tokens(layer_tokens(self.model, trained), head_rows(trained))


def full(t: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain tensor: a DTensor's (verl_offload's FSDP2-wrapped model) gathered whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
