"""The benchmark's actor update driven by `Session`, the code verl's engine runs around each mini-batch.

`BenchPasses` is what the session asks of a framework (host.Passes), for the bench's model and
batch (bench/actor_update.py); `SessionMethod` runs one actor update the way `HiLoReFSDPEngine` does:

    session.train(mbs, step, row_tokens)    first call: probe, profile, calibrate, build the controller
      step():  for each micro-batch: before_forward (plan) -> forward -> after_forward (risk) -> backward
               session.optimizer_step(the optimizer's step)

so what the bench's planner rows and the GPU check measure is the product's planning, profiling, skip,
retry and measured-peak path, not a copy.
A micro-batch here is one bench batch (one packed row, or padded rows).
"""

from __future__ import annotations

import time

import torch

import hilore_verl
from hilore_verl.measure import host_memory
from hilore_verl.bench.method import Method, sync
from hilore_verl.bench.actor_update import (SHARE_ATTRIBUTE, BenchConfig, build_model, forward_context, head_rows,
                                        layer_tokens, loss_of, make_optimizer, probe_batch, static_bytes, tokens_of)
from hilore_verl.training.config import HiLoReConfig
from hilore_verl.runtime import RECOMPUTE, UnitPlan
from hilore_verl.training.session import Session
from hilore_verl.shared_prompt import install as install_shared_attention


def _positions_in_sequence(target_seq: torch.Tensor) -> torch.Tensor:
    """(N,) index of each response token within its sequence (tokens of a sequence are contiguous, in order)."""
    n = target_seq.numel()
    start = torch.ones(n, dtype=torch.bool, device=target_seq.device)
    start[1:] = target_seq[1:] != target_seq[:-1]
    first = torch.cummax(torch.where(start, torch.arange(n, device=target_seq.device), 0), 0).values
    return torch.arange(n, device=target_seq.device) - first


