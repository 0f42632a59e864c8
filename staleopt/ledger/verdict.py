"""Verdicts computed from the runs: each check's rule applied to per-seed test scores.

A run's score is its test metric at the end of training (a run that diverged
scores the value recorded when it stopped, ``inf`` where that was none or
overflowed, :mod:`staleopt.stats`; two runs of one seed that both scored it
differ by 0, counted, and a check whose every pair is such is not reproduced,
with that reason; so is one whose gaps are infinite in both directions, which
have no mean; gaps infinite on one side only fail a rule they are against and,
in its favour, count as seeds past any bound, the rest judged on the finite
gaps, :func:`_judge`): the check's ``metric`` when it
names one, else the runs' task's (:mod:`staleopt.metrics`: test accuracy for
classification, test perplexity for a language model). Every difference below
is a gain (:meth:`staleopt.metrics.Metric.gain`): ``a_s - b_s`` for an accuracy,
``b_s - a_s`` for a perplexity or a loss, so "above 0" means "a is better" for
every metric, and the trends read the same. Runs of different
methods with the same seed share the initial weights and the data order, so
comparisons are paired by seed: the rule looks at the per-seed differences
``d_s`` and their mean with a 95% Student-t interval
``mean ± t_{0.975, n-1} s / sqrt(n)`` (:func:`staleopt.stats.t_interval`).

=========  ==========================================  =====================  ======================
rule       ``d_s``                                     reproduced             partly
=========  ==========================================  =====================  ======================
better     ``a_s - b_s``                               interval above 0       mean above 0
not-worse  ``a_s - b_s``                               interval above -m      mean above -m
matches    ``a_s - b_s``                               interval inside ±m     mean inside ±m
gap-grows  ``(a - b)_s`` at the largest P minus at     interval above 0       mean above 0
           the smallest P
degrades   ``a_s`` at the smallest P minus at the      both intervals above   both means above 0
           largest P, and ``ref_s - a_s`` at the       0
           largest P
=========  ==========================================  =====================  ======================

``m`` is the check's margin (default 0.01, one accuracy point), in the
metric's units. Anything else is "not reproduced", with the reason.

A check some of whose planned runs have not finished is judged on the seeds
paired so far, and its reason says so ("on 2 of 3 planned seeds (1 run not
finished)"); a compared group with no finished run, or (degrades, gap-grows)
the smallest or largest *planned* P without one, reads "not yet run".

**Horizons.** A check is evaluated at each of its run lengths (horizons,
:mod:`staleopt.ledger.spec`) on the runs of that length alone. The per-seed
*gap* ``g_s`` is ``a_s - b_s`` (better, not-worse, matches), the growth of
the gap (gap-grows) or the drop from the reference at the largest P
(degrades); each horizon sits at ``tau_max / steps`` of its runs. The trend
(:func:`trend`) compares the shortest horizon with the longest, paired by
seed: the change of the gap's size ``c_s = |g_s(longest)| - |g_s(shortest)|``;
"closing" when the 95% interval of ``c`` lies below 0 (the gap is nearer 0,
on either side of it), "widening" when it lies above 0 (a gap that moved past
0 to a larger size on the other side widened); otherwise "reversed" when the 95%
intervals of the mean gap at the two horizons clear 0 on opposite sides (a
similar size, the other way round), "absent" when both include 0 (no gap to
follow), else "persisting".
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from .. import metrics, stats
from ..claims import decisive_digits
from ..errors import ConfigError
from ..stats import t_interval
from .spec import Check, selects

__all__ = ["Row", "Trend", "REPRODUCED", "PARTLY", "NOT", "NOT_RUN", "VERDICTS", "TRENDS", "scores", "evaluate",
           "evaluate_horizons", "trend", "horizon_verdict", "setting_text"]

REPRODUCED, PARTLY, NOT, NOT_RUN = "reproduced", "partly", "not reproduced", "not yet run"
VERDICTS = (REPRODUCED, PARTLY, NOT, NOT_RUN)
CLOSING, PERSISTING, WIDENING, REVERSED, ABSENT, NO_TREND = ("closing", "persisting", "widening", "reversed", "absent",
                                                              "no trend")
TRENDS = (CLOSING, PERSISTING, WIDENING, REVERSED, ABSENT, NO_TREND)


@dataclass(frozen=True)
class Row:
    """One row of the ledger."""

    experiment: str
    id: str
    claim: str
    source: str
    paper_number: str
    setting: str
    ours: str
    verdict: str
    reason: str = ""
    #: The mean and 95% half-width of :attr:`gaps` (NaN when not computed), so the table's gap column, the
    #: trend and the figure show one number: the gain of a over b, the growth of the gap (gap-grows), or the
    #: drop from the synchronous reference at the largest P (degrades, which also needs the score lost from
    #: the smallest to the largest P: in :attr:`ours`); positive means better for a (module docstring).
    estimate: float = math.nan
    half_width: float = math.nan
    #: ``(seed, g_s)``: the per-seed gap the trend across horizons follows (module docstring).
    gaps: Tuple[Tuple[int, float], ...] = ()
    #: The run length in multiples of the recipe's epochs, and its runs' ``tau_max / steps`` (NaN if unknown).
    horizon: int = 1
    ratio: float = math.nan
    steps: int = 0
    #: The record column the scores are in (:mod:`staleopt.metrics`).
    metric: str = metrics.ACCURACY.column
    #: The seeds of :attr:`gaps` where a run the check compares diverged (its gap may be infinite or huge:
    #: :mod:`staleopt.plot.ledger` fits the axis of an unbounded metric to the other seeds).
    diverged: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Trend:
    """How a check's gap moves from its shortest horizon to its longest (module docstring)."""

    label: str
    text: str
    change: Tuple[float, float] = (math.nan, math.nan)   # mean and half-width of c = sigma (g_long - g_short)


