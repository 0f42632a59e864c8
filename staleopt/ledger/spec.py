"""The ledger's experiment files: recipes, the runs of each experiment, and the checks on them.

``experiments/ledger/recipes.toml`` names training recipes, each at two scales
(``cpu``: MNIST-1D, what ``make reproduce`` runs; ``paper``: CIFAR-10
ResNet-20 on a GPU). Every other ``experiments/ledger/<name>.toml`` is one
experiment::

    title = "PipeMare: asynchrony against P, T1 and T2"
    paper = "PipeMare"
    order = 1                     # experiments run in this order (ties: by name)

    [[runs]]                      # a grid over a recipe: lists are crossed, seeds come from the recipe
    recipe = "pipemare"
    method = ["dataflow", "pipemare"]
    stages = [4, 16, "max"]

    horizons = [1, 2, 4, 8]       # optional: run lengths (multiples of the recipe's epochs) of every check
    paper_horizon = {delay = 27, steps = 78200, source = "..."}   # optional: the paper's tau_max and run length

    [[check]]                     # one row of docs/reproductions.md
    id = "t2-at-max-p"
    horizons = [1, 2, 4, 8]       # optional: overrides the experiment's (default [1])
    claim = "T1 + T2 beats T1 alone at the largest P"
    source = "PipeMare §4.3, Figure 8"
    paper_number = "..."
    rule = "better"               # see staleopt.ledger.verdict.RULES
    a = {recipe = "pipemare", method = "pipemare", stages = "max"}
    b = {recipe = "pipemare", method = "pipemare-t1", stages = "max"}
    metric = "test_ppl"           # optional: the record column compared (default: the runs' task's,
                                  # staleopt.metrics; a margin of 1 or more needs an unbounded metric named)

A selector (``a``, ``b``, ``reference``) names a recipe and config values of the
runs' 1x configs (``anneal_steps = 20`` is that configuration at every horizon;
a table or a list, ``model_kwargs = {hidden = 64}``, matches too);
``stages = "max"`` is the largest stage count among the runs it matches. A check
that compares the smallest P with the largest (degrades, gap-grows) whose
selectors share fewer than two stage counts is refused.

**Horizons.** Stale-weight penalties depend on the ratio of the largest delay to
the run length, ``tau_max / steps``, which at CPU scale is far larger than in the
papers. A check's ``horizons`` are run lengths in multiples of its recipes' epochs:
at horizon ``h`` each run is :func:`at_horizon` of its 1x config (every duration
times ``h``); the check gets a verdict at each horizon, and the page shows how the
gap moves along the ratio axis. The runs at ``h = 1`` are the quick tier; every
run of an experiment is trained there, and at ``h > 1`` only the runs a check with
that horizon compares.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import data as datasets
from .. import metrics, sweep
from ..config import RunConfig, field_names, refuse_default_spellings
from ..errors import ConfigError, SweepConfigError
from ..validate import check_int

__all__ = ["SCALES", "TIERS", "LEDGER_DIR", "Recipe", "Check", "Experiment", "PaperHorizon", "load_recipes",
           "load_experiment", "load_all", "find", "selects", "at_horizon", "RULE_KEYS"]

#: The two scales every recipe is written at.
SCALES = ("cpu", "paper")
#: ``quick``: every check at 1x only (the recipes' own lengths); ``ladder``: every horizon.
TIERS = ("quick", "ladder")
#: The ledger's experiment files, in the repository next to the package.
LEDGER_DIR = Path(__file__).resolve().parents[2] / "experiments" / "ledger"
#: The selectors each rule needs, and the optional keys it takes.
RULE_KEYS = {"better": ("a", "b"), "not-worse": ("a", "b"), "matches": ("a", "b"),
             "degrades": ("a", "reference"), "gap-grows": ("a", "b")}
_CHECK_KEYS = {"id", "claim", "source", "paper_number", "rule", "a", "b", "reference", "margin", "horizons",
               "paper_horizon", "metric"}
_TEXT_KEYS = ("id", "claim", "source", "paper_number", "rule")


@dataclass(frozen=True)
class Recipe:
    """A base config (RunConfig keys) and the seeds every run of it is trained with."""

    name: str
    scale: str
    description: str
    seeds: Tuple[int, ...]
    base: Dict[str, Any]


@dataclass(frozen=True)
class PaperHorizon:
    """Where the paper's own run sits on the ratio axis: its largest delay ``delay`` (steps) over its run length
    ``steps`` (optimizer steps), and the source of both numbers."""

    delay: int
    steps: int
    source: str

    @property
    def ratio(self) -> float:
        """``tau_max / steps`` of the paper's run."""
        return self.delay / self.steps


