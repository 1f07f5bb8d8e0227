"""One check for every setting: its type, its range, finiteness, and a message that names the key.

    flag("hilore.enable", value)                               # True or False
    integer("hilore.min_bytes", value, ">= 0", lambda v: v >= 0)
    number("hilore.risk_budget", value, ">= 0", lambda v: v >= 0)   # int or float, finite

Each raises ValueError "<key>: got <value>; valid: <what is valid>". A bool is never a number and a
string never one either (YAML's "1e-2" is a str: an error, not a guess).
"""

from __future__ import annotations

import math
from typing import Any, Callable


def finite(value: Any) -> bool:
    """A float that is finite, or an int a float can hold (10**400 is not)."""
    try:
        return math.isfinite(float(value))
    except (OverflowError, TypeError, ValueError):
        return False


def flag(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: got {value!r}; valid: true or false")


def integer(key: str, value: Any, valid: str = "", ok: Callable[[int], bool] = lambda v: True) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"{key}: got {value!r}; valid: an integer{' ' + valid if valid else ''}")


def number(key: str, value: Any, valid: str = "", ok: Callable[[float], bool] = lambda v: True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value) or not ok(value):
        raise ValueError(f"{key}: got {value!r}; valid: a finite number{' ' + valid if valid else ''}")
