"""`hilore-verl doctor`: can hilore-verl and verl's FSDP2 engine run here? Prints each check and a verdict.

Importing this module imports nothing heavy; each check imports what it needs, so a missing or
broken dependency becomes a failed check with a fix, not a traceback.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, TextIO

from hilore_verl.validation.versions import SUPPORTED, installed_version, version_problems

PACKAGES = ("torch", "triton", "verl", "transformers")


@dataclass
class Check:
    ok: bool
    detail: str
    fix: str = ""


def check_versions() -> Check:
    found = {p: installed_version(p) for p in PACKAGES}
    detail = f"python {platform.python_version()}, " + ", ".join(f"{p} {v or 'missing'}" for p, v in found.items())
    problems = version_problems()
    if found["transformers"] is None:
        problems_text = "transformers is not installed"
    else:
        problems_text = "; ".join(str(p) for p in problems)
    ok = not problems and found["transformers"] is not None
    ranges = ", ".join(f"{p}{s}" for p, s in SUPPORTED.items())
    return Check(ok, detail, "" if ok else f"{problems_text} (supported: {ranges})")


def check_device() -> Check:
    import torch

    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return Check(True, f"{torch.cuda.device_count()} CUDA device(s): {', '.join(names)}")
    return Check(True, f"no GPU found; CPU only ({os.cpu_count()} cores, {platform.machine()})")


RECIPE_ATTENTION = "flash_attention_2"  # verl's actor default (model.override_config.attn_implementation); the recipes keep it


def check_attention() -> Check:
    """On a GPU the recipes run the actor with verl's default attention, FlashAttention-2 (varlen over
    the unpadded rows, use_remove_padding), which verl[vllm] does not install."""
    import torch

    if not torch.cuda.is_available():
        return Check(True, f"not applicable: no CUDA device (the recipes' {RECIPE_ATTENTION} runs on GPUs only)")
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return Check(False, f"the recipes' actor attention ({RECIPE_ATTENTION}, verl's default) is not available: "
                            "flash-attn is not installed or does not match this torch",
                     "pip install flash-attn --no-build-isolation (built against the installed torch), or run "
                     "with actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    return Check(True, f"{RECIPE_ATTENTION} available (flash-attn {installed_version('flash-attn') or '?'})")


def check_triton() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check(True, "not applicable: no CUDA device (CPU tensors use the CPU codec)")
    from hilore_verl.kernels import triton_guard

    device = torch.device("cuda", torch.cuda.current_device())
    ok, reason = triton_guard.triton_status(device)
    if ok:
        ok, reason = triton_guard.bitwise_check(device)
    if not ok:
        fixes = [fix for _, fix in triton_guard.missing_pieces()]
        return Check(False, f"{reason} (compressed tensors would use the torch reference codec: correct, slower)",
                     "; ".join(fixes) or "see the detail; run tests/kernels/test_triton_codecs_on_cpu.py for more")
    return Check(True, f"quantize / dequantize launched on {device}: bit for bit the torch reference (int8, fp8, "
                       "int4; nearest and stochastic rounding; bf16 and fp32)")


def check_plugin() -> Check:
    entry = [ep for ep in metadata.entry_points(group="verl.plugins") if ep.value.startswith("hilore_verl")]
    if not entry:
        return Check(False, "no 'verl.plugins' entry point for hilore_verl",
                     "reinstall hilore-verl into this environment (pip install -e . or pip install hilore-verl)")
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none" or (policy != "auto" and entry[0].name not in policy.split(",")):
        return Check(False, f"verl plugin loading is restricted: VERL_USE_EXTERNAL_PLUGINS={policy}",
                     f"unset VERL_USE_EXTERNAL_PLUGINS or add '{entry[0].name}' to it")
    from hilore_verl.integration.tools.selfcheck import import_verl

    import_verl()  # verl loads the plugin (its entry point): STATUS says how that went
    from hilore_verl.plugin import STATUS

    if not STATUS.loaded:
        return Check(False, f"entry point found but loading failed: {STATUS.error}",
                     "fix the error above; verl otherwise ignores the plugin silently")
    return Check(True, f"loaded by `import verl`; registered {', '.join(STATUS.registered)}")


def check_platform() -> Check:
    from hilore_verl.integration.tools.selfcheck import platform_in_use

    return Check(True, platform_in_use())


def check_engine() -> Check:
    from hilore_verl.integration.tools.selfcheck import engine_selfcheck

    # verl and transformers print set-up chatter while the engine builds: keep it for failures only.
    chatter = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            warnings.simplefilter("ignore")
            result = engine_selfcheck()
    except Exception:
        sys.stderr.write(chatter.getvalue())
        raise
    if not result.ok:
        sys.stderr.write(chatter.getvalue())
    detail = f"{result.detail} ({result.seconds:.1f} s)"
    return Check(result.ok, detail, "" if result.ok else "see the detail; run the tests for more")


CHECKS: tuple[tuple[str, Callable[[], Check], tuple[str, ...]], ...] = (
    # (name, check, checks that must have passed for it to run)
    ("versions", check_versions, ()),
    ("device", check_device, ()),
    ("attention", check_attention, ()),
    ("Triton kernels", check_triton, ()),
    ("verl plugin", check_plugin, ("versions",)),
    ("verl platform", check_platform, ("verl plugin",)),
    ("FSDP2 engine", check_engine, ("verl plugin",)),
)


def run(out: TextIO = sys.stdout) -> int:
    """Run every check, print a line each and a verdict; 0 when hilore-verl is usable here."""
    from hilore_verl import __version__

    print(f"hilore-verl {__version__} doctor", file=out, flush=True)
    results: dict[str, Check] = {}
    for name, check_fn, needs in CHECKS:
        blocked = [n for n in needs if not results[n].ok]
        if blocked:
            check = Check(False, f"skipped: needs {', '.join(blocked)}")
        else:
            try:
                check = check_fn()
            except Exception as exc:  # noqa: BLE001 - a failed check, with its reason
                check = Check(False, f"{type(exc).__name__}: {exc}", "see the error above")
        results[name] = check
        print(f"  [{'ok' if check.ok else 'FAIL'}] {name}: {check.detail}", file=out, flush=True)
    failed = {name: c for name, c in results.items() if not c.ok}
    if failed:
        print("verdict: NOT usable here. To fix:", file=out)
        for name, c in failed.items():
            if c.fix:
                print(f"  - {name}: {c.fix}", file=out)
        return 1
    print("verdict: usable here.", file=out)
    return 0
