"""Running the ledger: one resumable sweep over the runs of the chosen experiments, then the rows.

All experiments share one sweep directory: a run two experiments need (the
same config, hence the same ``run_id``) is trained once. Each launch appends
its start, end, machine and command to ``OUT/launches.jsonl``, so the page can
say when and where its numbers were made, and how long training took in all.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import resource
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from .. import sweep
from ..machine import describe as describe_machine
from ..config import RunConfig
from ..errors import RunFileError
from .report import markdown
from .spec import Check, Experiment
from .verdict import Row, evaluate_horizons, scores, setting_text

__all__ = ["plan", "done", "estimate", "train", "rows", "machine", "cpu_seconds", "record_launch", "launches", "run_spans", "provenance", "write_page", "command_line"]


def plan(selection: Sequence[Tuple[Experiment, Optional[Check]]],
         tier: str = "quick") -> Tuple[List[RunConfig], Dict[str, str]]:
    """The distinct runs of the selected experiments (or single checks) in ``tier``, shortest horizon first, and
    ``run_id -> recipe``."""
    configs, recipe_of, horizon = [], {}, {}
    for exp, check in selection:
        for c in exp.configs_for(check, tier):
            if c.run_id() not in recipe_of:
                configs.append(c)
                recipe_of[c.run_id()] = exp.recipe_of[c.run_id()]
                horizon[c.run_id()] = exp.horizon_of[c.run_id()]
    configs.sort(key=lambda c: horizon[c.run_id()])         # stable: the quick tier first, in experiment order
    return configs, recipe_of


def done(configs: Sequence[RunConfig], out: Path) -> set:
    """The run ids of ``configs`` finished in ``out``."""
    return {c.run_id() for c in configs if sweep.run_state(Path(out) / "runs" / c.run_id()) == "done"}


def _family(c: RunConfig) -> Tuple:
    return c.model, json.dumps(c.model_kwargs, sort_keys=True), c.data, json.dumps(c.data_kwargs, sort_keys=True), \
        c.batch_size, c.microbatches, c.device


def _steps(c: RunConfig, n_train: Dict[Tuple, int]) -> int:
    """The run's optimizer steps (:func:`staleopt.train.total_steps`), loading each dataset once for its size."""
    from .. import data, train as training
    key = (c.data, json.dumps(c.data_kwargs, sort_keys=True))
    if key not in n_train:
        n_train[key] = len(data.load(c.data, **c.data_kwargs).train)
    return training.total_steps(c, n_train[key])


def _calibrate(c: RunConfig, steps: int = 20) -> Tuple[float, float]:
    """``(seconds per training step, seconds of setup and evaluation)`` of ``c`` in this process on one torch
    thread, as a sweep worker trains: a 3-step warm-up run, then a ``steps``-step run (records' ``wall_time``
    counts training only)."""
    import torch

    from .. import train as training
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        training.run(c.replace(epochs=1, max_steps=3))
        t0 = time.perf_counter()
        records = training.run(c.replace(epochs=1, max_steps=steps))
    finally:
        torch.set_num_threads(threads)
    train_s = float(records["wall_time"].iloc[-1])
    return train_s / steps, time.perf_counter() - t0 - train_s


def _measured(path: Path) -> Optional[Tuple[float, float]]:
    """``(seconds per training step, other seconds)`` of the finished run in ``path``; None if unreadable."""
    try:
        done = sweep.read_done(path / "done")
        last = sweep.read_records(path / "records.csv", done, columns=("step", "wall_time")).iloc[-1]
        secs = float(done["seconds"])
        return float(last["wall_time"]) / max(1, int(last["step"])), max(0.0, secs - float(last["wall_time"]))
    except (OSError, ValueError, KeyError, IndexError, TypeError, RunFileError):
        return None


