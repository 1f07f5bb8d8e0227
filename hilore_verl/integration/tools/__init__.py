"""Tools for tests, the bench, the demo and `doctor`; nothing here runs inside a user's training job.

`verl_engine.py` builds verl's stock FSDP engine directly and feeds it mini-batches as verl's trainer
does; `launch.py` runs a function on N gloo ranks in fresh processes; `demo.py` runs verl's `main_ppo`
twice (HiLoRe and GC); `selfcheck.py` trains a tiny verl engine one step; `verl_offload.py` wraps verl's
own activation offload as a bench baseline. May import verl, `integration.actor` and the core packages.
"""
