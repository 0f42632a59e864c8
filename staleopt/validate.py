"""Checks of single arguments, shared so that every module words the same mistake the same way."""
from __future__ import annotations

import numbers
from typing import Optional, Type

from .errors import ConfigError, StaleoptError

__all__ = ["check_int"]


def check_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None, *,
              optional: bool = False, why: str = "", error: Type[StaleoptError] = ConfigError) -> Optional[int]:
    """``int(value)`` if ``value`` is an integer (a Python or NumPy int, not a bool) in ``[minimum, maximum]``,
    else raise ``error``.

    ``None`` passes when ``optional``. The message names the argument, the
    value given and the allowed range, e.g. ``stages = 0 must be an int >= 1``,
    followed by ``why`` in parentheses when given.
    """
    if value is None and optional:
        return None
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            bounds = f" in {minimum}..{maximum}"
        elif minimum is not None:
            bounds = f" >= {minimum}"
        elif maximum is not None:
            bounds = f" <= {maximum}"
        else:
            bounds = ""
        raise error(f"{name} = {value!r} must be an int{bounds}" + (" or None" if optional else "")
                    + (f" ({why})" if why else ""))
    return int(value)