def estimate(configs: Sequence[RunConfig], out: Path, workers: int, calibrate: bool = True) -> str:
    """What training the unfinished ``configs`` will cost, said before it starts.

    A run costs ``steps * rate + overhead``: the rate (seconds per training step) per model family (model, data,
    batch, microbatches, device) and the overhead (startup, evaluation) come from the finished runs in ``out``,
    else, with ``calibrate``, from a 20-step run in this process. The total is spread over ``workers`` runs."""
    pending = [c for c in configs if sweep.run_state(Path(out) / "runs" / c.run_id()) != "done"]
    if not pending:
        return f"all {len(configs)} runs are finished in {out}: nothing to train"
    n_train: Dict[Tuple, int] = {}
    try:
        steps = {c.run_id(): _steps(c, n_train) for c in pending}
    except Exception as e:      # e.g. the paper scale's CIFAR-10 files are not here: train will say so
        return f"{len(pending)} of {len(configs)} runs to train; cost unknown ({type(e).__name__}: {e})"
    measured: Dict[Tuple, List[Tuple[float, float]]] = {}
    for c in configs:
        path = Path(out) / "runs" / c.run_id()
        got = _measured(path) if sweep.run_state(path) == "done" else None
        if got:
            measured.setdefault(_family(c), []).append(got)
    rates, sources = {}, []
    for fam in dict.fromkeys(_family(c) for c in pending):
        example = next(c for c in pending if _family(c) == fam)
        if measured.get(fam):
            got = measured[fam]
            rates[fam] = (sum(r for r, _ in got) / len(got), sum(o for _, o in got) / len(got))
            how = f"{len(got)} finished runs"
        elif calibrate:
            try:
                rates[fam] = _calibrate(example)
            except Exception as e:
                return f"{len(pending)} of {len(configs)} runs to train; cost unknown (calibration failed: {e})"
            how = "a 20-step calibration run"
        else:
            return f"{len(pending)} of {len(configs)} runs to train; cost unknown (no finished run of {example.model})"
        sources.append(f"{example.model}/{example.data} N={example.microbatches}: {1e3 * rates[fam][0]:.1f} ms/step "
                       f"+ {rates[fam][1]:.0f} s per run, from {how}")
    secs = sum(steps[c.run_id()] * rates[_family(c)][0] + rates[_family(c)][1] for c in pending)
    return (f"{len(pending)} of {len(configs)} runs to train, {sum(steps.values()):,} optimizer steps; estimated "
            f"{secs / 60:.0f} run-min, about {secs / 60 / workers:.0f} min with {workers} worker(s) on otherwise idle "
            f"cores ({'; '.join(sources)})")


def train(configs: Sequence[RunConfig], out: Path, workers: int, bar: bool = True,
          shard: Optional[Tuple[int, int]] = None, executor: str = "local") -> sweep.SweepReport:
    """Run every unfinished config into ``out`` (:func:`staleopt.sweep.run_sweep`, one torch thread per run),
    recording the launch in ``out/launches.jsonl`` when it starts and when it ends, interrupted or not."""
    t0, cpu0, launch, command = time.time(), cpu_seconds(), uuid.uuid4().hex[:12], command_line()
    before = done(configs, out)
    record_launch(Path(out), launch, t0, command)
    whole = False
    try:
        report = sweep.run_sweep(list(configs), out, workers=workers, threads=1, bar=bar, shard_spec=shard,
                                 executor=executor)
        whole = True
        return report
    finally:   # an interrupted launch's killed workers are never reaped, so their CPU time cannot be counted
        record_launch(Path(out), launch, t0, command, time.time(), len(done(configs, out) - before),
                      cpu_seconds() - cpu0 if whole else None)


