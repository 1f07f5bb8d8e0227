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

A method is built once (`build`) and then steps. A planner is a `SessionMethod` (bench/session_passes.py):
its every step runs through the engine's own `Session`, which profiled and calibrated at `build` as verl's
first step does; the baselines are `Method`s (bench/method.py).
"""

from __future__ import annotations

import torch

import hilore_verl
from hilore_verl.bench.method import Method
from hilore_verl.bench.session_passes import SessionMethod
from hilore_verl.bench.actor_update import SHARE_ATTRIBUTE, BenchConfig, build_model, make_optimizer
from hilore_verl.training.config import HiLoReConfig
from hilore_verl.kernels import dequantize, quantize
from hilore_verl.planner import BudgetConfig
from hilore_verl.shared_prompt import install as install_shared_attention

SHARED = ("no_gc_shared", "gc_shared", "hilore_shared")  # the same methods on the shared-prompt layout
# `hilore-verl bench` without --methods (the CLI's help names them; tests/bench/test_bench_on_cpu.py holds the two
# together)
DEFAULT = ("no_gc", "gc", "verl_offload", "hidden_offload", "int8_boundary", "fp8_boundary", "keep_recompute", "hilore")
METHODS = (*DEFAULT[:2], "gc_drop_zero_adv", *DEFAULT[2:], "runtime_keep", "runtime_recompute", *SHARED)
PLANNERS = ("keep_recompute", "hilore", "hilore_shared")
SWEPT = ("keep_recompute", "hilore")  # the planners the budget sweep runs
# the runtime's own cost, no planner, the same plans as two baselines run through its hooks: every unit kept
# (against no_gc), and GC's plan, every decoder layer's units recomputed and the head kept (against gc)
RUNTIME_ONLY = {"runtime_keep": "keep", "runtime_recompute": "gc"}


class Unavailable(Exception):
    """The method cannot run on this machine (reason in the message)."""


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
    session on `batch`, under `budget`)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    if name in PLANNERS:
        method = SessionMethod(name, config, planner_config(name, config, budget or BudgetConfig(), risk_budget),
                               shared=name in SHARED)
        method.build_controller(batch)
        return method
    if name == "verl_offload" and not torch.cuda.is_available():
        raise Unavailable("verl's activation offload copies on a CUDA side stream; no GPU here")
    model = build_model(config)
    if name in SHARED:
        install_shared_attention(model)  # a no-op where the config already attends per sequence
        setattr(model, SHARE_ATTRIBUTE, True)
        name = name.removesuffix("_shared")
    method = Method(name, model, make_optimizer(model, config), config,
                    drop="zero_advantage" if name == "gc_drop_zero_adv" else None)
    if name in ("gc", "gc_drop_zero_adv", "hidden_offload", "int8_boundary", "fp8_boundary"):
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
        if RUNTIME_ONLY[name] == "gc":  # the runtime takes HF's checkpointing over as its own plan
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        method.runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=16384))
        plan = method.runtime.checkpoint_plan() if RUNTIME_ONLY[name] == "gc" else hilore_verl.Plan(default="keep")
        # as training runs a plan (no byte accounting), every forward through the runtime's hooks, never hands-off
        method.runtime.set_plan(plan, measure=False, hands_off=False)
    return method


def planner_config(name: str, config: BenchConfig, budget: BudgetConfig, risk_budget: float) -> HiLoReConfig:
    """The planners' hilore config: keep / recompute plans without a risk budget; one fixed mini-batch per
    step (token_bucket 1), no gradient audit (the bench measures the gradient error itself)."""
    return HiLoReConfig(enable=True, budget=budget, risk_budget=0.0 if name == "keep_recompute" else risk_budget,
                        audit_every=0, profile_tokens=config.profile_tokens, token_bucket=1)


def build_from_state(name: str, config: BenchConfig, batch, state: dict) -> SessionMethod:
    """A planner as `build` makes it, its controller from `SessionMethod.state` (a resumed session: no probes)."""
    hilore = planner_config(name, config, BudgetConfig(*state["budget"]), state["risk_budget"])
    method = SessionMethod(name, config, hilore, state=state["controller"], shared=name in SHARED)
    method.build_controller(batch)
    method.controller.arms.hold(state["arm"])
    return method