def scores(records: pd.DataFrame, recipe_of: Dict[str, str], horizon_of: Optional[Dict[str, int]] = None,
           base_of: Optional[Dict[str, Dict]] = None) -> List[Dict]:
    """One dict per finished run: its config columns, its last record's columns, ``recipe``, ``horizon`` (from
    ``horizon_of``, default 1), ``metric`` (the run's task's, :func:`staleopt.metrics.task_of`), ``score``
    (its final value: the final test accuracy of a classifier), ``diverged``, and ``base`` (its 1x config, which
    selectors match: :attr:`staleopt.ledger.spec.Experiment.base_of`) where ``base_of`` has it."""
    out = []
    if records.empty:
        return out
    try:  # the task of a run with no value at all (it diverged at its first evaluation): the other runs'
        common = metrics.task_of(records)
    except ConfigError:
        common = "classification"
    for run, r in records.sort_values(["run", "epoch"]).groupby("run", sort=False):
        if run not in recipe_of:
            continue
        last = r.iloc[-1]
        metric = metrics.for_task(metrics.task_of(r, empty=common))
        row = {k: last[k] for k in r.columns if k not in ("run",)}
        row.update(run=run, recipe=recipe_of[run], horizon=(horizon_of or {}).get(run, 1), stages=int(last["stages"]),
                   seed=int(last["seed"]), metric=metric.column,
                   score=stats.scored(float(last[metric.column]), last["status"] == "diverged", metric),
                   diverged=last["status"] == "diverged")
        if base_of and run in base_of:
            row["base"] = base_of[run]
        out.append(row)
    return out


def _by_seed(rows, key) -> Dict[int, float]:
    out: Dict[int, float] = {}
    for r in rows:
        if r["seed"] in out:  # (spec.load_experiment refuses such selectors; rows built by hand may still pool)
            raise ConfigError(f"two runs of seed {r['seed']} in one compared group (run {r.get('run', '?')} and "
                              "another): a rule pairs one run per seed; select by the key that tells them apart")
        out[r["seed"]] = key(r)
    return out


def _minus(x: float, y: float) -> float:
    """``x - y``, and 0 where they are equal, also both infinite (two diverged runs of one seed: no gap, not a
    missing one; ``inf - inf`` would be NaN and drop the seed)."""
    return 0.0 if x == y else x - y


def _paired(a: Dict[int, float], b: Dict[int, float]) -> List[float]:
    return [_minus(a[s], b[s]) for s in sorted(set(a) & set(b))]


def _paired_by_seed(a: Dict[int, float], b: Dict[int, float]) -> Tuple[Tuple[int, float], ...]:
    return tuple((s, _minus(a[s], b[s])) for s in sorted(set(a) & set(b)))


