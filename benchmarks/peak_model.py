"""The memory model's predicted peak against the bytes tensors hold, for the plans of several budgets.

    OMP_NUM_THREADS=2 python benchmarks/peak_model.py [--budgets 1.0,1.1,1.25,1.5] [--hidden 384 --layers 6 ...]
        [--zero-advantage-share 0.5]

Builds HiLoRe's planner on the bench's workload (attention per sequence, the zero-exposure sequences left
out, as `hilore-verl bench` runs it), then for each gc_ratio budget runs the plan the
solver chooses there through the runtime on the bench's micro-batch, starting without gradients (the
first micro-batch after zero_grad), and prints the plan, the model's peak and the tensors' peak (the
state the pass starts with plus the most its allocations reach: hilore_verl.measure.allocations).
"""

from __future__ import annotations

import argparse

from hilore_verl.bench import methods as M
from hilore_verl.bench.actor_update import BenchConfig, make_batch
from hilore_verl.bench.peak import state_bytes
from hilore_verl.measure.allocations import allocations
from hilore_verl.planner import BudgetConfig, Controller

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1.0,1.1,1.25,1.5", help="gc_ratio budgets, comma-separated")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--zero-advantage-share", type=float, default=0.5,
                        help="share of groups with one reward, whose sequences are left out (the bench's default)")
    args = parser.parse_args()
    config = BenchConfig(hidden_size=args.hidden, num_layers=args.layers, num_groups=args.groups,
                         max_response_len=args.response_len,
                         zero_advantage_share=args.zero_advantage_share, per_sequence_attention=True)
    batch = make_batch(config)
    method = M.build("hilore", config, batch, BudgetConfig("gc_ratio", 1.10))
    method.step(batch)  # the optimizer's moments exist from here on
    c, tokens, micro = method.controller, method.layer_tokens(batch), method.trained(batch)
    print(f"{tokens} tokens per micro-batch, probe {c.costs.tokens}")
    for ratio in (float(b) for b in args.budgets.split(",")):
        ctl = Controller(c.runtime, c.costs, c.risk, BudgetConfig("gc_ratio", ratio), static_bytes=c.static_bytes,
                         gradient_bytes=c.gradient_bytes, risk_budget=c.risk_budget)
        plan = ctl.search.plan_for(tokens, row=tokens)
        method.runtime.set_plan(ctl.runtime_plan(plan))
        method.optimizer.zero_grad(set_to_none=True)
        start = state_bytes(method.model, method.optimizer)
        measured = start + allocations(lambda: method.passes.loss(micro).backward()).peak
        method.optimizer.zero_grad(set_to_none=True)
        counts: dict[str, int] = {}
        for choice in plan.values():
            counts[str(choice)] = counts.get(str(choice), 0) + 1
        predicted = ctl.predicted_peak(plan, tokens, gradients=False)
        print(f"budget {ratio:g}x GC: {counts}; predicted {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} "
              f"MiB, predicted / measured {predicted / measured:.3f}", flush=True)


if __name__ == "__main__":
    main()
