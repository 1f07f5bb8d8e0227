"""Physical peak of one actor update of the bench's workload under a given runtime plan (CPU).

    python benchmarks/plan_peak.py --report bench.json --variant as_planned
    HILORE_VERL_CPU_CODEC=reference python benchmarks/plan_peak.py --report bench.json

Takes HiLoRe's plan from a `hilore-verl bench --json` report. Variants: `as_planned`; `kept`, its
compressed units kept instead; `recomputed`, every unit recomputed. Runs a warm-up step, resets the
kernel's high-water mark, runs one step and prints VmHWM over the resident size before the model
was built (as `hilore-verl bench` measures peaks). Linux only; run it with
MALLOC_MMAP_THRESHOLD_=131072 so that freed memory leaves the process, as the bench's peaks do.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import hilore_verl
from hilore_verl.bench.peak import _status_kib
from hilore_verl.bench.actor_update import BenchConfig, build_model, forward_context, loss_of, make_batch

VARIANTS = ("as_planned", "kept", "recomputed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="a `hilore-verl bench --json` report (default workload)")
    parser.add_argument("--variant", choices=VARIANTS, default="as_planned")
    args = parser.parse_args()
    report = json.load(open(args.report))
    plan = report["methods"]["hilore"]["plan"]
    if args.variant == "kept":
        plan = {k: v if v in ("keep", "recompute") else "keep" for k, v in plan.items()}
    elif args.variant == "recomputed":
        plan = {k: "recompute" for k in plan}
    config = BenchConfig()
    batch = make_batch(config)
    hilore_verl.kernels.warm_up()  # the codec's compiled code is part of the base, as in the bench
    base = _status_kib("VmRSS")
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=16384))
    runtime.set_plan(plan)

    def step():
        with forward_context(config):
            loss = loss_of(model, batch, batch["coef"], lambda fn, *a: runtime.call("head", fn, *a))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    codec = os.environ.get("HILORE_VERL_CPU_CODEC", "fused")
    print(f"{args.variant} ({codec} codec): peak {(_status_kib('VmHWM') - base) / 1024:.1f} MiB; "
          f"plan {sorted(set(plan.values()))}")


if __name__ == "__main__":
    main()
