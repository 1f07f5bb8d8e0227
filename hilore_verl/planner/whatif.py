"""What a plan would be for a model on a GPU, from its config alone (`hilore-verl plan`): no GPU, no weights.

Costs come from `analytic_costs` (meta-device forward, FLOP and byte estimates). Static memory per
GPU, FSDP-sharded over `gpus` ranks with fp32 master weights, gradients and two Adam moments, plus
the unsharded bf16 parameters of two decoder layers (the one running and the one prefetched):

    static = 16 * params / gpus + 2 * 2 * params_per_layer

Step time, with F the sum of unit forward times: no GC ~ 3F (forward + backward at 2x);
full GC ~ 4F; a plan ~ 3F + the plan's extra time (recomputed forwards, codec passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilore_verl.planner.analytic import analytic_costs
from hilore_verl.planner.budget import GIB, BudgetConfig
from hilore_verl.planner.controller import Controller
from hilore_verl.runtime.plan import KEEP, RECOMPUTE, UnitPlan


@dataclass
class WhatIf:
    model: str
    tokens: int
    gpus: int
    gpu_mem_gib: float
    params: int
    static_gib: float
    gc_peak_gib: float
    no_gc_peak_gib: float
    budget_gib: float
    peak_gib: float
    plan: dict[str, UnitPlan]
    unit_held_mib: dict[str, float]
    gc_extra_s: float
    plan_extra_s: float
    forward_s: float

    @property
    def saved_vs_gc(self) -> float:
        """Predicted share of a full-GC step's time saved by the plan."""
        return (self.gc_extra_s - self.plan_extra_s) / (3 * self.forward_s + self.gc_extra_s)

    def table(self) -> str:
        layers: dict[str, dict[str, UnitPlan]] = {}
        for unit, choice in self.plan.items():
            parts = unit.split(".")
            row, col = (f"layer {parts[1]}", ".".join(parts[2:])) if parts[0] == "layers" else (unit, unit)
            layers.setdefault(row, {})[col] = choice
        kinds = sorted({k for cols in layers.values() for k in cols if k != "head"})
        lines = ["unit plan (keep / recompute; compression is calibrated on the real model at the first step)",
                 "           " + " ".join(f"{k:>10}" for k in kinds)]
        for row, cols in layers.items():
            if row == "head":
                lines.append(f"{'head':>10} {cols['head']:>10}")
            else:
                lines.append(f"{row:>10} " + " ".join(f"{cols.get(k, '-'):>10}" for k in kinds))
        counts: dict[str, int] = {}
        for choice in self.plan.values():
            counts[str(choice)] = counts.get(str(choice), 0) + 1
        lines += ["",
                  f"model {self.model}: {self.params / 1e9:.2f} B parameters, {self.tokens} tokens per micro-batch, "
                  f"{self.gpus} GPUs of {self.gpu_mem_gib:g} GiB",
                  f"static per GPU (sharded weights, grads, Adam; two unsharded layers): {self.static_gib:.2f} GiB",
                  "peaks, lower bounds (from the config alone: what the units save and hold, the static bytes; "
                  "not the CUDA context, the allocator's fragmentation or the framework's own buffers):",
                  f"  full GC {self.gc_peak_gib:.2f} GiB, no GC {self.no_gc_peak_gib:.2f} GiB, "
                  f"budget {self.budget_gib:.2f} GiB, this plan {self.peak_gib:.2f} GiB "
                  f"({', '.join(f'{n} {c}' for c, n in sorted(counts.items()))})",
                  f"predicted actor-update time saved against full GC: {100 * self.saved_vs_gc:.1f}% "
                  f"(recompute {1e3 * self.plan_extra_s:.1f} ms instead of {1e3 * self.gc_extra_s:.1f} ms "
                  f"per micro-batch; forward {1e3 * self.forward_s:.1f} ms)"]
        return "\n".join(lines)


