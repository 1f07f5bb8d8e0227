"""Fused CPU codecs: the reference's own tensor code (`reference.quantize_2d` / `dequantize_2d`)
compiled by torch.compile, whose C++ backend fuses each pass into one vectorized loop.

One compiled function per (format, group size, rounding) for quantize and per (format, group
size, dtype) for dequantize, each run on the input viewed as one group per row: (N, group_size)
with N dynamic and the group width static. So neither a new token count nor another tensor width
recompiles (a symbolic width would also keep the loops over a group from being vectorized, about
10x slower), and the codes, scales and element order are those of the (R, D) layout. The calls
run without autograd and autocast, so the caller's modes never cause a recompile either.
Bitwise equal to the reference (tested over formats, dtypes, odd shapes, stochastic rounding
and non-finite groups). If compiling fails (no C++ compiler, an unusual platform), one warning
is logged and the reference runs instead. `status()` tells which ran: the calls the compiled code
served, the calls the reference served in its place, and the compile error if there was one.
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from hilore_verl.kernels import reference
from hilore_verl.kernels.reference import QuantizedTensor, check_args, seed_mix

logger = logging.getLogger("hilore_verl")
_failed: list[str] = []  # the first compile error, once seen: the reference runs from then on
_calls = {"fused": 0, "reference": 0}  # calls served by the compiled code / by the reference in its place


def available() -> bool:
    """False once a compile has failed (the reference serves every call from then on). True before
    the first call too: that the compiled code ran is what `status()["fused_calls"]` tells."""
    return not _failed


def status() -> dict:
    """What this process's calls ran: {"compiled": no compile has failed, "fused_calls": calls the
    compiled code served, "reference_calls": calls the reference served after a compile failure,
    "error": the first compile error or None}."""
    return {"compiled": not _failed, "fused_calls": _calls["fused"], "reference_calls": _calls["reference"],
            "error": _failed[0] if _failed else None}


@functools.lru_cache(maxsize=None)
def _quantize_fn(fmt: str, group_size: int, stochastic: bool):
    def fn(x: torch.Tensor, smix: int):
        return reference.quantize_2d(x, fmt, group_size, stochastic, smix)

    return _compiled(fn, f"quantize_{fmt}_g{group_size}" + ("_sr" if stochastic else ""))


@functools.lru_cache(maxsize=None)
def _dequantize_fn(fmt: str, group_size: int, dtype: torch.dtype):
    def fn(codes: torch.Tensor, scales: torch.Tensor):
        return reference.dequantize_2d(codes, scales, fmt, group_size, dtype)

    return _compiled(fn, f"dequantize_{fmt}_g{group_size}_{str(dtype).split('.')[-1]}")


def _compiled(fn, name: str):
    """torch.compile of `fn` under a code object of its own: compiled code is cached per code
    object (with a small limit), so variants sharing one closure's code would evict each other."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return torch.compile(types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__),
                         dynamic=False)


def _run(fused, fallback):
    if not _failed:
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                out = fused()
            _calls["fused"] += 1
            return out
        except Exception as e:  # a compiler missing or failing: never a crash, one warning
            _failed.append(f"{type(e).__name__}: {e}")
            logger.warning("hilore-verl: the fused CPU codec could not be compiled (%s); the torch reference "
                           "codec runs instead (correct, slower)", _failed[0].splitlines()[0][:300])
    _calls["reference"] += 1
    return fallback()


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    check_args(x, fmt, group_size)
    D = x.shape[-1]
    groups = x.reshape(-1, group_size)  # (R * G, group_size): the same elements in the same order
    torch._dynamo.maybe_mark_dynamic(groups, 0)
    smix = torch.tensor(seed_mix(seed) if stochastic else 0, dtype=torch.int64)  # a tensor: no recompile per seed
    codes, scales, flags = _run(lambda: _quantize_fn(fmt, group_size, stochastic)(groups, smix),
                                lambda: reference.quantize_2d(groups, fmt, group_size, stochastic, int(smix)))
    R = groups.shape[0] * group_size // D
    return QuantizedTensor(codes.view(R, -1), scales.view(R, -1), flags.view(R, -1), x.shape, x.dtype, fmt,
                           group_size)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    codes, scales = q.codes.reshape(q.scales.numel(), -1), q.scales.reshape(-1, 1)  # one group per row
    torch._dynamo.maybe_mark_dynamic(codes, 0)
    torch._dynamo.maybe_mark_dynamic(scales, 0)
    out = _run(lambda: _dequantize_fn(q.fmt, q.group_size, q.dtype)(codes, scales),
               lambda: reference.dequantize_2d(codes, scales, q.fmt, q.group_size, q.dtype))
    return out.reshape(q.shape)