def rows(selection: Sequence[Tuple[Experiment, Optional[Check]]], out: Path, tier: str = "quick") -> List[Row]:
    """The ledger rows of the selected checks from the finished runs in ``out``: one per check and horizon of
    ``tier``, shortest horizon first."""
    records = sweep.collect(out)
    result = []
    for exp, only in selection:
        mine = records[records["run"].isin(list(exp.recipe_of))] if not records.empty else records
        runs = scores(mine, exp.recipe_of, exp.horizon_of, exp.base_of)
        planned = [exp.row(c) for c in exp.configs]   # (finished or not: a verdict on fewer seeds says so)
        for check in ([only] if only else exp.checks):
            result += evaluate_horizons(exp.resolved(check), runs, exp.name, setting_text(check),
                                        exp.horizons_of(check, tier), planned)
    return result


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the sweep's workers), user + system, in seconds."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


#: How the launch log and the page write a time (UTC).
_TIME = "%Y-%m-%d %H:%M:%S UTC"


def record_launch(out: Path, launch: str, started: float, command: str, ended: Optional[float] = None,
                  trained: Optional[int] = None, cpu: Optional[float] = None) -> None:
    """Append the state of launch ``launch`` to ``out/launches.jsonl``: once when it starts, again when it ends
    (``trained``: runs it finished; ``cpu``: its CPU seconds, all workers together). :func:`launches` keeps
    each launch's last entry."""
    entry = {"launch": launch, "started": time.strftime(_TIME, time.gmtime(started)),
             "ended": None if ended is None else time.strftime(_TIME, time.gmtime(ended)),
             "seconds": None if ended is None else round(ended - started, 1), "machine": describe_machine(),
             "command": command}
    if ended is not None:
        entry.update(trained=trained, cpu_seconds=None if cpu is None else round(cpu, 1))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "launches.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _utc(text: str) -> datetime.datetime:
    """A time :func:`record_launch` wrote (``2026-11-28 10:51:54 UTC``)."""
    return datetime.datetime.strptime(text, _TIME).replace(tzinfo=datetime.timezone.utc)


def launches(out: Path) -> List[Dict]:
    """Each launch's last entry, in the order they started."""
    path = Path(out) / "launches.jsonl"
    latest: Dict[str, Dict] = {}
    for n, line in enumerate(path.read_text().splitlines() if path.is_file() else [], 1):
        if line.strip():
            try:
                entry = json.loads(line)
                _utc(entry["started"])  # (the page reads the times)
                if entry.get("ended") is not None:
                    _utc(entry["ended"])
                latest[entry.get("launch", entry["started"])] = entry
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise RunFileError(f"{path}, line {n}, is not a launch entry (a JSON object with 'started' and "
                                   f"'ended' times): {type(e).__name__}: {e}; repair or delete that line (the runs "
                                   "themselves are in runs/, each with its own done marker)") from None
    return list(latest.values())


def run_spans(configs: Sequence[RunConfig], out: Path) -> List[Tuple[datetime.datetime, datetime.datetime, float]]:
    """From the finished runs' ``done`` files: each run's start, end (aware datetimes) and wall seconds (a resumed
    run counts its last launch only)."""
    spans = []
    for c in configs:
        path = Path(out) / "runs" / c.run_id() / "done"
        if path.is_file():
            d = sweep.read_done(path)
            end = datetime.datetime.strptime(d["finished"], "%Y-%m-%dT%H:%M:%S%z")
            spans.append((end - datetime.timedelta(seconds=d["seconds"]), end, d["seconds"]))
    return spans


def _times(spans) -> Optional[Tuple[str, str, float]]:
    """When the first of ``spans`` (:func:`run_spans`) started, when the last ended (UTC), and their seconds."""
    if not spans:
        return None
    first = min(s for s, _, _ in spans).astimezone(datetime.timezone.utc)
    last = max(e for _, e, _ in spans).astimezone(datetime.timezone.utc)
    return first.strftime(_TIME), last.strftime(_TIME), sum(x for _, _, x in spans)


