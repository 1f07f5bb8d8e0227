"""Run a function on a module right after it is imported (at once, if it already was).

The plugin loads while verl itself is importing, before verl's workers exist; what it adapts in
them (see cpu_support.py) waits here until verl imports the module, in every process:

    when_imported("verl.utils.distributed", patch)    # patch(module) after its code has run

A finder at the front of `sys.meta_path` wraps the real loader's `exec_module` for the names
waited on; nothing else is touched. A module caught half-imported (its own import running now)
gets the function when that import finishes.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

_waiting: dict[str, list[Callable]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            _wrap(spec.loader, name)
        return spec


def _wrap(loader, name: str) -> None:
    run = loader.exec_module

    def exec_module(module):
        run(module)
        for fn in _waiting.pop(name, []):
            fn(module)

    loader.exec_module = exec_module


_FINDER = _Finder()


def when_imported(name: str, fn: Callable) -> None:
    module = sys.modules.get(name)
    if module is not None:
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            raise RuntimeError(f"hilore-verl: {name} is importing right now; it cannot be adapted before "
                               "its import finishes")
        fn(module)
        return
    _waiting.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