def _group_text(label: str, rows, value) -> str:
    mean, half, n = t_interval([value(r) for r in rows])
    div = sum(r["diverged"] for r in rows)
    ci = "" if math.isnan(half) else f" ± {half:.3f}"
    return f"{label}: {mean:.3f}{ci} ({n} runs{f', {div} diverged' if div else ''})"


def _label(sel: Dict, rows) -> str:
    stages = sorted({r["stages"] for r in rows})
    p = f" P={stages[0]}" if len(stages) == 1 else ""
    return f"{sel['method']}{p}" if "method" in sel else f"{sel}{p}"


def _diff_text(name: str, d: Sequence[float]) -> str:
    mean, half, n = t_interval(d)
    if n == 0:
        return f"{name}: no paired seeds"
    if math.isnan(half):
        infinite = sum(math.isinf(x) for x in d)
        return f"{name} {mean:+.3f} (" + ("1 paired seed" if n == 1 else f"{n} paired seeds, {infinite} infinite") + \
            ", no interval)"
    return f"{name} {mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"


def _beyond(x: float, margin: float, sign: str = "") -> str:
    """``x``, a value past ``margin`` in size, with 3 decimals, or as many more as it takes to read as past it (a
    difference of 0.0103 against the margin 0.01 reads "0.0103", not "0.010")."""
    for digits in range(3, 7):
        text = f"{x:{sign}.{digits}f}"
        if abs(float(text)) > margin:
            return text
    return f"{x:{sign}.6g}"


def _no_mean(d: Sequence[float]) -> str:
    """The reason a check's gaps have no mean, or "": infinite gaps of both signs (each side diverged in some seed;
    ``inf - inf`` has no value), which no rule can judge."""
    mean, _, n = t_interval(d)
    if n == 0 or not math.isnan(mean):
        return ""
    up, down = sum(x == math.inf for x in d), sum(x == -math.inf for x in d)
    return (f"the per-seed gaps are infinite in both directions ({up} seed(s) +inf, {down} -inf: each side "
            "diverged in some seed), so they have no mean: nothing to compare")


def _judge(d: Sequence[float], lo_ok, mean_ok) -> Tuple[str, str]:
    """The verdict on the gaps ``d`` and, where the t-interval of all of them does not decide it, why. One paired
    seed has no interval: "partly" at best. Gaps infinite on one side (a run diverged; both sides have no mean,
    :func:`_no_mean`) against the claim fail it; in its favour each is a seed past any bound, and the rest is
    judged on the interval of the finite gaps (all infinite: reproduced from two seeds on)."""
    mean, half, n = t_interval(d)
    if n == 0:
        return NOT_RUN, ""
    if not mean_ok(mean):
        return NOT, ""
    infinite = sum(math.isinf(x) for x in d)
    if infinite:
        finite = [x for x in d if not math.isinf(x)]
        fm, fh, fn = t_interval(finite)
        note = f"{infinite} of {n} paired seeds have an infinite gap in the claim's favour (a run diverged)"
        if fn == 0:
            return (REPRODUCED, note) if n >= 2 else (PARTLY, note + "; one paired seed: no interval")
        if fn < 2:
            return PARTLY, note + "; one finite gap: no interval"
        if lo_ok(fm - fh, fm + fh):
            return REPRODUCED, note + f", and the 95% interval of the {fn} finite ones clears"
        return PARTLY, note + f", but the 95% interval of the {fn} finite ones does not clear"
    if math.isnan(half):
        return PARTLY, "one paired seed: no interval"
    return (REPRODUCED if lo_ok(mean - half, mean + half) else PARTLY), ""


def _by_stages(rows) -> Dict[int, List[Dict]]:
    out: Dict[int, List[Dict]] = {}
    for r in rows:
        out.setdefault(r["stages"], []).append(r)
    return dict(sorted(out.items()))


def _metric(check: Check, groups: Dict[str, List[Dict]]) -> Tuple[metrics.Metric, Optional[str]]:
    """The metric ``check`` compares: its own, else the one the runs' scores are in (runs without a ``metric``
    are accuracy's); a reason instead when the runs' metrics differ."""
    if check.metric is not None:
        return metrics.get(check.metric), None
    found = sorted({r.get("metric", metrics.ACCURACY.column) for g in groups.values() for r in g})
    if len(found) > 1:
        return metrics.ACCURACY, (f"the runs are scored in different metrics ({', '.join(found)}); name the "
                                  "check's metric")
    return metrics.get(found[0]) if found else metrics.ACCURACY, None


