"""The model's unit map, checked on the driver before Ray starts.

Each worker's engine attaches the runtime after building the model, and `attach` refuses a decoder
block it cannot map completely (hilore_verl/model/unit_maps.py). On a multi-node job that is minutes in,
after Ray, the rollout servers and the weights. verl's `validate_config` runs on the driver before
`ray.init` and hands the actor its `actor_rollout_ref.model` section, so the same check runs there
first, on the model built from its config on the meta device (no weights, no memory):

    check_unit_map(model_config)  # ValueError "hilore-verl cannot map decoder block ..." or None

A user's own map registered with `register_map` in a module named by `model.external_lib` counts:
that module is imported here first, as every worker imports it before building the model. A hub
model id is read from the hub (its config.json alone, through transformers' cache), as verl's workers
will read it. A model whose config cannot be read here (a local folder without config.json, a hub
without network, remote code not trusted) or that the meta device cannot build is checked by the
engine at start-up instead, and the log says so.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("hilore_verl")

WORKER_HINT = ("With verl, make the register_map call in a module named by actor_rollout_ref.model.external_lib, "
               "which the driver and every worker import before building the model.")


def check_unit_map(model_config) -> None:
    """Refuse, with the unit map's own ValueError, a model `attach` would refuse in every worker."""
    import torch
    from transformers import AutoConfig

    from hilore_verl.model.units import find_units
    from verl.utils.import_utils import import_external_libs
    from verl.utils.model import get_hf_auto_model_class

    path = model_config.get("hf_config_path") or model_config.get("path")
    path = os.path.expanduser(str(path)) if path else path
    if not path or (os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))):
        logger.info("hilore-verl: the unit map of %s is checked when the engine starts (no config.json there)", path)
        return
    import_external_libs(model_config.get("external_lib"))
    trust = bool(model_config.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust)
        with torch.device("meta"):  # the class verl's engine builds (a causal LM, or a VLM's)
            model = get_hf_auto_model_class(config).from_config(config, trust_remote_code=trust)
    except Exception as err:  # no hub, remote code, a multimodal config, a transformers too old for it: verl decides
        logger.info("hilore-verl: the unit map of %s is checked when the engine starts (its config could not "
                    "be read or built on the meta device here: %s)", path, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return
    try:
        find_units(model)
    except ValueError as err:
        message = str(err) if str(err).startswith("hilore") else f"hilore-verl: {err}"
        raise ValueError(f"{message} {WORKER_HINT}") from None
