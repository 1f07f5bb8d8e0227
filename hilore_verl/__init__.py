"""hilore-verl: keep, compress or recompute each recovery unit's saved activations in verl's actor update.

Importing this package is cheap and never imports verl; `hilore_verl.integration` is the only
part that does.
"""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