@dataclass(frozen=True)
class Check:
    """One checkable claim: text for the ledger, a rule and the selectors it compares."""

    id: str
    claim: str
    source: str
    paper_number: str
    rule: str
    selectors: Dict[str, Dict[str, Any]]
    margin: float = 0.01
    #: Run lengths (multiples of the recipe's epochs) the check is evaluated at, ascending; 1 always among them.
    horizons: Tuple[int, ...] = (1,)
    paper_horizon: Optional[PaperHorizon] = None
    #: The record column compared (:mod:`staleopt.metrics`); ``None``: the runs' task's metric.
    metric: Optional[str] = None


@dataclass
class Experiment:
    """One ledger file at one scale: its runs (each tagged with its recipe) and its checks."""

    name: str
    title: str
    paper: str
    scale: str
    checks: List[Check]
    order: int = 0
    configs: List[RunConfig] = field(default_factory=list)
    recipe_of: Dict[str, str] = field(default_factory=dict)   # run_id -> recipe name
    recipes: Dict[str, Recipe] = field(default_factory=dict)
    horizon_of: Dict[str, int] = field(default_factory=dict)  # run_id -> horizon (1 for the recipe's own length)
    #: run_id -> its 1x config (before :func:`at_horizon`): what selectors match, at every horizon.
    base_of: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def check(self, check_id: str) -> Check:
        for c in self.checks:
            if c.id == check_id:
                return c
        raise ConfigError(f"experiment {self.name!r} has no check {check_id!r}; "
                          f"its checks: {', '.join(c.id for c in self.checks)}")

    def configs_for(self, check: Optional[Check] = None, tier: str = "ladder") -> List[RunConfig]:
        """The runs ``check`` compares at its horizons (``tier="quick"``: at 1x only); with ``check`` None,
        every run at 1x and the runs of each check at its longer horizons."""
        if tier not in TIERS:
            raise ConfigError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if check is None:
            keep = {c.run_id() for c in self.configs if self.horizon_of[c.run_id()] == 1}
            for ch in self.checks:
                keep |= {c.run_id() for c in self.configs_for(ch, tier)}
            return [c for c in self.configs if c.run_id() in keep]
        horizons = self.horizons_of(check, tier)
        rows = [self.row(c) for c in self.configs]
        keep = set()
        for h in horizons:
            at_h = [r for r in rows if r["horizon"] == h]
            for sel in check.selectors.values():
                keep |= {r["run"] for r in selects(at_h, sel)}
        return [c for c in self.configs if c.run_id() in keep]

    @staticmethod
    def horizons_of(check: Check, tier: str = "ladder") -> Tuple[int, ...]:
        """The horizons ``check`` is evaluated at in ``tier``."""
        return (1,) if tier == "quick" else check.horizons

    def resolved(self, check: Check) -> Check:
        """``check`` with ``stages = "max"`` replaced by the largest stage count among the experiment's planned
        runs, so a verdict never compares at a smaller P just because the largest has not finished."""
        rows = [self.row(c) for c in self.configs]
        selectors = {}
        for key, sel in check.selectors.items():
            if sel.get("stages") == "max":
                sel = {**sel, "stages": max(int(r["stages"]) for r in selects(rows, sel))}
            selectors[key] = sel
        return dataclasses.replace(check, selectors=selectors)

    def row(self, config: RunConfig) -> Dict[str, Any]:
        """``config`` as a dict with ``run``, ``recipe``, ``horizon`` and ``base`` (its 1x config, which
        :func:`selects` matches)."""
        run = config.run_id()
        return {"run": run, "recipe": self.recipe_of[run], "horizon": self.horizon_of[run], **config.to_dict(),
                "base": self.base_of.get(run, config.to_dict())}