def what_if(config, model_name: str, tokens: int, seq_len: int, gpus: int, gpu_mem_gib: float,
            budget: BudgetConfig, flops_per_s: float = 400e12, bytes_per_s: float = 3e12,
            row: int | None = None) -> WhatIf:
    """The plan for micro-batches whose layers compute `tokens`; `row`: the ordinary packed row's tokens
    where the shared-prompt layout computes fewer (the head's and the gc_ratio budget's size, as the
    controller counts them)."""
    row = tokens if row is None else row
    costs = analytic_costs(config, tokens, seq_len, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s,
                           formats=())
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    static = 16 * params / gpus + 2 * 2 * per_layer
    capacity = gpu_mem_gib * GIB
    controller = Controller(None, costs, None, budget, static_bytes=static, free_bytes=capacity)
    if controller.gc_peak > capacity:
        raise ValueError(f"full recompute alone needs {controller.gc_peak / GIB:.2f} GiB per GPU, more than the "
                         f"{gpu_mem_gib:g} GiB of the device: use fewer --micro-batch-tokens or more --gpus")
    budget_bytes = controller.memory_budget_at(row)
    if budget_bytes > capacity:
        raise ValueError(f"the budget {budget_bytes / GIB:.2f} GiB is more than the {gpu_mem_gib:g} GiB "
                         f"of the device: lower --budget (e.g. gib:{gpu_mem_gib * 0.9:.0f} or auto:2)")
    plan = controller.search.plan_for(tokens, row=row)
    options = {u.name: {o.plan: o for o in costs.options(u, tokens)} for u in costs.units}
    chosen = {n: options[n][c] for n, c in plan.items()}
    recompute = {n: options[n][RECOMPUTE] for n in plan}
    no_gc = controller.predicted_peak({n: KEEP for n in plan}, tokens)
    gc_peak = controller.predicted_peak(controller.gc_plan(), tokens)
    return WhatIf(model_name, tokens, gpus, gpu_mem_gib, params, static / GIB, gc_peak / GIB, no_gc / GIB,
                  budget_bytes / GIB, controller.predicted_peak(plan, tokens) / GIB, plan,
                  {n: o.memory / 2**20 for n, o in chosen.items()}, sum(o.time for o in recompute.values()),
                  sum(o.time for o in chosen.values()),
                  sum(costs.forward(u, tokens) for u in costs.units))


def shared_tokens(tokens: int, prompt_len: int, response_len: int, group_size: int) -> int:
    """A micro-batch of `tokens` ordinary tokens in the shared-prompt layout: a group of n sequences of
    P + R tokens holds P + n R there, so T_s = T (P + n R) / (n (P + R))."""
    n, p, r = group_size, prompt_len, response_len
    return max(1, round(tokens * (p + n * r) / (n * (p + r))))


def shared_summary(plain: WhatIf, shared: WhatIf, prompt_len: int, response_len: int, group_size: int) -> str:
    """What computing each group's prompt once changes, from the two plans (step ~ 3F + extra time, as above)."""
    def step(w: WhatIf, extra: float) -> float:
        return 3 * w.forward_s + extra

    gc_saved = 1 - step(shared, shared.gc_extra_s) / step(plain, plain.gc_extra_s)
    plan_saved = 1 - step(shared, shared.plan_extra_s) / step(plain, plain.gc_extra_s)
    return (f"shared prompt (prompts {prompt_len}, responses {response_len}, {group_size} per prompt): "
            f"{shared.tokens} instead of {plain.tokens} tokens per micro-batch "
            f"({100 * (1 - shared.tokens / plain.tokens):.0f}% fewer); full GC peak {shared.gc_peak_gib:.2f} "
            f"instead of {plain.gc_peak_gib:.2f} GiB; predicted time saved against full GC without it: "
            f"{100 * gc_saved:.1f}% with full GC, {100 * plan_saved:.1f}% with the plan at its budget "
            f"({shared.budget_gib:.2f} GiB, GC's without the layout; this plan {shared.peak_gib:.2f} GiB, "
            f"{sum(c == KEEP for c in shared.plan.values())} of {len(shared.plan)} units kept)")


def parse_budget(text: str) -> BudgetConfig:
    """`gc_ratio:1.10`, `gib:40` or `auto:2` (GiB of headroom: as `hilore.budget.mode=auto`, it needs one;
    at none a plan would fill the device to its last byte)."""
    mode, _, value = text.partition(":")
    try:
        if not value:
            raise ValueError("a value is needed" + (" (auto: the GiB of headroom to leave free)" if mode == "auto" else ""))
        number = float(value)
        return BudgetConfig(mode, number)
    except ValueError as err:
        raise ValueError(f"bad --budget {text!r}: {err}; use gc_ratio:1.10, gib:40 or auto:2") from None
