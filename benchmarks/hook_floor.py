"""What saved-tensor hooks cost by themselves, beside what the runtime's cost with every unit kept.

    OMP_NUM_THREADS=2 python benchmarks/hook_floor.py [--rounds 40 --hidden 512 --layers 4]

Three copies of the bench's policy on its default workload (attention per packed sequence), timed in
paired rounds, the order rotated each round: no GC; no GC under hooks that only detach on pack and hand
the tensor back on unpack (the least any saved-tensor hook can do); the runtime with every unit kept,
as training runs a plan (`runtime_keep`: its unit hooks on every call, its saved-tensor hooks off inside
kept calls that only kept units fed, runtime/hook_scope.py). Prints each one's throughput over no GC's
with its 95% interval: the first is what a save through any hook costs. Runs under the bench's malloc setting
(`cli.CACHING_MALLOC`, re-executing itself once): with glibc's default every no-GC step pays page faults
a GPU never pays, which hides part of the hooks' share.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hilore_verl.cli import CACHING_MALLOC  # noqa: E402
from hilore_verl.bench import methods as M  # noqa: E402
from hilore_verl.bench.actor_update import BenchConfig, make_batch  # noqa: E402
from hilore_verl.measure.intervals import paired_ratio_ci  # noqa: E402


def bare_hooks():
    """Hooks that hold each saved tensor as a detached alias (no cycle through its own node) and nothing more."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda held: held)


def main() -> None:
    if sys.platform.startswith("linux") and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=192)
    args = parser.parse_args()
    config = BenchConfig(hidden_size=args.hidden, num_layers=args.layers, max_response_len=args.response_len,
                         per_sequence_attention=True)
    batch = make_batch(config)
    methods = {"no_gc": M.build("no_gc", config, batch), "bare_hooks": M.build("no_gc", config, batch),
               "runtime_keep": M.build("runtime_keep", config, batch)}
    methods["bare_hooks"].context = bare_hooks
    for method in methods.values():  # warm-up: allocator, autocast caches
        method.step(batch)
        method.step(batch)
    names = list(methods)
    seconds = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds[name].append(methods[name].step(batch))
    print(f"{args.rounds} paired rounds, hidden {args.hidden}, {args.layers} layers; throughput over no GC's [95%]:")
    for name in names[1:]:
        mean, low, high = paired_ratio_ci(seconds["no_gc"], seconds[name])
        print(f"  {name:14s} {mean:.3f}x [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