def at_horizon(config: RunConfig, horizon: int) -> RunConfig:
    """``config`` trained ``horizon`` times as long, with the same recipe: every duration times ``horizon``.

    ``epochs``, the ``step`` schedule's ``lr_milestones`` (epochs), ``lr_warmup_steps`` and the corrections'
    lengths when the recipe sets them (T1's ``anneal_steps``, PipeMareW's ``warmup_steps``, the hybrid's
    ``pipelined_steps``) scale; left unset, those follow the run length by themselves
    (:func:`staleopt.train.method_args`: T1 anneals over a quarter of the run, PipeMare App. C; PipeMareW warms
    up as long; the hybrid switches at half the run, stale-weights paper §6.4), and the cosine schedule decays
    over the whole run. The learning rate, batch and seeds do not change. ``horizon = 1`` is ``config``.
    """
    check_int("horizon", horizon, 1, error=ConfigError, why="a horizon is a whole multiple of the recipe's length")
    if horizon == 1:
        return config
    changes: Dict[str, Any] = {"epochs": config.epochs * horizon,
                               "lr_milestones": [m * horizon for m in config.lr_milestones]}
    for key in ("lr_warmup_steps", "anneal_steps", "warmup_steps", "pipelined_steps", "max_steps"):
        if getattr(config, key) is not None:
            changes[key] = getattr(config, key) * horizon
    return config.replace(**changes)