def _cpu_text(ended: Sequence[Dict], spans) -> str:
    """CPU time of the launches that recorded it (an interrupted launch does not), and the finished runs' CPU time
    at that rate per run-second: the runs a launch trained are the finished runs that ended within it. (Scaled
    by run count, the rate of a few long runs, GPT's, stood for every run's and overstated the whole twice.)"""
    known = [e for e in ended if e.get("cpu_seconds") is not None]
    if not known:
        return "not recorded (every launch that trained runs was interrupted)"
    runs, secs = sum(e["trained"] for e in known), sum(e["cpu_seconds"] for e in known)
    missing = len(ended) - len(known)
    note = (f"; {missing} interrupted launch(es) that trained {sum(e['trained'] for e in ended) - runs} runs did "
            "not record theirs" if missing else "")
    text = f"{secs / 60:.1f} CPU-min (user + system, all workers) for the {runs} runs of the launches that " \
           f"recorded it{note}"
    second = datetime.timedelta(seconds=1)  # (the times are whole seconds)
    windows = [(_utc(e["started"]) - second, _utc(e["ended"]) + second) for e in known]
    theirs = sum(x for _, end, x in spans if any(a <= end <= b for a, b in windows))
    if not theirs:
        return text
    whole = secs / theirs * sum(x for _, _, x in spans)
    return (f"{text}, whose runs' wall times add up to {theirs / 60:.1f} run-min; at that rate the {len(spans)} "
            f"finished runs took about {whole / 60:.0f} CPU-min, i.e. about {whole / 120:.0f} min on 2 otherwise "
            "idle cores")


def provenance(out: Path, total_runs: int, finished_runs: int, spans: Sequence = ()) -> Dict[str, str]:
    """The page's account of the runs: dates, machines, commands, wall and CPU time of the launches that trained,
    and the finished runs' own times (``spans``: :func:`run_spans`).

    A launch that has not recorded its end is still running or was killed; its time is not counted."""
    info = {"runs": f"{finished_runs} of {total_runs} finished"}
    logged = launches(out)
    ended = [e for e in logged if e.get("ended") is not None and e.get("trained")]
    open_ = [e for e in logged if e.get("ended") is None]
    if ended:
        info = {
            "date": f"{ended[0]['started']} to {ended[-1]['ended']}",
            "machine": "; ".join(dict.fromkeys(e["machine"] for e in ended)),
            "command": "; ".join(f"`{c}`" for c in dict.fromkeys(e["command"] for e in ended)),
            "wall time": f"{sum(e['seconds'] for e in ended) / 60:.1f} min in {len(ended)} launch(es) that "
                         f"trained runs ({', '.join(str(round(e['seconds'] / 60, 1)) + ' min' for e in ended)})",
            "CPU time": _cpu_text(ended, spans),
            "runs": f"{finished_runs} of {total_runs} finished ({sum(e['trained'] for e in ended)} trained by "
                    "these launches)",
        }
    times = _times(spans)
    if times:
        info["runs' own times"] = (f"first run started {times[0]}, last finished {times[1]}; their wall times add "
                                   f"up to {times[2] / 60:.1f} run-min (a resumed run counts its last launch only)")
    if open_:
        info["unfinished launches"] = "; ".join(f"started {e['started']} (`{e['command']}`), no end recorded: "
                                                "still running or killed" for e in open_)
    return info


