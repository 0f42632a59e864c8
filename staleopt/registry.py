"""Your own models and datasets by name, in this process and in the worker processes a sweep starts.

Three ways to name one's own model (or dataset) wherever a built-in name goes
(``RunConfig(model=...)``, a TOML sweep, ``staleopt train --model``,
:func:`staleopt.compare`):

* ``staleopt.register_model("my_cnn", my_cnn)`` (:func:`staleopt.models.register`;
  :func:`staleopt.data.register` for data): the name ``"my_cnn"`` then works in
  this process and in the worker processes and Ray tasks its sweeps start (the
  sweep runner sends :func:`snapshot` with each job and the worker
  :func:`restore` s it). Another process (``staleopt results``, a relaunch)
  registers it again before it builds the model;
* ``"package.module:function"``: imported where it is used;
* ``"path/to/file.py:function"``: the file is loaded as a module (a path
  relative to the working directory); nothing needs to be installed.

The spec string is what the run's config records, so a spec works from any
process, a TOML file and the command line alike; a registered name reads better
in tables and figures. A factory must be deterministic given its arguments (a
run is a pure function of its config: docs/design.md §1).
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

from .errors import ConfigError

__all__ = ["is_spec", "load_spec", "unknown", "snapshot", "restore", "check_picklable"]

#: Module names given to files loaded by path -> the file's absolute path.
_FILE_MODULES: Dict[str, str] = {}


def is_spec(name: str) -> bool:
    """Whether ``name`` is a ``module:function`` or ``file.py:function`` spec (built-in names have no colon)."""
    return isinstance(name, str) and ":" in name


def spec_key(spec: str) -> str:
    """What a spec names wherever it is used: a ``file.py:function`` spec with its file's absolute path (a relative
    one names another file after ``os.chdir``: caches keyed by the spec as written kept the first folder's
    factory), a ``module:function`` spec as it is."""
    where, _, name = str(spec).rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        return f"{Path(where).expanduser().resolve()}:{name}"
    return str(spec)


def _load_file(path: str):
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{path!r} is not a file (a path is relative to the working directory {Path.cwd()})")
    module_name = f"_staleopt_user_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    _FILE_MODULES[module_name] = str(file)
    return module


def load_spec(spec: str, what: str = "function") -> Callable:
    """The callable named by ``"module:function"`` or ``"file.py:function"`` (``function`` may be dotted)."""
    where, _, name = str(spec).rpartition(":")
    if not where or not name:
        raise ConfigError(f"a {what} is given as 'module:function' or 'path/to/file.py:function', got {spec!r}")
    try:
        if where.endswith(".py") or "/" in where or "\\" in where:
            obj = _load_file(where)
        else:
            obj = importlib.import_module(where)
        for part in name.split("."):
            obj = getattr(obj, part)
    except ConfigError:
        raise
    except (ImportError, AttributeError, OSError, SyntaxError) as e:
        raise ConfigError(f"cannot load {what} {spec!r}: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r} is a {type(obj).__name__}, not a function or class")
    return obj


def unknown(what: str, name: str, known, register: str) -> ConfigError:
    """The error for a ``what`` (``"model"``, ``"dataset"``) named ``name`` that is neither among ``known`` nor a
    spec: the closest known name, the choices, and how to bring one's own (``register``, e.g.
    ``"staleopt.register_model"``)."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown {what} {name!r}{hint}; choose one of {list(known)}, a 'module:function' or "
                       f"'file.py:function' spec, or register your own with {register} (docs/tutorial.md)")


def check_arguments(what: str, name: str, parameters: Dict[str, inspect.Parameter], given, kwargs_key: str,
                    supplied=()) -> None:
    """Refuse a factory call that leaves a required argument unset (a raw ``TypeError`` from inside the factory
    otherwise): ``parameters`` of the factory, ``given`` the names passed, ``supplied`` names a caller gives (or
    names the lack of) itself; ``kwargs_key`` the config key that sets the rest (``"model_kwargs"``)."""
    missing = [k for k, v in parameters.items() if k not in given and k not in supplied and v.default is v.empty
               and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
    if missing:
        flag = "--" + kwargs_key.replace("_", "-")
        raise ConfigError(f"{what} {name!r} needs the argument(s) {missing}, which nothing set: pass them in "
                          f"{kwargs_key} ({flag} '{{\"{missing[0]}\": ...}}'), or give them defaults")


def _portable(factory: Callable) -> Tuple[str, Any]:
    """How to send ``factory`` to another process: ``("spec", "file.py:name")`` for a function of a file
    loaded by path (its module cannot be imported by name there), else ``("object", factory)``."""
    module = getattr(factory, "__module__", None)
    if module in _FILE_MODULES:
        return "spec", f"{_FILE_MODULES[module]}:{factory.__qualname__}"
    return "object", factory


def snapshot(models_used=None, data_used=None) -> Dict[str, Dict[str, Tuple[str, Any]]]:
    """The models and datasets registered in this process by name: ``{"model": {name: how}, "data": ...}``;
    only the names in ``models_used`` / ``data_used`` when given (what a sweep's runs need)."""
    from . import data, models
    return {"model": {n: _portable(f) for n, f in models.registered().items() if models_used is None
                      or n in models_used},
            "data": {n: _portable(f) for n, f in data.registered().items() if data_used is None or n in data_used}}


def restore(snap: Dict[str, Dict[str, Tuple[str, Any]]]) -> None:
    """Register in this process what :func:`snapshot` took in another (the names' factories replaced)."""
    from . import data, models
    for kind, register in (("model", models.register), ("data", data.register)):
        for name, (how, value) in (snap or {}).get(kind, {}).items():
            register(name, load_spec(value, kind) if how == "spec" else value, replace=True)


def check_picklable(snap) -> None:
    """Raise :class:`ConfigError` naming the registration that cannot be sent to a worker process."""
    for kind, entries in snap.items():
        for name, (how, value) in entries.items():
            try:
                pickle.dumps(value)
            except Exception as e:
                raise ConfigError(
                    f"{kind} {name!r} was registered with {value!r}, which cannot be sent to worker processes "
                    f"({type(e).__name__}: {e}): define the factory at the top level of a module or file "
                    "(not a lambda or a function inside another), or run with workers=1") from None
