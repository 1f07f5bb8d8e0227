"""GC's overhead over no GC on CPU, with and without glibc malloc keeping freed memory.

    python benchmarks/gc_overhead_malloc.py [--hidden 768 --layers 4 --vocab 4000 --response-len 64]

Runs the bench workload's forward / log-prob / backward / AdamW step twice per method in a child
process, once with the default malloc and once with `hilore-verl bench`'s setting, and prints the
second step's split. Shows why the bench sets it: without it, a CPU step that keeps its
activations pays page faults on every step, which a GPU's caching allocator never pays.
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, time, torch
from hilore_verl.bench import methods as M
from hilore_verl.bench.actor_update import BenchConfig, forward_context, loss_of, make_batch
h, L, V, R = map(int, sys.argv[1:5])
cfg = BenchConfig(hidden_size=h, num_layers=L, vocab_size=V, max_response_len=R)
batch = make_batch(cfg); out = {}
for name in ("no_gc", "gc"):
    m = M.build(name, cfg, batch)
    for _ in range(2):  # the bench's forward and log-probs (packed row, autocast), backward, optimizer step
        t0 = time.perf_counter()
        with forward_context(cfg):
            loss = loss_of(m.model, batch, batch["coef"])
        t1 = time.perf_counter()
        loss.backward(); t2 = time.perf_counter(); m.optimizer.step(); m.optimizer.zero_grad(); t3 = time.perf_counter()
    out[name] = {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0}
print(json.dumps(out))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--response-len", type=int, default=64)
    args = parser.parse_args()
    from hilore_verl.cli import CACHING_MALLOC

    for label, extra in (("default malloc", {}), ("caching malloc", CACHING_MALLOC)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.hidden), str(args.layers), str(args.vocab),
                               str(args.response_len)], env={**env, **extra}, capture_output=True, text=True,
                              check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        split = "; ".join(f"{n}: forward {v['forward_s']:.2f} s, backward {v['backward_s']:.2f} s, "
                          f"AdamW {v['optimizer_s']:.2f} s" for n, v in r.items())
        print(f"{label:15} GC overhead {100 * (r['gc']['step_s'] / r['no_gc']['step_s'] - 1):5.1f}%  ({split})")


if __name__ == "__main__":
    main()