def write_page(path: Path, experiments: Sequence[Experiment], out: Path, extra: Sequence[Row] = (),
               tier: str = "quick") -> List[Row]:
    """Evaluate every experiment on ``out`` in ``tier``, append ``extra`` rows (the analytic ones), write the page
    to ``path`` and, for each experiment with a check at several horizons, its gap figure to
    ``<path's folder>/img/reproductions/<experiment>.png``."""
    from ..plot.ledger import horizon_figure
    from .report import group

    selection = [(e, None) for e in experiments]
    configs, _ = plan(selection, tier)
    states = [sweep.run_state(Path(out) / "runs" / c.run_id()) for c in configs]
    result = rows(selection, out, tier) + list(extra)
    # (provenance reads the launch log, which may be damaged: refused before any file is written)
    info = provenance(out, len(configs), sum(s == "done" for s in states), run_spans(configs, out))
    checks = {(e.name, c.id): e.resolved(c) for e in experiments for c in e.checks}
    figures = {}
    for e in experiments:
        panels = [(checks[(e.name, g[0].id)], g) for g in group([r for r in result if r.experiment == e.name])
                  if len(g) > 1]
        if panels:
            rel = f"img/reproductions/{e.name}.png"
            horizon_figure(panels, Path(path).parent / rel, title=e.title)
            figures[e.name] = rel
    sections = {}
    for e in experiments:
        used = dict.fromkeys(e.recipe_of.values())
        sections[e.name] = (f"{e.title} ({e.paper})", "Recipes: " + "; ".join(
            f"`{n}`: {e.recipes[n].description}, seeds {', '.join(map(str, e.recipes[n].seeds))}" for n in used) + ".")
    sections["analytic"] = ("Analytic rows (no training)", "")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(markdown(result, info, sections, checks, figures, _another_machine(Path(path), result)))
    rows_csv(result, Path(path).with_suffix(".csv"))
    return result


#: Columns of the rows file written beside the page (:func:`rows_csv`).
ROW_COLUMNS = ("experiment", "id", "claim", "horizon", "steps", "ratio", "verdict", "estimate", "half_width",
               "trend", "gaps", "diverged")


def _json_number(x: float):
    """``x``, or ``"inf"`` / ``"-inf"`` / ``"nan"`` where it is not finite: strict JSON has no such numbers
    (Python's ``Infinity`` is read by Python alone); ``float()`` reads both forms back."""
    return x if math.isfinite(x) else str(x)


def _another_machine(page: Path, result: Sequence[Row]) -> str:
    """The paragraph comparing ``result`` with the same ladder on another machine, when its table lies beside the
    page: ``PAGE-another-cpu.csv`` (a copy of that run's :func:`rows_csv`) and ``PAGE-another-cpu.json`` (its
    ``date``, ``machine`` and ``commit``); "" without them."""
    import csv

    from .report import another_machine
    table, about = (page.with_name(f"{page.stem}-another-cpu{suffix}") for suffix in (".csv", ".json"))
    if not table.is_file():
        return ""
    try:
        with table.open(newline="") as f:
            theirs = list(csv.DictReader(f))
        info = json.loads(about.read_text())
        return another_machine(result, theirs, {k: str(info[k]) for k in ("date", "machine", "commit")}, table.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunFileError(f"{table} (and {about.name}) must be another machine's ledger table and its date, "
                           f"machine and commit ({type(e).__name__}: {e}): copy them again, or remove both") from None


def rows_csv(result: Sequence[Row], path: Path) -> None:
    """The page's rows as CSV, one line per check and horizon (``gaps``: the per-seed gaps as strict JSON ``[[seed,
    gap], ...]``, an infinite gap (a diverged run) as the string ``"inf"`` or ``"-inf"``; ``diverged``: the seeds
    among them where a compared run diverged, a JSON list; ``trend``: the check's trend label): what the README's
    ledger summary and the figures are drawn from."""
    from .report import group
    from .verdict import trend
    lines = []
    for g in group(result):
        label = trend(g).label
        for r in g:
            lines.append({"experiment": r.experiment, "id": r.id, "claim": r.claim, "horizon": r.horizon,
                          "steps": r.steps, "ratio": r.ratio, "verdict": r.verdict, "estimate": r.estimate,
                          "half_width": r.half_width, "trend": label,
                          "gaps": json.dumps([[seed, _json_number(g)] for seed, g in r.gaps], allow_nan=False),
                          "diverged": json.dumps(list(r.diverged))})
    pd.DataFrame(lines, columns=list(ROW_COLUMNS)).to_csv(path, index=False)


def command_line() -> str:
    """How this process was invoked, for the record."""
    return "staleopt " + " ".join(shlex.quote(a) for a in sys.argv[1:])
