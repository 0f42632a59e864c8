"""Checks of single arguments, shared so that every module words the same mistake the same way."""
from __future__ import annotations

import numbers
import os
from typing import Optional, Type

from .errors import ConfigError, StaleoptError

__all__ = ["check_int"]

#: The highest ``--dpi`` a command takes: a figure at 100000 dpi asks matplotlib for terabytes (a MemoryError).
MAX_DPI = 2400


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


def check_fraction(name: str, value, error: Type[StaleoptError] = ConfigError) -> float:
    """``float(value)`` if ``value`` is a real number in (0, 1) (a relative tolerance), else raise ``error``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) < 1.0:
        raise error(f"{name} = {value!r} must be a number in (0, 1) (a relative tolerance)")
    return float(value)


def output_dir(path: str, flag: str = "--out") -> str:
    """``path`` as a folder to write into (made if missing), or a :class:`ConfigError` naming ``flag``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a file, not a folder: give a folder to write into")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path!r}: cannot make that folder ({e.strerror or e}); give a writable "
                          "one") from None
    return path


def output_file(path: str, flag: str = "--out") -> str:
    """``path`` as a file to write (not a folder, in an existing folder), or a :class:`ConfigError` naming
    ``flag`` (checked before any work, so nothing computed is lost)."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a folder: give the file to write (e.g. {os.path.join(path, 'x.csv')})")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path!r}: the folder {folder!r} does not exist (or is a file); make it first")
    return path


def output_image(path: str, flag: str = "--out") -> str:
    """``path`` as an image file matplotlib can write (a known suffix, in an existing folder), or a
    :class:`ConfigError` naming ``flag`` (checked before any work, so nothing computed is lost)."""
    from matplotlib.figure import Figure
    kinds = Figure().canvas.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in kinds:
        raise ConfigError(f"{flag} {path!r}: the suffix names the image format; use one of "
                          f"{', '.join('.' + k for k in sorted(kinds))} (e.g. fig.png)")
    return output_file(path, flag)
