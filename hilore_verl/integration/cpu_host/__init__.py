"""verl on a host without an accelerator, usable with HiLoRe off.

`platform.py` is a CPU platform for verl's PlatformRegistry; `workers.py` adapts what verl's workers
assume of an accelerator (process group, engine registry, pinned memory, resource check), applied
when verl imports those modules (`after_import.py`); `hf_rollout.py` is a rollout backend on Hugging
Face `generate`. These follow verl's internals, not HiLoRe's: they import verl and the standard
library only (no other hilore_verl package), and are candidates for upstreaming (see patches/).
"""
