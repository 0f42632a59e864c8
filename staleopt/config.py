"""``RunConfig``: everything that determines one training run, validated, with a stable hash.

A run is a pure function of its config (docs/design.md §1: bit-for-bit deterministic
on CPU for a fixed seed), so the hash of the resolved config names the run's
directory in a sweep (:mod:`staleopt.sweep`). Execution details that do not
change the result (threads, progress bars, where data lives) are not fields.

Correction hyperparameters left at ``None`` take the method's defaults
(:mod:`staleopt.methods`); they are ignored by methods without that correction (a sweep's grid
may set them for every method), and ``staleopt train``, given one method, refuses them there.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import data, methods, models, schedules
from .errors import ConfigError
from .validate import check_int

__all__ = ["RunConfig", "CHOICES", "CORRECTION_FIELDS", "LR_WARMUP_SCHEDULES", "field_names", "validate_field",
           "refuse_ineffective", "refuse_default_spellings"]

#: Allowed values of the string fields that take a fixed set of choices.
CHOICES = {
    "optimizer": ("sgd", "sgd-momentum", "adam", "adamw", "nadamw"),
    "lr_schedule": ("constant", "cosine", "step", "linear-warmup", "inverse-sqrt"),
    "partition": ("ops", "params"),
    "unit_order": ("registration", "execution"),
}

#: Config fields that are hyperparameters of a method's corrections (names as in ``Method.defaults``).
CORRECTION_FIELDS = ("anneal_steps", "decay", "warmup_steps", "pipelined_steps")

#: The learning-rate schedules that start with a linear warmup of ``lr_warmup_steps`` steps.
LR_WARMUP_SCHEDULES = ("linear-warmup", "inverse-sqrt")

#: Fields added after runs were first recorded, with their defaults: at the default they stay out of
#: :meth:`RunConfig.run_id`, so the runs recorded before them keep their ids (and their sweep folders).
_LATER_FIELDS = {"lr_warmup_steps": None, "unit_order": "registration"}


@dataclass
class RunConfig:
    """One training run. Field docs give the meaning and unit.

    * ``model``, ``model_kwargs``: :func:`staleopt.models.get` name and options
      (``num_classes`` and ``input_shape`` come from the data; for the language
      model ``gpt`` they are the vocabulary size and the window ``(T,)`` of a
      ``"lm"`` dataset, and only such data pairs with it): a built-in model,
      one registered with :func:`staleopt.register_model`, or a ``"module:function"`` /
      ``"file.py:function"`` spec (:mod:`staleopt.registry`).
    * ``data``, ``data_kwargs``: :func:`staleopt.data.load` name and options (built-in,
      registered with :func:`staleopt.register_data`, or a spec).
    * ``method``: a method (:func:`staleopt.methods.names`) or schedule name;
      ``stages`` (``P``, an int or ``"max"`` = the model's unit count),
      ``microbatches`` (``N`` per minibatch, divides ``batch_size``),
      ``partition`` strategy (``"ops"`` | ``"params"``); ``unit_order``: ``"registration"`` (the units
      in the order the model registers its modules) or ``"execution"`` (in the order a forward pass on the
      first training microbatch uses them, :func:`staleopt.partition_model`'s ``example_input``: for a model
      that registers a module before one it runs earlier, e.g. a learned temperature at the root applied to
      the logits, or an output layer registered before the embedding it is tied to).
    * ``optimizer`` (``sgd`` | ``sgd-momentum`` | ``adam`` | ``adamw`` | ``nadamw``: NAdam with decoupled
      weight decay and ``momentum_decay`` 0.004, the AsyncPP recipe's), ``lr``,
      ``momentum`` (SGD momentum, or Adam's and NAdam's beta1; refused with plain ``sgd``), ``weight_decay``;
      ``lr_schedule``: ``constant``, ``cosine`` (to 0 over the run),
      ``step`` (times ``lr_gamma`` at each epoch in ``lr_milestones``),
      ``linear-warmup`` (``lr * n / W`` for the ``n``-th step, ``n <= W =
      lr_warmup_steps``, then ``lr``) or ``inverse-sqrt`` (the same warmup, then
      ``lr * sqrt(W / n)``: Fairseq's schedule, which PipeMare's Transformer
      recipe inherits, Table 7). With a warmup, T1's ``K`` defaults to
      ``5 W`` (PipeMare §3.1).
    * ``epochs``, ``batch_size``, ``seed``; ``max_steps`` caps the run (tests).
    * corrections: ``anneal_steps`` (T1's K, PipeMare eq. 4), ``decay`` (T2's
      D, PipeMare §3.2, or ``"invariant"``: App. B.4's gamma), ``warmup_steps`` (PipeMareW), ``pipelined_steps``
      (stale-weights paper §4 hybrid). The weight-prediction rule is part of
      the method (``pipeoptim``, ``spectrain``, ``xpipe``).
    * ``divergence_loss``: a training loss above it (or non-finite) ends the
      run with status ``"diverged"``; ``None``: only non-finite losses do. A first loss above it, before
      any update, is a :class:`~staleopt.errors.ConfigError` (the bound does not fit the loss's scale).
    * ``device``: ``"cpu"`` (bit-for-bit deterministic) or a torch device string.
    """

    model: str = "resnet1d"
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    data: str = "mnist1d"
    data_kwargs: Dict[str, Any] = field(default_factory=dict)
    method: str = "gpipe"
    stages: Union[int, str] = 1
    microbatches: int = 1
    partition: str = "ops"
    unit_order: str = "registration"
    optimizer: str = "sgd-momentum"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    lr_milestones: List[int] = field(default_factory=list)
    lr_gamma: float = 0.1
    lr_warmup_steps: Optional[int] = None
    epochs: int = 10
    batch_size: int = 64
    seed: int = 0
    anneal_steps: Optional[int] = None
    decay: Optional[Union[float, str]] = None
    warmup_steps: Optional[int] = None
    pipelined_steps: Optional[int] = None
    divergence_loss: Optional[float] = 100.0
    max_steps: Optional[int] = None
    device: str = "cpu"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, validate_field(f.name, getattr(self, f.name)))
        if self.batch_size % self.microbatches:
            _fail("microbatches", self.microbatches, f"must divide batch_size = {self.batch_size} "
                  "(each microbatch holds batch_size / microbatches samples)")
        if (self.lr_schedule in LR_WARMUP_SCHEDULES) != (self.lr_warmup_steps is not None):
            _fail("lr_warmup_steps", self.lr_warmup_steps,
                  f"is the warmup length of lr_schedule {' or '.join(LR_WARMUP_SCHEDULES)}: give it with one of "
                  f"them and only then (lr_schedule = {self.lr_schedule!r})")
        # settings that would have no effect: refused, so that a run never silently differs from what was asked
        if (self.lr_schedule == "step") != bool(self.lr_milestones):
            _fail("lr_milestones", self.lr_milestones,
                  f"are the epochs where lr_schedule 'step' multiplies the lr by lr_gamma: give them with it and only "
                  f"then (lr_schedule = {self.lr_schedule!r})")
        late = [m for m in self.lr_milestones if m >= self.epochs]
        if self.lr_schedule == "step" and late:
            _fail("lr_milestones", self.lr_milestones,
                  f"include {late}, at or after the end of the run (epochs = {self.epochs}): milestone m multiplies "
                  "the lr from the first step after m epochs, so one >= epochs never applies (milestones are "
                  "epochs, not steps)")
        refuse_ineffective(self, [k for k in _DEFAULT_LOOKALIKES if getattr(self, k) != getattr(RunConfig, k)])
        if isinstance(self.stages, int):
            self.pipeline()                         # the schedule's rules, e.g. 2BW's N >= P
        if not models.info(self.model).takes_any():
            _check_kwargs("model_kwargs", self.model_kwargs, _model_options(self.model))
        _check_kwargs("data_kwargs", self.data_kwargs, data.options(self.data))
        _check_kwarg_types("model_kwargs", self.model_kwargs, models.info(self.model).defaults())
        _check_kwarg_types("data_kwargs", self.data_kwargs, data.option_defaults(self.data))
        task = data.task(self.data, **self.data_kwargs)
        if task is not None:                        # a user's dataset is checked once loaded (train.run)
            models.check_task(self.model, task, f"data {self.data!r}")

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RunConfig":
        """Build from a mapping; unknown keys raise :class:`ConfigError` naming the allowed keys."""
        unknown = [k for k in d if k not in field_names()]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, field_names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {k!r}{hint}; allowed keys: {', '.join(field_names())}")
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-native dict with sorted keys (nested dicts sorted too)."""
        return json.loads(json.dumps(dataclasses.asdict(self), sort_keys=True))

    def run_id(self) -> str:
        """First 16 hex digits of the SHA-256 of the sorted, compact JSON of :meth:`to_dict` (fields added later
        left out while at their defaults)."""
        d = {k: v for k, v in self.to_dict().items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def replace(self, **changes) -> "RunConfig":
        """A validated copy with ``changes`` applied."""
        return RunConfig.from_dict({**self.to_dict(), **changes})

    def method_overrides(self) -> Dict[str, Any]:
        """The correction hyperparameters set here that the method takes, for ``methods.build(method, **these)``.

        Fields the method has no use for (e.g. ``decay`` for ``gpipe``) are left
        out, so one sweep can set them for all methods.
        """
        accepted = methods.hyperparameters(self.method)
        return {k: getattr(self, k) for k in CORRECTION_FIELDS if k in accepted and getattr(self, k) is not None}

    def pipeline(self, **method_args) -> methods.Pipeline:
        """The method on this run's stages and microbatches (:func:`staleopt.methods.build`).

        ``method_args``: hyperparameters (default: :meth:`method_overrides`;
        :func:`staleopt.train.method_args` adds defaults scaled to the run).
        Needs an int ``stages`` (:meth:`resolve` replaces ``"max"``).
        """
        if not isinstance(self.stages, int):
            _fail("stages", self.stages, "must be resolved to an int first (RunConfig.resolve())")
        return methods.build(self.method, self.stages, self.microbatches,
                             **(method_args or self.method_overrides()))

    def resolve(self) -> "RunConfig":
        """Replace ``stages="max"`` by the model's unit count and check ``stages`` against it."""
        units = _units(self.model, json.dumps(self.model_kwargs, sort_keys=True), self.data,
                       json.dumps(self.data_kwargs, sort_keys=True))
        stages = units if self.stages == "max" else self.stages
        if stages > units:
            _fail("stages", stages, f"exceeds the {units} parametrized operators of model {self.model!r}")
        return self if stages == self.stages else self.replace(stages=stages)


#: Keys a run can ignore (their setting has no effect) while they hold their default: :class:`RunConfig` refuses
#: another value there, and where the keys a user gave are known, the default too (:func:`refuse_ineffective`).
_DEFAULT_LOOKALIKES = ("lr_gamma", "momentum")


def refuse_ineffective(config: "RunConfig", given: Iterable[str]) -> None:
    """Refuse each key of ``given`` that ``config`` ignores: ``momentum`` with optimizer ``sgd``, ``lr_gamma``
    without lr_schedule ``step``. :class:`RunConfig` refuses them at any value but their default, which it cannot
    tell from a key left out (a saved run's config lists every field), so the commands and sweep files, which know
    the keys the user wrote, call this with them (``momentum = 0.9`` with plain ``sgd`` trained plain SGD)."""
    given = set(given)
    if "lr_gamma" in given and config.lr_schedule != "step":
        _fail("lr_gamma", config.lr_gamma, f"is lr_schedule 'step''s factor and has no effect with lr_schedule = "
              f"{config.lr_schedule!r}")
    if "momentum" in given and config.optimizer == "sgd":
        _fail("momentum", config.momentum, "has no effect with optimizer 'sgd' (plain SGD): use optimizer "
              "'sgd-momentum', or leave momentum out")


def refuse_default_spellings(configs: Iterable["RunConfig"], recorded: Iterable[Tuple[str, dict]] = ()) -> None:
    """Refuse two of ``configs`` that are one run written two ways: they differ only by a model or data option
    written at the factory's default in one and left out in the other (``model_kwargs={"hidden": 16}`` and ``{}``);
    and a config that is, that way, one of the ``recorded`` runs ``(run id, its config.json)`` already in the
    sweep's folder (a sweep extended with the other spelling). A recorded run whose model or data no longer loads
    (a user's file moved) is not compared.

    A run id hashes the config as written, on purpose: an option written at its default pins it, so the run stays
    itself if the factory's default changes later (the demo pins ``depth = 20, width = 8``). Two such spellings in
    one folder would train the same model twice under two run ids, a line or row each in every table."""
    defaults: Dict[tuple, Dict[str, Any]] = {}

    def effective(d: dict) -> str:
        d = {k: v for k, v in d.items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}
        for key, field_, read in (("model_kwargs", "model", lambda n: models.info(n).defaults()),
                                  ("data_kwargs", "data", data.option_defaults)):
            if (key, d[field_]) not in defaults:
                defaults[key, d[field_]] = read(d[field_])
            d[key] = {**defaults[key, d[field_]], **d.get(key, {})}
        return json.dumps(d, sort_keys=True)

    seen: Dict[str, Tuple[str, dict]] = {}
    for run, d in recorded:
        try:
            seen.setdefault(effective(d), (run, d))
        except Exception:  # noqa: BLE001 (its model or data does not load here: nothing to compare it with)
            continue
    for c in configs:
        d, run = c.to_dict(), c.run_id()
        prior, was = seen.setdefault(effective(d), (run, d))
        if prior != run:
            written = {k: v for key in ("model_kwargs", "data_kwargs")
                       for k, v in {**was.get(key, {}), **d[key]}.items() if (k in was.get(key, {})) != (k in d[key])}
            raise ConfigError(f"runs {prior} and {run} are one run written two ways: {written} "
                              f"{'is the default' if len(written) == 1 else 'are the defaults'}, written in one and "
                              "left out of the other (a written default is part of the run id: it pins the option if "
                              "the default changes); write it in every run or in none")


def field_names() -> List[str]:
    """The config keys, in declaration order."""
    return [f.name for f in dataclasses.fields(RunConfig)]


def _fail(name, value, why):
    raise ConfigError(f"{name} = {value!r} {why}")


def _float(name, v, lo=None, hi=None, optional=False, open_lo=False, open_hi=False, other=None):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(name, v, "must be a finite number" + (f", {other}" if other else "") + (" or None" if optional else ""))
    if lo is not None and (v <= lo if open_lo else v < lo) or hi is not None and (v >= hi if open_hi else v > hi):
        _fail(name, v, f"must lie in {'(' if open_lo else '['}{lo}, {hi if hi is not None else 'inf'}"
                       f"{')' if open_hi or hi is None else ']'}")
    return float(v)


def _choice(name, v, choices, optional=False):
    if v is None and optional:
        return None
    if v not in choices:
        close = difflib.get_close_matches(str(v), list(choices), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        _fail(name, v, f"is not allowed{hint}; allowed values: {', '.join(map(str, choices))}")
    return v


def _named(name, v, lookup):
    """A built-in or registered name, or a loadable spec (``lookup`` raises a ConfigError saying which)."""
    if not isinstance(v, str):
        _fail(name, v, "must be a name (a string)")
    try:
        lookup(v)
    except ConfigError as e:
        raise ConfigError(f"{name} = {v!r} is not allowed: {e}") from None
    return v


def _kwargs(name, v):
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        _fail(name, v, "must be a table/dict of option name -> value")
    return json.loads(json.dumps(v, sort_keys=True))


def _method_names() -> List[str]:
    return list(dict.fromkeys(list(methods.names()) + [s for s in schedules.names() if s != "custom"]))


def _model_options(name):
    return [k for k in models.info(name).kwargs() if k not in ("num_classes", "input_shape")]


def _check_kwargs(name, given, allowed):
    if allowed is None:  # a user's factory that takes **kwargs
        return
    bad = [k for k in given if k not in allowed]
    if bad:
        _fail(name, given, f"has unknown option {bad[0]!r}; allowed: {', '.join(allowed) or '(none)'}")


#: A default's type -> (what a given value must be, the test): an option whose default is an int takes an int
#: (TOML's ``16.0`` is a float, ``true`` a bool), a float any real number, and so on.
_KINDS = ((bool, "true or false", lambda v: isinstance(v, bool)),
          (numbers.Integral, "an int", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
          (numbers.Real, "a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
          (str, "a string", lambda v: isinstance(v, str)),
          ((list, tuple), "a list", lambda v: isinstance(v, (list, tuple))))


def _check_kwarg_types(name, given, defaults):
    """Each option of ``given`` whose default (``defaults``, from the factory's signature) has a type above is of
    that kind: a wrong type fails here, not inside the model or data factory in every run (``None`` passes)."""
    for key, value in given.items():
        default = defaults.get(key)
        if default is None or value is None:
            continue
        kind = next(((what, ok) for t, what, ok in _KINDS if isinstance(default, t)), None)
        if kind is not None and not kind[1](value):
            _fail(name, given, f"has option {key!r} = {value!r}, which must be {kind[0]} (its default is {default!r})")


def _device(name, v):
    try:
        torch.device(v)
    except (RuntimeError, TypeError):
        _fail(name, v, "is not a torch device string (e.g. 'cpu', 'cuda', 'cuda:1')")
    return v


def _stages(name, v):
    return v if v == "max" else check_int(name, v, minimum=1)


def _milestones(name, v):
    if not isinstance(v, (list, tuple)):
        _fail(name, v, "must be a list of epochs")
    out = [check_int(name, e, minimum=1) for e in v]
    if out != sorted(set(out)):
        _fail(name, v, "must be strictly increasing")
    return out


_VALIDATORS = {
    "model": lambda n, v: _named(n, v, models.info),
    "model_kwargs": _kwargs,
    "data": lambda n, v: _named(n, v, data.options),
    "data_kwargs": _kwargs,
    "method": lambda n, v: methods.check_retired(v) or _choice(n, v, _method_names()),
    "stages": _stages,
    "microbatches": lambda n, v: check_int(n, v, minimum=1),
    "partition": lambda n, v: _choice(n, v, CHOICES["partition"]),
    "unit_order": lambda n, v: _choice(n, v, CHOICES["unit_order"]),
    "optimizer": lambda n, v: _choice(n, v, CHOICES["optimizer"]),
    "lr": lambda n, v: _float(n, v, lo=0.0, open_lo=True),
    "momentum": lambda n, v: _float(n, v, lo=0.0, hi=1.0),
    "weight_decay": lambda n, v: _float(n, v, lo=0.0),
    "lr_schedule": lambda n, v: _choice(n, v, CHOICES["lr_schedule"]),
    "lr_milestones": _milestones,
    "lr_gamma": lambda n, v: _float(n, v, lo=0.0, open_lo=True),
    "lr_warmup_steps": lambda n, v: check_int(n, v, minimum=1, optional=True, why="optimizer steps"),
    "epochs": lambda n, v: check_int(n, v, minimum=1),
    "batch_size": lambda n, v: check_int(n, v, minimum=1),
    "seed": lambda n, v: check_int(n, v, minimum=0),
    "anneal_steps": lambda n, v: check_int(n, v, minimum=1, optional=True),
    "decay": lambda n, v: v if v == "invariant" else _float(n, v, lo=0.0, hi=1.0, optional=True, open_lo=True,
                                                            open_hi=True, other="'invariant'"),
    "warmup_steps": lambda n, v: check_int(n, v, minimum=0, optional=True),
    "pipelined_steps": lambda n, v: check_int(n, v, minimum=0, optional=True),
    "divergence_loss": lambda n, v: _float(n, v, lo=0.0, open_lo=True, optional=True),
    "max_steps": lambda n, v: check_int(n, v, minimum=1, optional=True),
    "device": _device,
}


def validate_field(name: str, value: Any) -> Any:
    """Check one field on its own and return its normalized value (ints given for floats become floats)."""
    if name not in _VALIDATORS:
        raise ConfigError(f"unknown config key {name!r}; allowed keys: {', '.join(field_names())}")
    return _VALIDATORS[name](name, value)


def _units(model: str, model_kwargs_json: str, data_name: str, data_kwargs_json: str) -> int:
    """The model's unit count; a user's model is built for the data's shape (it may have no defaults)."""
    if not models.info(model).user:
        return _builtin_units(model, model_kwargs_json)
    num_classes, input_shape = data.shape(data_name, data_kwargs_json)
    return models.num_units(model, num_classes=num_classes, input_shape=input_shape, **json.loads(model_kwargs_json))


@functools.lru_cache(maxsize=None)
def _builtin_units(model: str, model_kwargs_json: str) -> int:
    return models.num_units(model, **json.loads(model_kwargs_json))