def _recorded(value) -> bool:
    try:
        return not math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def evaluate(check: Check, runs: Sequence[Dict], experiment: str, setting: str,
             planned: Optional[Sequence[Dict]] = None) -> Row:
    """The ledger row of ``check`` on the finished ``runs`` (from :func:`scores`). ``planned``: the rows of the runs
    it compares, finished or not (:meth:`staleopt.ledger.spec.Experiment.row`): a verdict on fewer seeds than
    planned says so, and degrades and gap-grows take their smallest and largest P from them (module docstring)."""
    groups = {k: selects(runs, sel) for k, sel in check.selectors.items()}
    metric, mixed = _metric(check, groups)
    plan = None if planned is None else {k: selects(planned, sel) for k, sel in check.selectors.items()}
    judged = {"seeds": None, "stages": None}   # the seeds (and ends' stage counts) a verdict is computed on

    diverged = {r["seed"] for g in groups.values() for r in g if r["diverged"]}

    def partial() -> str:
        """Where the verdict's seeds are fewer than the planned runs': on how many, and why."""
        if plan is None or judged["seeds"] is None:
            return ""
        ends = judged["stages"]
        want = [r for g in plan.values() for r in g if ends is None or len({x["stages"] for x in g}) < 2
                or r["stages"] in ends]
        seeds = set.intersection(*({r["seed"] for r in g} for g in plan.values()))
        if len(judged["seeds"]) >= len(seeds):
            return ""
        finished = {r.get("run") for g in groups.values() for r in g}
        left = len({r["run"] for r in want} - finished)
        return (f"on {len(judged['seeds'])} of {len(seeds)} planned seeds"
                + (f" ({left} run{'s' if left != 1 else ''} not finished)" if left else ""))

    def row(ours, verdict, reason="", d=(), gaps=()):
        mean, half, _ = t_interval(d)
        if _no_mean(d):
            verdict, reason = NOT, _no_mean(d)
        note = partial() if verdict != NOT_RUN else ""
        reason = "; ".join(x for x in (note, reason) if x)
        return Row(experiment, check.id, check.claim, check.source, check.paper_number, setting, ours, verdict, reason,
                   mean, half, tuple(gaps), metric=metric.column,
                   diverged=tuple(s for s, _ in gaps if s in diverged))

    missing = [k for k, g in groups.items() if not g]
    if missing:
        return row("-", NOT_RUN, "no finished runs yet of " + "; ".join(describe(check.selectors[k]) for k in missing))
    if mixed:
        return row("-", NOT, mixed)
    if check.metric is not None:   # (a metric of another task: every run would score NaN and drop out)
        lacking = [r for g in groups.values() for r in g if not r["diverged"] and not _recorded(r.get(metric.column))]
        if lacking:
            have = [c for c in metrics.METRICS if any(_recorded(r.get(c)) for r in lacking)]
            return row("-", NOT, f"{len(lacking)} finished run(s) compared record no {metric.label} "
                                 f"({metric.column!r}), the check's metric" + (f"; they record {', '.join(have)}: "
                                                                               "name one of those" if have else ""))

    def value(r):   # the run's score in the check's metric
        return stats.scored(float(r[metric.column]), r["diverged"], metric) if check.metric is not None \
            else r["score"]

    sign = 1.0 if metric.higher_is_better else -1.0

    def key(r):     # signed so that differences are gains
        return sign * value(r)

    def by_seed(rows):
        return _by_seed(rows, key)

    def group_text(label, rows):
        return _group_text(label, rows, value)

    def minus(x, y):    # a gain in words: the raw difference that equals it
        return f"{x} - {y}" if metric.higher_is_better else f"{y} - {x}"

    gain_name = "difference" if metric.higher_is_better else f"gain ({metric.noun}, lower is better)"

    m = check.margin
    if check.rule in ("better", "not-worse", "matches"):
        a, b = groups["a"], groups["b"]
        d = _paired(by_seed(a), by_seed(b))
        ours = "; ".join([group_text(_label(check.selectors["a"], a), a),
                          group_text(_label(check.selectors["b"], b), b), _diff_text(gain_name, d)])
        mean = t_interval(d)[0]
        near = f"{mean:+.{decisive_digits(abs(mean), m, 3)}f}" if math.isfinite(mean) else f"{mean:+}"
        if check.rule == "better":
            verdict, note = _judge(d, lambda lo, hi: lo > 0, lambda mu: mu > 0)
            reason = {PARTLY: "ahead on average, but the 95% interval of the difference includes 0",
                      NOT: f"not ahead: mean difference {mean:+.3f}"}.get(verdict, "")
        elif check.rule == "not-worse":  # (the margin as the check's file writes it: 0.005 read "0.01")
            verdict, note = _judge(d, lambda lo, hi: lo > -m, lambda mu: mu > -m)
            reason = {PARTLY: f"mean difference {near} is above -{m:g}, but the 95% interval reaches below -{m:g}",
                      NOT: f"behind by {_beyond(-mean, m)}, more than the margin {m:g}"}.get(verdict, "")
        else:
            verdict, note = _judge(d, lambda lo, hi: -m < lo and hi < m, lambda mu: abs(mu) < m)
            reason = {PARTLY: f"mean difference {near} is within ±{m:g}, but the 95% interval leaves ±{m:g}",
                      NOT: f"differs by {_beyond(mean, m, '+')}, more than the margin ±{m:g}"}.get(verdict, "")
        reason = note or reason
        sa, sb = by_seed(a), by_seed(b)
        judged["seeds"] = set(sa) & set(sb)
        both = sum(math.isinf(sa[s]) and sa[s] == sb[s] for s in set(sa) & set(sb))  # both diverged: gap 0
        if both and both == len(d):
            verdict, reason = NOT, f"both diverged (an infinite score) in all {both} paired seeds: nothing to compare"
        elif both:
            reason = "; ".join(x for x in (reason, f"{both} paired seed(s) where both diverged count as no gap") if x)
        return row(ours, verdict, reason, d, _paired_by_seed(sa, sb))
    if check.rule == "gap-grows":
        a, b = _by_stages(groups["a"]), _by_stages(groups["b"])
        stages = sorted(set(a) & set(b))
        unfinished = _unfinished_ends(plan, ("a", "b"), stages)
        if unfinished:
            return row("-", NOT_RUN, unfinished)
        if len(stages) < 2:
            return row("-", NOT_RUN, "needs both methods at two or more stage counts")
        gaps = {p: _paired(by_seed(a[p]), by_seed(b[p])) for p in stages}
        lo_p, hi_p = stages[0], stages[-1]
        seeds = sorted(set(by_seed(a[lo_p])) & set(by_seed(b[lo_p])) & set(by_seed(a[hi_p])) & set(by_seed(b[hi_p])))
        judged.update(seeds=set(seeds), stages={lo_p, hi_p})
        d = [_minus(_minus(by_seed(a[hi_p])[s], by_seed(b[hi_p])[s]),
                    _minus(by_seed(a[lo_p])[s], by_seed(b[lo_p])[s])) for s in seeds]
        name_a, name_b = check.selectors["a"].get("method"), check.selectors["b"].get("method")
        ours = "; ".join([_diff_text(f"{minus(name_a, name_b)} at P={p}", gaps[p]) for p in stages]
                         + [_diff_text(f"growth P={lo_p}->{hi_p}", d)])
        verdict, note = _judge(d, lambda lo, hi: lo > 0, lambda mu: mu > 0)
        mean = t_interval(d)[0]
        reason = note or {PARTLY: "the gap grows on average, but the 95% interval of its growth includes 0",
                          NOT: f"the gap does not grow: change {mean:+.3f} from P={lo_p} to P={hi_p}"}.get(verdict, "")
        return row(ours, verdict, reason, d, tuple(zip(seeds, d)))
    # degrades
    a, ref = _by_stages(groups["a"]), groups["reference"]
    stages = sorted(a)
    unfinished = _unfinished_ends(plan, ("a",), stages)
    if unfinished:
        return row("-", NOT_RUN, unfinished)
    if len(stages) < 2:
        return row("-", NOT_RUN, "needs the method at two or more stage counts")
    lo_p, hi_p = stages[0], stages[-1]
    judged.update(seeds=set(by_seed(a[lo_p])) & set(by_seed(a[hi_p])) & set(by_seed(ref)), stages={lo_p, hi_p})
    growth = _paired(by_seed(a[lo_p]), by_seed(a[hi_p]))
    drop = _paired(by_seed(ref), by_seed(a[hi_p]))
    drops = _paired_by_seed(by_seed(ref), by_seed(a[hi_p]))
    name = check.selectors["a"].get("method")
    ours = "; ".join([group_text(_label(check.selectors["reference"], ref), ref)]
                     + [group_text(f"{name} P={p}", a[p]) for p in stages]
                     + [_diff_text(minus(f"P={lo_p}", f"P={hi_p}").replace(" - ", " minus "), growth),
                        _diff_text(f"drop from {check.selectors['reference'].get('method')} at P={hi_p}", drop)])
    if _no_mean(growth) or _no_mean(drop):
        return row(ours, NOT, _no_mean(growth) or _no_mean(drop), drop, drops)
    v_growth, n_growth = _judge(growth, lambda lo, hi: lo > 0, lambda mu: mu > 0)
    v_drop, n_drop = _judge(drop, lambda lo, hi: lo > 0, lambda mu: mu > 0)
    notes = "; ".join(f"{what}: {n}" for what, n in (("growth", n_growth), ("drop", n_drop)) if n)
    if NOT_RUN in (v_growth, v_drop):
        return row(ours, NOT_RUN, "no seed has runs at both ends and the reference")
    if v_growth == REPRODUCED and v_drop == REPRODUCED:
        return row(ours, REPRODUCED, notes, drop, drops)
    if NOT in (v_growth, v_drop):
        why = []
        if v_growth == NOT:
            why.append(f"no worse at P={hi_p} than at P={lo_p}")
        if v_drop == NOT:
            why.append(f"no drop from the synchronous reference at P={hi_p}")
        return row(ours, NOT, "; ".join(why), drop, drops)
    div = sum(r["diverged"] for r in a[hi_p])
    return row(ours, PARTLY, f"worse at the largest P on average ({div} of {len(a[hi_p])} runs diverged there), "
                             + (notes or "but a 95% interval includes 0"), drop, drops)


