"""The methods `hilore-verl bench` compares, each a small policy applied to a fresh copy of the policy model.

    no_gc            nothing saved is dropped
    gc               full gradient checkpointing of every decoder layer (verl's default: HF, non-reentrant)
    gc_drop_zero_adv GC with every sequence whose advantages are all 0 left out (what verl's open pull requests
                     do: exact without a KL loss, not with one)
    verl_offload     verl's activation offload (CUDA only: side-stream copies)
    hidden_offload   GC + the layer inputs (what GC holds) offloaded to host memory
    int8_boundary    GC + the layer inputs compressed to int8 (uniform boundary compression)
    fp8_boundary     the same with fp8-e4m3
    keep_recompute   hilore-verl's planner with keep / recompute only, under the budget (torchtitan-style)
    hilore           HiLoRe: keep / compress / recompute, risk-budgeted, under the budget
    *_shared         no_gc, gc, hilore with each group's prompt computed once (shared_prompt/; `--shared-prompt`)

Both planners leave out the sequences without a loss term (skip.py, as the engine does: no coefficient on
any of their tokens, so none under a KL loss) before planning.

A method is built once (`build`; the planners' controller is built by the engine's own `Session`, which
profiles and calibrates as verl's first step does) and then steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import hilore_verl
from hilore_verl import skip
from hilore_verl.bench.session_passes import BenchPasses
from hilore_verl.bench.workload import (SHARE_ATTRIBUTE, BenchConfig, build_model, coefficients, forward_context,
                                        layer_tokens, loss_of, make_optimizer, probe_batch, tokens_of)
from hilore_verl.config import HiLoReConfig
from hilore_verl.kernels import dequantize, quantize
from hilore_verl.planner import BudgetConfig, Controller
from hilore_verl.session import Session, SingleProcess
from hilore_verl.shared_prompt import install as install_shared_attention

SHARED = ("no_gc_shared", "gc_shared", "hilore_shared")  # the same methods on the shared-prompt layout
METHODS = ("no_gc", "gc", "gc_drop_zero_adv", "verl_offload", "hidden_offload", "int8_boundary", "fp8_boundary", "keep_recompute",
           "hilore", "runtime_keep", "runtime_recompute", *SHARED)
PLANNERS = ("keep_recompute", "hilore", "hilore_shared")
SWEPT = ("keep_recompute", "hilore")  # the planners the budget sweep runs
# the runtime's own cost, no planner: every unit kept (against no_gc), every unit recomputed (against gc)
RUNTIME_ONLY = {"runtime_keep": "keep", "runtime_recompute": "recompute"}


class Unavailable(Exception):
    """The method cannot run on this machine (reason in the message)."""


@dataclass
class Method:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    context: object = None  # a callable returning a context manager around forward + backward
    runtime: object = None
    controller: Controller | None = None
    c: torch.Tensor | None = None
    exposure_l2: float = 0.0
    plan_s: list[float] = field(default_factory=list)
    config: BenchConfig = field(default_factory=BenchConfig)
    drop: str | None = None  # a per-sequence flag of the batch: those sequences are left out (skip.py)
    skipped_token_share: float = 0.0  # of the last step
    timed: float | None = None  # the last timed step's seconds per trained token, for the controller's arms

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One actor update (forward, backward, optimizer step); returns its seconds."""
        _sync()
        start = time.perf_counter()
        self.forward_backward(batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync()
        seconds = time.perf_counter() - start
        if self.controller is not None:  # as the engine's session times each mini-batch (planner/arms.py)
            self.timed = seconds / self.layer_tokens(batch)
        return seconds

    def _kept(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch without the sequences `drop` flags, laid out by skip.form (one micro-batch, one rank)."""
        zero, lengths = batch[self.drop].tolist(), batch["seq_lens"].tolist()
        layout = skip.form(zero, lengths, lambda kept, at_least: [kept], SingleProcess())
        self.skipped_token_share = layout.tokens / layout.total_tokens
        return batch if layout.micro_batches is None else probe_batch(batch, layout.micro_batches[0])

    def trained_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens of the batch this method forwards (what its planner plans for)."""
        return tokens_of(self._kept(batch) if self.drop is not None else batch)

    def layer_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens its layers compute for the batch it forwards (fewer than `trained_tokens` where prompts
        are shared)."""
        return layer_tokens(self.model, self._kept(batch) if self.drop is not None else batch)

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> None:
        c = self.c
        if self.drop is not None:
            batch = self._kept(batch)
            c = coefficients(batch)
        if self.controller is not None:
            t = time.perf_counter()
            timed, self.timed = self.timed, None
            self.controller.begin_mini_batch([self.exposure_l2], [layer_tokens(self.model, batch)],
                                             seconds_per_token=timed, row_tokens=[tokens_of(batch)])
            plan = self.controller.plan_micro_batch(0)
            self.runtime.set_plan(self.controller.runtime_plan(plan), measure=False)
            self.plan_s.append(time.perf_counter() - t)
        head = (lambda fn, *args: self.runtime.call("head", fn, *args)) if self.runtime is not None else None
        with self.context() if self.context is not None else _null():
            with forward_context(self.config):
                loss = loss_of(self.model, batch, c, head)
            loss.backward()

    def gradient(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(batch)
        grad = torch.cat([_full(p.grad).flatten() for p in self.model.parameters() if p.grad is not None])
        self.optimizer.zero_grad(set_to_none=True)
        return grad.double()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain tensor: a DTensor's (verl_offload's FSDP2-wrapped model) gathered whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _boundary_codec(fmt: str, hidden_size: int, min_bytes: int = 16384):
    """Saved-tensor hooks compressing what GC's outer graph saves of the residual stream (the layer
    inputs, last dim = hidden size); parameters, logits and small tensors stay as they are."""
    def pack(t):
        if (t.is_floating_point() and t.shape[-1] == hidden_size and t.numel() * t.element_size() >= min_bytes
                and t.grad_fn is not None and not isinstance(t, torch.nn.Parameter)):
            return quantize(t.detach(), fmt, 64), t.requires_grad
        return t

    def unpack(x):
        if isinstance(x, tuple):
            return dequantize(x[0]).requires_grad_(x[1]) if x[1] else dequantize(x[0])
        return x

    return lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def build(name: str, config: BenchConfig, batch: dict[str, torch.Tensor], budget: BudgetConfig | None = None,
          risk_budget: float = 0.01) -> Method:
    """A fresh policy copy with method `name` applied (planners: profiled and calibrated by the engine's
    session, under `budget`)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    if name == "verl_offload" and not torch.cuda.is_available():
        raise Unavailable("verl's activation offload copies on a CUDA side stream; no GPU here")
    model = build_model(config)
    if name in SHARED:
        install_shared_attention(model)  # a no-op where the config already attends per sequence
        setattr(model, SHARE_ATTRIBUTE, True)
        name = name.removesuffix("_shared")
    optimizer = make_optimizer(model, config)
    method = Method(name, model, optimizer, c=coefficients(batch), config=config)
    method.exposure_l2 = float(method.c.pow(2).sum().sqrt())
    if name == "gc_drop_zero_adv":
        method.drop = "zero_advantage"
    elif name in PLANNERS:
        method.drop = "zero_coef"
    # planners: as verl's engine has it (model.enable_gradient_checkpointing, on by default), which the
    # runtime takes over and runs hands-off for a plan that is exactly checkpointing
    if name in ("gc", "gc_drop_zero_adv", "hidden_offload", "int8_boundary", "fp8_boundary", *PLANNERS):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if name == "hidden_offload":
        method.context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    elif name in ("int8_boundary", "fp8_boundary"):
        method.context = _boundary_codec(name.split("_")[0], model.config.hidden_size)
    elif name == "verl_offload":  # GPU only; verl's recipes pair it with GC
        from hilore_verl.integration.tools.verl_offload import enable_verl_activation_offload

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        enable_verl_activation_offload(model)
        # fully_shard replaced the parameters by DTensors: the optimizer must hold those
        method.optimizer = make_optimizer(model, config)
    elif name in RUNTIME_ONLY:
        method.runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=16384))
        method.runtime.set_plan(hilore_verl.Plan(default=RUNTIME_ONLY[name]))
    elif name in PLANNERS:
        _attach_planner(method, batch, budget or BudgetConfig(), risk_budget if name == "hilore" else 0.0)
    return method


