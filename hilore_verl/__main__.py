"""`python -m hilore_verl ...`: the `hilore-verl` command without installing (e.g. `PYTHONPATH=. python -m
hilore_verl gpu-check --out DIR` from a clone)."""

import sys

from hilore_verl.cli import main

sys.exit(main())
