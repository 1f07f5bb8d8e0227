"""gpu-check stage `shared_prompt`: the shared-prompt layout (hilore.shared_prompt) against the per-sequence
forward on the device, log-probs and gradients; on CUDA through the FlexAttention kernel it runs there
(shared_prompt/flex.py, forward and backward), on the CPU through the per-segment SDPA path.

The kernel the report names is the one that served: `attention.served()` counts the forward and backward
calls each kernel ran during the measured pass, and the stage fails when they are not all the kernel the
device should run (`kernel_on`, read before anything ran), with FlexAttention's failure as the reason."""

from __future__ import annotations

import time

import torch

from hilore_verl.gpucheck.context import Context, StageReport, cosine, tiny_policy


def _groups(ctx: Context) -> list[tuple[int, list[int]]]:
    """(prompt tokens, response tokens of each of its responses) per group."""
    if ctx.tiny:
        return [(24, [8, 16, 12]), (9, [30, 4]), (40, [6, 6, 6, 6])]
    return [(512, [128] * 8), (96, [300, 20, 180, 64]), (1024, [256] * 4)]


def _run(model, fn, sequences, device) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """(response log-probs, gradients of their sum, seconds of the forward + backward)."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    logps = fn(model, sequences)
    sum(lp.float().sum() for lp in logps).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return torch.cat([lp.detach().float() for lp in logps]), grads, seconds


def shared_prompt_stage(report: StageReport, ctx: Context) -> None:
    from hilore_verl.shared_prompt import attention, shared_log_probs, unshared_log_probs

    model, vocab = tiny_policy(ctx)
    device = ctx.torch_device()
    g = torch.Generator().manual_seed(0)
    sequences = []
    for gid, (prompt_len, responses) in enumerate(_groups(ctx)):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        sequences += [(gid, prompt, torch.randint(0, vocab, (r,), generator=g)) for r in responses]
    expected = attention.kernel_on(device)  # what this device should run, before anything ran
    reference, exact, plain_s = _run(model, unshared_log_probs, sequences, device)
    start = time.perf_counter()
    _run(model, shared_log_probs, sequences, device)  # the first call compiles the kernel
    report.figure("first_call_s", round(time.perf_counter() - start, 2))
    attention.reset_served()
    logps, grads, shared_s = _run(model, shared_log_probs, sequences, device)
    _kernel_served(report, attention, expected)
    low = next(model.parameters()).dtype != torch.float32
    diff = float((logps - reference).abs().max())
    bound = 0.1 if low else 1e-4  # bf16: the two layouts round their sums differently
    report.check(f"log-probs equal the per-sequence forward within {bound:g}", diff <= bound, f"max |diff| {diff:.2e}")
    cos, rel = cosine(grads, exact)
    least = 0.999 if low else 0.999999
    report.check(f"gradients: cosine >= {least:g} against the per-sequence forward", cos >= least,
                 f"cosine {cos:.6f}, rel {rel:.2e}")
    report.figure("forward_backward_s", {"per_sequence": round(plain_s, 4), "shared": round(shared_s, 4)})


def _kernel_served(report: StageReport, attention, expected: str) -> None:
    """Pass only when every forward and backward of the measured pass ran `expected`."""
    served = attention.served()
    reason = attention.fallback_reason()
    report.figure("kernel", "+".join(sorted(served)) or "none")
    report.figure("kernel_calls", served)
    if reason is not None:
        report.figure("fallback_reason", reason)
    ran = served.get(expected, {"forward": 0, "backward": 0})
    only = set(served) == {expected} and ran["forward"] > 0 and ran["backward"] > 0
    report.check(f"{expected} served every forward and backward", only,
                 f"served {served}" + (f"; FlexAttention failed: {reason}" if reason else ""))