def _attach_planner(method: Method, batch, budget: BudgetConfig, risk_budget: float, state: dict | None = None) -> None:
    """The engine's session on the bench's model: its first step's profile -> calibrate -> controller on the
    batch the planner trains (zero-exposure sequences left out), or, from `state`, a resumed run's controller
    (no probes)."""
    hilore = HiLoReConfig(enable=True, budget=budget, risk_budget=risk_budget, audit_every=0,
                          profile_tokens=method.config.profile_tokens, token_bucket=1)  # one fixed mini-batch
    runtime = hilore_verl.attach(method.model, hilore_verl.RuntimeConfig(min_bytes=hilore.min_bytes, seed=hilore.seed))
    session = Session(hilore, runtime, BenchPasses(method.model, method.optimizer, method.config, runtime))
    session.restore(state)
    session.build_controller([method._kept(batch)])
    method.runtime, method.controller = runtime, session.controller


def planner_state(method: Method) -> dict:
    """What a fresh process needs to run the same planner without profiling again."""
    controller = method.controller
    return {"controller": controller.state_dict(), "budget": (controller.budget.mode, controller.budget.value),
            "risk_budget": controller.risk_budget}


def build_from_state(name: str, config: BenchConfig, batch, state: dict) -> Method:
    """A planner as `build` makes it, its controller from `planner_state` (a resumed session: no probes)."""
    model = build_model(config)
    if name in SHARED:
        install_shared_attention(model)
        setattr(model, SHARE_ATTRIBUTE, True)
    method = Method(name, model, make_optimizer(model, config), c=coefficients(batch), config=config,
                    drop="zero_coef")
    method.exposure_l2 = float(method.c.pow(2).sum().sqrt())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as build()
    _attach_planner(method, batch, BudgetConfig(*state["budget"]), state["risk_budget"], state["controller"])
    return method