def _unfinished_ends(plan: Optional[Dict[str, List[Dict]]], keys: Sequence[str], finished: Sequence[int]) -> str:
    """Why a rule that compares the smallest P with the largest is not judged yet: an end of the planned stage
    counts (of every group in ``keys``) with no finished runs (a verdict at the largest *finished* P compared
    another P than the claim's); "" when both ends have runs or nothing is planned."""
    if plan is None:
        return ""
    want = sorted(set.intersection(*({r["stages"] for r in plan[k]} for k in keys)))
    if len(want) < 2:
        return ""
    ends = [f"P={p} (the {which} planned)" for p, which in ((want[0], "smallest"), (want[-1], "largest"))
            if p not in finished]
    return f"no finished runs yet at {' and '.join(ends)}; the rule compares P={want[0]} with P={want[-1]}" if ends \
        else ""


def _ratio(check: Check, runs: Sequence[Dict]) -> Tuple[float, int]:
    """``(tau_max / steps, steps)`` of the runs ``check`` compares: the largest forward delay among them over the
    run length (the longest run's last step: a diverged run stops early); NaN when unknown."""
    chosen = [r for sel in check.selectors.values() for r in selects(runs, sel)]
    steps = max((int(r["step"]) for r in chosen if "step" in r), default=0)
    tau = max((float(r["tau_max"]) for r in chosen if "tau_max" in r), default=math.nan)
    return (tau / steps if steps else math.nan), steps