def _read(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise SweepConfigError(f"ledger file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepConfigError(f"{path}: not valid TOML: {e}") from e


def load_recipes(path: Path, scale: str) -> Dict[str, Recipe]:
    """The recipes of ``recipes.toml`` at ``scale``; every recipe must have both scales."""
    if scale not in SCALES:
        raise ConfigError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    out = {}
    for name, scales in _read(path).items():
        needs = f"recipe [{name}] needs the tables {', '.join(f'[{name}.{s}]' for s in SCALES)}"
        if not isinstance(scales, dict):
            raise SweepConfigError(f"{path}: {needs}, not {name} = {scales!r}")
        missing = [s for s in SCALES if not isinstance(scales.get(s), dict)]
        if missing:
            raise SweepConfigError(f"{path}: {needs}; missing (or not a table): {', '.join(missing)}")
        keys = sorted(k for k, v in scales.items() if not isinstance(v, dict))
        if keys:  # (a key meant for a scale's table, written above it)
            raise SweepConfigError(f"{path}: recipe [{name}] sets {', '.join(keys)} outside its scales' tables; "
                                   f"move {'it' if len(keys) == 1 else 'them'} into [{name}.{SCALES[0]}] and "
                                   f"[{name}.{SCALES[1]}]")
        other = sorted(set(scales) - set(SCALES))
        if other:  # (a third scale's table was ignored without a word)
            tables = ", ".join(f"[{name}.{s}]" for s in other)
            raise SweepConfigError(f"{path}: recipe [{name}] has the table(s) {tables}, which no scale reads; the "
                                   f"scales are {', '.join(SCALES)}: rename or remove them")
        table = dict(scales[scale])
        seeds = table.pop("seeds", None)
        description = table.pop("description", "")
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
            raise SweepConfigError(f"{path}: [{name}.{scale}] seeds must be a non-empty list of ints, got {seeds!r}")
        if "seed" in table:
            raise SweepConfigError(f"{path}: [{name}.{scale}] sets seed; list the seeds in `seeds` instead")
        try:
            RunConfig.from_dict(table)
        except ConfigError as e:
            raise SweepConfigError(f"{path}: [{name}.{scale}]: {e}") from None
        out[name] = Recipe(name, scale, description, tuple(seeds), table)
    return out


def _horizons(where: str, value: Any) -> Tuple[int, ...]:
    if (not isinstance(value, list) or not value or any(isinstance(h, bool) or not isinstance(h, int) or h < 1
                                                        for h in value) or len(set(value)) != len(value)):
        raise SweepConfigError(f"{where}: horizons must be a list of distinct whole numbers >= 1 (multiples of the "
                               f"recipe's epochs), e.g. horizons = [1, 2, 4, 8]; got {value!r}")
    if 1 not in value:
        raise SweepConfigError(f"{where}: horizons must include 1 (the quick tier runs every check at 1x); "
                               f"got {value!r}")
    return tuple(sorted(value))


def _paper_horizon(where: str, value: Any) -> Optional[PaperHorizon]:
    if value is None:
        return None
    keys = {"delay", "steps", "source"}
    if (not isinstance(value, dict) or set(value) != keys
            or any(isinstance(value[k], bool) or not isinstance(value[k], int) or value[k] < 1
                   for k in ("delay", "steps"))
            or not isinstance(value["source"], str) or not value["source"]):
        raise SweepConfigError(f"{where}: paper_horizon must be a table {{delay = <int >= 1>, steps = <int >= 1>, "
                               f'source = "<where the paper gives them>"}}; got {value!r}')
    return PaperHorizon(value["delay"], value["steps"], value["source"])


def _check(path: Path, i: int, spec: Dict[str, Any], recipes: Dict[str, Recipe],
           defaults: Dict[str, Any]) -> Check:
    where = f"{path}: [[check]] #{i + 1}"
    unknown = sorted(set(spec) - _CHECK_KEYS)
    if unknown:
        raise SweepConfigError(f"{where}: unknown keys {unknown}; allowed: {', '.join(sorted(_CHECK_KEYS))}")
    missing = [k for k in _TEXT_KEYS if not isinstance(spec.get(k), str) or not spec[k]]
    if missing:
        raise SweepConfigError(f"{where}: {', '.join(missing)} must be non-empty strings")
    rule = spec["rule"]
    if rule not in RULE_KEYS:
        raise SweepConfigError(f"{where}: rule {rule!r} is not one of {', '.join(RULE_KEYS)}")
    selectors = {}
    for key in RULE_KEYS[rule]:
        sel = spec.get(key)
        if not isinstance(sel, dict) or "recipe" not in sel:
            raise SweepConfigError(f"{where}: rule {rule!r} needs `{key}`, a table with a recipe, e.g. "
                                   f'{key} = {{recipe = "pipemare", method = "pipemare"}}')
        if sel["recipe"] not in recipes:
            raise SweepConfigError(f"{where}: {key}.recipe = {sel['recipe']!r} is not a recipe; "
                                   f"recipes: {', '.join(recipes)}")
        bad = [k for k in sel if k != "recipe" and k not in field_names()]
        if bad:
            raise SweepConfigError(f"{where}: {key} selects on {bad}, which are not config keys")
        selectors[key] = dict(sel)
    extra = [k for k in ("a", "b", "reference") if k in spec and k not in RULE_KEYS[rule]]
    if extra:
        raise SweepConfigError(f"{where}: rule {rule!r} takes {', '.join(RULE_KEYS[rule])}, not {extra}")
    metric = spec.get("metric")
    if metric is not None:
        try:
            metric = metrics.get(metric).column
        except ConfigError as e:
            raise SweepConfigError(f"{where}: {e}") from None
    top = math.inf if metric is not None and metrics.get(metric).bounds is None else 1  # accuracy points below 1
    margin = spec.get("margin", 0.01)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin < top:
        raise SweepConfigError(f"{where}: margin must be a number in (0, 1) (accuracy points), or above 0 in the "
                               f"units of the unbounded metric the check names (metric = \"test_ppl\"), got {margin!r}")
    horizons = _horizons(where, spec.get("horizons", defaults["horizons"]))
    paper = _paper_horizon(where, spec.get("paper_horizon", defaults["paper_horizon"]))
    return Check(spec["id"], spec["claim"], spec["source"], spec["paper_number"], rule, selectors, float(margin),
                 horizons, paper, metric)


def load_experiment(path: Path, scale: str = "cpu", recipes: Optional[Dict[str, Recipe]] = None) -> Experiment:
    """Parse one experiment file and expand its runs at ``scale`` (recipes from ``recipes.toml`` beside it)."""
    path = Path(path)
    recipes = recipes if recipes is not None else load_recipes(path.parent / "recipes.toml", scale)
    spec = _read(path)
    unknown = sorted(set(spec) - {"title", "paper", "order", "runs", "check", "horizons", "paper_horizon"})
    if unknown:
        raise SweepConfigError(f"{path}: unknown top-level keys {unknown}; allowed: title, paper, order, horizons, "
                               "paper_horizon, [[runs]], [[check]]")
    order = spec.get("order", 0)
    check_int(f"{path}: order", order, error=SweepConfigError, why="experiments run in increasing order")
    if not spec.get("runs") or not spec.get("check"):
        raise SweepConfigError(f"{path}: an experiment needs at least one [[runs]] and one [[check]]")
    defaults = {"horizons": spec.get("horizons", [1]), "paper_horizon": spec.get("paper_horizon")}
    _horizons(f"{path}: horizons", defaults["horizons"])
    _paper_horizon(f"{path}: paper_horizon", defaults["paper_horizon"])
    exp = Experiment(path.stem, str(spec.get("title", path.stem)), str(spec.get("paper", "")), scale,
                     [_check(path, i, c, recipes, defaults) for i, c in enumerate(spec["check"])], order,
                     recipes=recipes)
    ids = [c.id for c in exp.checks]
    if len(set(ids)) != len(ids):
        raise SweepConfigError(f"{path}: check ids must be unique, got {ids}")
    for i, runs in enumerate(spec["runs"]):
        runs = dict(runs)
        name = runs.pop("recipe", None)
        if name not in recipes:
            raise SweepConfigError(f"{path}: [[runs]] #{i + 1}: recipe {name!r} is not one of {', '.join(recipes)}")
        recipe = recipes[name]
        grid = {k: v if isinstance(v, list) else [v] for k, v in runs.items()}
        if "seed" in grid:
            raise SweepConfigError(f"{path}: [[runs]] #{i + 1}: seeds come from the recipe; do not set seed")
        base = {k: v for k, v in recipe.base.items() if k not in grid}
        try:
            configs = sweep.from_spec({"base": base, "grid": {**grid, "seed": list(recipe.seeds)}},
                                      source=f"{path} [[runs]] #{i + 1}", inherited=list(base)).configs
        except SweepConfigError as e:
            raise SweepConfigError(str(e)) from None
        for h in sorted({h for c in exp.checks for h in c.horizons}):
            for base in configs:
                c = at_horizon(base, h)
                if c.run_id() not in exp.recipe_of:
                    exp.configs.append(c)
                    exp.recipe_of[c.run_id()] = name
                    exp.horizon_of[c.run_id()] = h
                    exp.base_of[c.run_id()] = base.to_dict()
                elif exp.base_of[c.run_id()] != base.to_dict():  # (one run would stand for two rows, one left empty)
                    other = exp.horizon_of[c.run_id()]
                    raise SweepConfigError(
                        f"{path}: [[runs]] #{i + 1}: run {c.run_id()} at horizon {h}x is the run of another 1x "
                        f"configuration at {other}x (a grid that varies a length the horizons scale, e.g. epochs = "
                        "[2, 4] with horizons [1, 2]): one run cannot stand for both; vary that length by the "
                        "horizons instead, or drop one value")
    try:  # (across recipes: they share one runs folder)
        refuse_default_spellings(exp.configs)
    except ConfigError as e:
        raise SweepConfigError(f"{path}: {e}") from None
    rows = [exp.row(c) for c in exp.configs if exp.horizon_of[c.run_id()] == 1]
    for c in exp.checks:
        for key, sel in c.selectors.items():
            hit = selects(rows, sel)
            if not hit:
                raise SweepConfigError(f"{path}: check {c.id!r}: {key} = {sel} selects none of the experiment's runs")
            _one_run_per_seed(f"{path}: check {c.id!r}: {key} = {sel}", hit,
                              by_stages=key == "a" and c.rule in ("gap-grows", "degrades") or
                              key == "b" and c.rule == "gap-grows")
        _two_stage_counts(f"{path}: check {c.id!r}", c, rows)
        _recorded_metric(f"{path}: check {c.id!r}", c, rows)
    return exp


def _recorded_metric(where: str, check: Check, rows: Sequence[Dict[str, Any]]) -> None:
    """A check's ``metric`` is one its selected runs record (a classifier's runs record no perplexity: every score
    NaN, the row "not yet run" for good). A user's dataset, whose task is known once loaded, is not checked here."""
    if check.metric is None:
        return
    for key, sel in check.selectors.items():
        for r in selects(rows, sel):
            try:
                metrics.planned(datasets.task(r["data"], **r["data_kwargs"]), check.metric)
            except ConfigError as e:
                raise SweepConfigError(f"{where}: {key} = {sel} selects runs of {r['data']!r}: {e}") from None


def _two_stage_counts(where: str, check: Check, rows: Sequence[Dict[str, Any]]) -> None:
    """degrades and gap-grows compare the smallest selected P with the largest: a check whose selectors share one
    stage count would read "not yet run" for good after all its runs trained. Refused."""
    keys = {"degrades": ("a",), "gap-grows": ("a", "b")}.get(check.rule)
    if keys is None:
        return
    found = {k: sorted({int(r["stages"]) for r in selects(rows, check.selectors[k])}) for k in keys}
    if len(set.intersection(*(set(v) for v in found.values()))) < 2:
        at = " and ".join(f"{k} = {check.selectors[k]} at P = {', '.join(map(str, v))}" for k, v in found.items())
        raise SweepConfigError(f"{where}: rule {check.rule!r} compares the smallest P with the largest, but {at} "
                               + ("share" if len(keys) > 1 else "has") + " fewer than two stage counts: select (and "
                               "run) two or more, e.g. drop `stages` from the selector")


def _one_run_per_seed(where: str, hit: Sequence[Dict[str, Any]], by_stages: bool) -> None:
    """A rule pairs runs by seed (per stage count where it compares stage counts): a selector that matches two
    configurations of one seed would leave the verdict to whichever sorts last. Refused, naming what differs."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in hit:
        groups.setdefault((r["seed"], r["stages"]) if by_stages else (r["seed"],), []).append(r)
    for rs in groups.values():
        if len(rs) > 1:
            keys = sorted(k for k in rs[0] if k not in ("run", "base") and len({repr(r.get(k)) for r in rs}) > 1)
            values = "; ".join(f"{k} = {sorted({repr(r.get(k)) for r in rs})}" for k in keys)
            raise SweepConfigError(f"{where} matches {len(rs)} configurations of seed {rs[0]['seed']}"
                                   f"{' at P = ' + str(rs[0]['stages']) if by_stages else ''} ({values}): the rule "
                                   "pairs one run per seed" + (" and stage count" if by_stages else "") +
                                   "; add the key that tells them apart to the selector")


def load_all(scale: str = "cpu", directory: Path = LEDGER_DIR) -> List[Experiment]:
    """Every experiment file of ``directory`` (all but ``recipes.toml``), sorted by ``order``, then name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SweepConfigError(f"the ledger folder {directory} " + ("is a file" if directory.exists() else
                               "does not exist") + ": give the folder of recipes.toml and the experiment files "
                               "(--ledger-dir)")
    recipes = load_recipes(directory / "recipes.toml", scale)
    files = sorted(p for p in directory.glob("*.toml") if p.name != "recipes.toml")
    if not files:
        raise SweepConfigError(f"no experiment files in {directory}")
    exps = sorted((load_experiment(p, scale, recipes) for p in files), key=lambda e: (e.order, e.name))
    seen: Dict[str, str] = {}
    for e in exps:
        for c in e.checks:
            if c.id in seen:
                raise SweepConfigError(f"check id {c.id!r} appears in {seen[c.id]} and {e.name}; ids must be unique")
            seen[c.id] = e.name
    return exps


def find(experiments: Sequence[Experiment], name: str) -> Tuple[Experiment, Optional[Check]]:
    """The experiment named ``name``, or the experiment holding the check ``name`` and that check."""
    for e in experiments:
        if e.name == name:
            return e, None
    for e in experiments:
        for c in e.checks:
            if c.id == name:
                return e, c
    known = [e.name for e in experiments] + [c.id for e in experiments for c in e.checks]
    raise ConfigError(f"no experiment or check named {name!r}; known: {', '.join(known)}")


def selects(rows: Sequence[Dict[str, Any]], selector: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The rows (run config dicts with a ``recipe`` key) matching ``selector``.

    A row's ``base`` (its 1x config, :meth:`Experiment.row`) is matched where it has one: at every horizon
    ``anneal_steps = 20`` is the configuration whose 1x run anneals over 20 steps. A table or list matches its
    JSON cell (:func:`staleopt.sweep.collect` stores them so). ``stages = "max"`` keeps the largest stage count
    among the rows matching the rest.
    """
    rest = {k: v for k, v in selector.items() if not (k == "stages" and v == "max")}
    hit = [r for r in rows if all(_same(_cell(r, k), v) for k, v in rest.items())]
    if selector.get("stages") == "max" and hit:
        top = max(int(r["stages"]) for r in hit)
        hit = [r for r in hit if int(r["stages"]) == top]
    return hit


def _cell(row: Dict[str, Any], key: str) -> Any:
    base = row.get("base")
    return base[key] if isinstance(base, dict) and key in base else row.get(key)


def _same(cell: Any, value: Any) -> bool:
    """``cell == value``, a JSON cell decoded first when ``value`` is a table or a list."""
    if isinstance(value, (dict, list)) and isinstance(cell, str):
        try:
            cell = json.loads(cell)
        except ValueError:
            return False
    return cell == value
