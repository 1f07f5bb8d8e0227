"""The controller state beside verl's checkpoint: `hilore_controller.json`, written by rank 0, read and
validated by every rank (plain JSON, nothing executed; see planner/state.py for the format).

A missing, malformed or foreign file is not used: one warning
names the file and why, and the first step profiles and calibrates again. Ranks agree: if one rank
cannot use the file, none does (they would otherwise disagree on profiling, which runs collectives).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from hilore_verl.planner.state import MAX_STATE_BYTES, dump_state, load_state

logger = logging.getLogger("hilore_verl")

STATE_FILE = "hilore_controller.json"


def write_controller_state(state: dict, local_path: str) -> None:
    path = os.path.join(local_path, STATE_FILE)
    try:
        text = dump_state(state)
    except ValueError as err:  # a non-finite number: a resumed run profiles again rather than load it
        logger.warning("hilore-verl: controller state not written to %s (%s); a run resumed from this "
                       "checkpoint profiles and calibrates again", path, err)
        return
    os.makedirs(local_path, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # never a half-written state under the real name


def read_controller_state(local_path: str, unit_names: list[str] | None, group=None) -> dict | None:
    """The validated state, or None (after one warning naming the file and why)."""
    path = os.path.join(local_path, STATE_FILE)
    state, problem = None, None
    if os.path.exists(path):
        try:
            if os.path.getsize(path) > MAX_STATE_BYTES:
                raise ValueError(f"{os.path.getsize(path)} bytes, more than a controller state takes")
            with open(path, "rb") as f:
                state = load_state(f.read(), unit_names)
        except (OSError, ValueError) as err:
            problem = f"{path} is not a usable controller state: {err}"
    else:
        problem = f"{local_path} has no controller state ({STATE_FILE})"
    if dist.is_initialized():
        ok = torch.tensor([0.0 if state is None else 1.0], dtype=torch.float64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if state is not None and ok.item() == 0:
            state, problem = None, f"{path} is valid here, but another rank could not use its controller state"
    if state is None:
        logger.warning("hilore-verl: %s; the first step profiles and calibrates again", problem)
    return state