def evaluate_horizons(check: Check, runs: Sequence[Dict], experiment: str, setting: str,
                      horizons: Sequence[int], planned: Optional[Sequence[Dict]] = None) -> List[Row]:
    """One row per horizon in ``horizons``: ``check`` on the runs of that length (``runs`` and ``planned``, as
    :func:`evaluate` takes it, carry ``horizon``)."""
    out = []
    for h in horizons:
        mine = [r for r in runs if r.get("horizon", 1) == h]
        plan = None if planned is None else [r for r in planned if r.get("horizon", 1) == h]
        ratio, steps = _ratio(check, mine)
        out.append(dataclasses.replace(evaluate(check, mine, experiment, setting, plan), horizon=h, ratio=ratio,
                                       steps=steps))
    return out


def trend(rows: Sequence[Row]) -> Trend:
    """The trend of one check's gap from its shortest horizon with runs to its longest (module docstring)."""
    ran = [r for r in rows if r.gaps]
    if len(ran) < 2:
        return Trend(NO_TREND, "one horizon: no trend" if len(rows) < 2 else "fewer than two horizons have runs")
    short, long_ = ran[0], ran[-1]
    g0, g1 = dict(short.gaps), dict(long_.gaps)
    seeds = sorted(set(g0) & set(g1))
    c = [_minus(abs(g1[s]), abs(g0[s])) for s in seeds]
    infinite = [x for x in c if math.isinf(x)]  # a seed whose gap became infinite (a run diverged) or finite again
    if infinite and len({x > 0 for x in infinite}) == 1:
        grew = infinite[0] > 0
        label = WIDENING if grew else CLOSING
        return Trend(label, f"{label}: the gap of {len(infinite)} of {len(c)} paired seed(s) is infinite (a diverged "
                            f"run) at {(long_ if grew else short).horizon}x and finite at "
                            f"{(short if grew else long_).horizon}x", (infinite[0], math.nan))
    if infinite:
        up = sum(x > 0 for x in infinite)
        return Trend(NO_TREND, f"{NO_TREND}: between {short.horizon}x and {long_.horizon}x the gap became infinite (a "
                               f"diverged run) in {up} paired seed(s) and finite again in {len(infinite) - up}")
    mean, half, n = t_interval(c)
    if n < 2 or math.isnan(half):
        return Trend(NO_TREND, f"{n} paired seed(s) between {short.horizon}x and {long_.horizon}x: no interval")
    m0, h0, _ = t_interval(g0.values())
    m1, h1, _ = t_interval(g1.values())
    crossed = m0 + h0 < 0 < m1 - h1 or m1 + h1 < 0 < m0 - h0  # both ends' intervals clear 0, on opposite sides
    label = CLOSING if mean + half < 0 else WIDENING if mean - half > 0 else REVERSED if crossed else \
        ABSENT if abs(m0) <= h0 and abs(m1) <= h1 else PERSISTING
    text = (f"{label}: gap {m0:+.3f} [{m0 - h0:+.3f}, {m0 + h0:+.3f}] at {short.horizon}x, {m1:+.3f} "
            f"[{m1 - h1:+.3f}, {m1 + h1:+.3f}] at {long_.horizon}x; its size changed by {mean:+.3f} "
            f"[{mean - half:+.3f}, {mean + half:+.3f}] ({n} paired seeds)")
    return Trend(label, text, (mean, half))


