"""`hilore-verl gpu-check`: validate and measure hilore-verl on one GPU in one run, on a bare machine.

Needs torch, triton, transformers and numpy only (no verl, Ray, hydra, omegaconf or network); from a
clone without installing: `PYTHONPATH=. python -m hilore_verl gpu-check --out DIR`. Six stages, each
in a process of its own under its own time limit (a failing or hung stage is recorded, the next one
runs), the report rewritten after every stage so that it exists whatever happens:

    environment   versions, device, compiler / Python.h / libcuda, one Triton launch, a cold compile's
                  seconds (the later limits follow it); without CUDA, what is missing
    codecs        Triton against the torch reference bit for bit; codec bandwidth against a device copy
    runtime       keep / recompute mixes bitwise on the device, compression within bounds, offload over
                  steps of varying tokens, host synchronisations of a warmed step against a budget
    shared_prompt the shared-prompt layout (FlexAttention on CUDA) against the per-sequence forward:
                  log-probs, gradients, times, and which kernel served each pass
    model         a real architecture (random weights), every row in a fresh process, like for like,
                  GC and HiLoRe first: peaks, step times, HiLoRe's predicted against measured, targets
    profile       one HiLoRe step under the profiler: top kernels, share of host time in hilore-verl

`--device cpu --tiny` runs every stage on the CPU at tiny sizes (the test suite does, so the check
cannot rot). Outputs: DIR/gpu_check.json, DIR/gpu_check.md, one DIR/stage_<name>.json per stage;
DIR defaults to $OUT.

A tool on top: may import bench and the core packages; never verl, Ray or integration.
"""

from hilore_verl.gpucheck.run import STAGES, run_check

__all__ = ["STAGES", "run_check"]
