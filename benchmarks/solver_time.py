"""Planner solver time for N units (default 200) with keep / recompute / int8 / fp8 / int4 options.

    python benchmarks/solver_time.py [--units 200] [--repeats 20]

Random but fixed costs (seed 0); three risk budgets: not binding, binding (the risk price is
bisected), and zero (lossy options excluded). Prints the median time per solve.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hilore_verl.planner.solver import Option, solve


def problem(units: int, seed: int = 0) -> list[list[Option]]:
    rng = random.Random(seed)
    out = []
    for _ in range(units):
        keep = rng.uniform(1, 10) * 2**20
        out.append([Option("keep", keep, 0.0), Option("recompute", 0.1 * keep, rng.uniform(1e-4, 2e-3)),
                    Option("int8", keep * 0.53, 2e-5, rng.uniform(0.5, 1.5) * 0.006),
                    Option("fp8", keep * 0.53, 2e-5, rng.uniform(0.5, 1.5) * 0.025),
                    Option("int4", keep * 0.28, 2e-5, rng.uniform(0.5, 1.5) * 0.11)])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    options = problem(args.units)
    memory = 0.4 * sum(o[0].memory for o in options)
    print(f"{args.units} units, 5 options each, memory budget 40% of keeping everything")
    for label, risk in (("risk not binding", 10.0), ("risk binding", 0.05), ("zero risk budget", 0.0)):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sol = solve(options, memory, risk)
            times.append((time.perf_counter() - start) * 1e3)
        lossy = sum(options[u][k].risk > 0 for u, k in enumerate(sol.choices))
        print(f"  {label:17s} median {statistics.median(times):7.2f} ms   lossy units {lossy:3d}   "
              f"risk {sol.risk:.4f} / {risk}")


if __name__ == "__main__":
    main()