def horizon_verdict(rows: Sequence[Row]) -> str:
    """The verdicts of one check across its horizons in words: ``reproduced at 4x, 8x; not reproduced at 1x, 2x``
    (longest horizons first), or the one verdict when they agree."""
    if len(rows) == 1:
        return rows[0].verdict
    by: Dict[str, List[int]] = {}
    for r in sorted(rows, key=lambda r: -r.horizon):
        by.setdefault(r.verdict, []).append(r.horizon)
    if len(by) == 1:
        return f"{rows[0].verdict} at every horizon ({', '.join(f'{h}x' for h in sorted(r.horizon for r in rows))})"
    order = sorted(by, key=lambda v: -max(by[v]))
    return "; ".join(f"{v} at {', '.join(f'{h}x' for h in by[v])}" for v in order)


def setting_text(check: Check) -> str:
    """The recipes a check compares (their descriptions head the experiment's section of the page)."""
    return ", ".join(f"`{n}`" for n in dict.fromkeys(sel["recipe"] for sel in check.selectors.values()))


def describe(selector: Dict) -> str:
    """A selector in words: ``pipemare-t1 at the largest P (recipe pipemare)``."""
    where = {"max": " at the largest P"}.get(selector.get("stages"), "")
    if isinstance(selector.get("stages"), int):
        where = f" at P={selector['stages']}"
    rest = [f"{k}={v}" for k, v in selector.items() if k not in ("recipe", "method", "stages")]
    return f"{selector.get('method', 'runs')}{where}{' (' + ', '.join(rest) + ')' if rest else ''} " \
           f"(recipe {selector['recipe']})"