class BenchPasses:
    """host.Passes for a bench model: coefficients are the batch's `coef`, laid out (sequences, tokens)."""

    has_coefficients = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: BenchConfig, runtime):
        self.model, self.optimizer, self.config, self.runtime = model, optimizer, config, runtime
        weights = next(model.parameters())
        cpu_autocast = config.autocast and weights.device.type == "cpu"
        self.element_size = 2 if cpu_autocast else weights.element_size()
        self.row_attention = config.pack and not config.per_sequence_attention  # SDPA over the packed row

    def _head(self, fn, *args):
        return self.runtime.call("head", fn, *args)

    def loss(self, batch, c: torch.Tensor | None = None) -> torch.Tensor:
        with forward_context(self.config):
            return loss_of(self.model, batch, batch["coef"] if c is None else c, self._head)

    def lengths(self, batch) -> list[int]:
        return batch["seq_lens"].tolist()

    def layer_tokens(self, batch) -> int:
        return layer_tokens(self.model, batch)

    def head_rows(self, batch) -> int:
        return head_rows(batch)

    def select(self, batch, index: list[int]):
        return probe_batch(batch, index)

    def train_pass(self, batch) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(batch).backward()

    def coefficients(self, batch) -> torch.Tensor:
        """(sequences, longest response) c_t, zero past each response."""
        seq, pos = batch["target_seq"], _positions_in_sequence(batch["target_seq"])
        out = torch.zeros(len(batch["seq_lens"]), int(pos.max()) + 1 if pos.numel() else 1,
                          dtype=batch["coef"].dtype, device=batch["coef"].device)
        out[seq, pos] = batch["coef"]
        return out

    def surrogate_gradient(self, plan, batch, c: torch.Tensor) -> list:
        flat = c[batch["target_seq"], _positions_in_sequence(batch["target_seq"])].to(batch["coef"].dtype)
        self.runtime.set_plan(plan)
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(batch, flat).backward()
        return [p.grad for p in self.model.parameters()]  # the live gradients (risk.Gradient), not copied

    def exposure_l2(self, batch, log_prob=None) -> float:
        return float(batch["coef"].double().pow(2).sum().sqrt())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def recover(self) -> None:
        self.zero_grad()
        self.empty_cache()

    def empty_cache(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def static_bytes(self) -> float:
        return float(static_bytes(self.model, self.config))

    def gradient_bytes(self) -> float:
        return float(sum(p.numel() * p.element_size() for p in self.model.parameters()))

    def free_bytes(self) -> float:
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return float(free + torch.cuda.memory_reserved(device))
        return host_memory.available_bytes()


class SessionMethod(Method):
    """A fresh policy copy whose actor update runs through `Session` (HiLoRe or its keep/recompute planner),
    as `HiLoReFSDPEngine` runs it: zero-exposure sequences left out (hilore.skip_zero_exposure), each
    mini-batch planned, applied, retried and fed back by the session. `state`: a saved controller (no
    probes); `shared`: each group's prompt computed once (shared_prompt/)."""

    def __init__(self, name: str, config: BenchConfig, hilore: HiLoReConfig, state: dict | None = None,
                 shared: bool = False):
        model = build_model(config)
        if shared:
            install_shared_attention(model)  # a no-op where the config already attends per sequence
            setattr(model, SHARE_ATTRIBUTE, True)
        super().__init__(name, model, make_optimizer(model, config), config,
                         drop="zero_coef" if hilore.skip_zero_exposure else None)
        # as verl's engine has it (enable_gradient_checkpointing, on by default): the runtime takes it over
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.hilore = hilore
        self.runtime = hilore_verl.attach(model, hilore.runtime_config())
        self.passes = BenchPasses(model, self.optimizer, config, self.runtime)
        self.session = Session(hilore, self.runtime, self.passes)
        self.session.restore(state)
        self.metrics: dict[str, float] = {}
        self.session_s: list[float] = []  # per mini-batch: host seconds of the session's own work

    @property
    def controller(self):
        return self.session.controller

    def build_controller(self, batch) -> None:
        """What the first mini-batch does first (profile, calibrate; or the saved state), now."""
        self.session.build_controller([self.trained(batch)])

    def session_with(self, controller) -> Session:
        """A session on this model that plans with `controller` (another budget, a fixed plan), its own
        timing and feedback apart from this one's."""
        session = Session(self.hilore, self.runtime, self.passes)
        session.controller = controller
        return session

    def step(self, batch) -> float:
        """One actor update (the first one profiles and calibrates); returns its seconds."""
        sync()
        start = time.perf_counter()
        self._train(batch, update=True)
        sync()
        return time.perf_counter() - start

    def forward_backward(self, batch) -> None:
        """One mini-batch through the session without the optimizer step (the gradient stays)."""
        self._train(batch, update=False)

    def _train(self, batch, update: bool) -> None:
        micro_batch, passes = self.trained(batch), []
        start = time.perf_counter()

        def framework_step():
            begin = time.perf_counter()
            self._framework_step([micro_batch], update)
            passes.append(time.perf_counter() - begin)

        _, self.metrics = self.session.train([micro_batch], framework_step, [tokens_of(micro_batch)])
        self.session_s.append(time.perf_counter() - start - sum(passes))

    def _framework_step(self, micro_batches, update: bool) -> None:
        """What the framework's train_batch does, with the session's per-micro-batch hooks."""
        self.optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches:
            index = self.session.before_forward()
            loss = self.passes.loss(mb)
            if self.session.records_risk():
                self.session.after_forward(index, self.passes.exposure_l2(mb))
            loss.backward()
        if update:
            self.session.optimizer_step(self.optimizer.step, None)
            self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict:
        """What a fresh process needs to run the same planner without profiling again, on the arm its
        measured trial runs now (planner/arms.py; a fresh trial would time the baseline second), under the
        budget its controller plans with (the bench moves a planner's controller to `--budget`)."""
        budget = self.controller.budget
        return {"controller": self.session.state_dict(), "budget": (budget.mode, budget.value),
                "risk_budget": self.hilore.risk_budget, "arm": self.controller.arms.label}

    def predicted(self, tokens: int) -> dict:
        """The controller's last plan at `tokens`: predicted peak, and predicted seconds over keeping every
        unit, for the plan and for full recompute (the cost model's view of GC)."""
        controller = self.controller
        plan = controller.history[-1].plan
        costs = controller.costs

        return {"predicted_peak_bytes": controller.history[-1].predicted_peak,
                "gc_predicted_peak_bytes": controller.predicted_peak(controller.gc_plan(), tokens),
                "predicted_extra_s": costs.seconds(plan, tokens),
                "gc_predicted_extra_s": costs.seconds({u.name: RECOMPUTE for u in costs.units}, tokens),
                "plan_counts": plan_counts(plan)}


def plan_counts(plan: dict[str, UnitPlan]) -> dict[str, int]:
    """Units per spelled plan ("keep", "int8+offload", ...), as reports show a plan."""
    counts: dict[str, int] = {}
    for choice in map(str, plan.values()):
        counts[choice] = counts.get(choice, 0) + 1
    return counts
