"""The verl engine adapter: HiLoRe inside verl's FSDP actor.

`config.py` is the recipe's `_target_` (verl's actor config plus a `hilore:` section); with
`hilore.enable=true` it selects `engine.py`'s HiLoReFSDPEngine, which hands each mini-batch to a
`hilore_verl.training.session.Session`. `loss.py` turns verl's actor loss into the loss coefficients the planner
reads; `shared_prompt.py` runs verl's micro-batches in the shared-prompt layout; `collectives.py`,
`device_memory.py` and `controller_file.py` are the session's reductions, memory budget and checkpoint
file over torch.distributed; `config_check.py` and `map_check.py` refuse a bad config on the driver
before Ray starts. May import verl, hilore_verl's core packages and `integration.cpu_host.after_import`.
"""
