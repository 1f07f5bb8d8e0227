"""A measured cost table given a GPU's proportions, for tests whose plans must compress."""

import dataclasses

from hilore_verl.planner.state import HEAD_TRANSIENTS


def gpu_like_profile(real_profile):
    """On CPU the torch reference codec is slower than recomputing these tiny units, so the planner
    rightly recomputes; give the measured table a GPU's proportions so that compression is worth it
    (and no codec working memory, as Triton's: the reference's fp32 temporaries outweigh a tiny model's
    activations).
    The hooks' overhead is set too (none, as on a GPU): measured, it made the plan depend on the host's
    timing (a slow probe priced the hands-off baseline cheaper and no unit compressed), and every unit's
    forward time is linear in tokens (the measured quadratic and fixed shares of a tiny unit's time are
    noise that made the plan, and whether any unit compressed, differ from run to run). And the table's
    reserve for the backward is its largest unit's, not the measured transients (of either phase): under
    FSDP2 on gloo the allocations' order follows the prefetch threads, and the measured peak moved by one layer's gathered
    parameters between two profiles of the same engine (enough to change a tiny model's plan)."""

    def profile(*args, **kwargs):
        costs = dataclasses.replace(real_profile(*args, **kwargs), codec_bytes_per_s=1e12, runtime_overhead_s=0.0,
                                    codec_transient=0.0, codec_transient_cap=0.0,
                                    transient_bytes=0.0, transient_fixed=0.0, gradients_at_peak=1.0,
                                    forward_transient_bytes=0.0, forward_transient_fixed=0.0,
                                    **{f"{stem}_{part}": 0.0 for stem in HEAD_TRANSIENTS for part in ("bytes", "fixed")})
        costs.units = [dataclasses.replace(u, forward_s=1e-3, forward_quadratic=0.0, forward_fixed=0.0)
                       for u in costs.units]
        return costs

    return profile
