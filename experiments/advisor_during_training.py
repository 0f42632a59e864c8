"""How the stability advisor's bound moves during training: the record behind docs/performance.md's section
"The advisor during training".

    python experiments/advisor_during_training.py --out docs/advisor-during-training

The setting of docs/theory.md's advisor example: ``cnn1d`` on MNIST-1D, 9 stages, plain SGD (no momentum: the
bound of Lemma 1), batch 128 (the advisor's batch: the first 128 training samples). Two parts, each over
``--seeds`` (the weights' seed and the batches' shuffling):

* ``curvature.csv``: after ``k`` synchronous SGD steps at ``--lr`` (``k`` in ``--sync-steps``), each stage's top
  Hessian eigenvalue and the advisor's bound for ``dataflow`` (``staleopt.advise``, 100 power iterations; under
  ``pipemare-t1`` at its first step, T1's factor ``1/tau_i`` lets the base lr be ``tau_i`` times larger:
  ``t1_max_base_lr``): how far the bound at initialization is from the one a few dozen steps later.
* ``losses.csv``: the training loss of every step of ``--steps`` pipelined steps from initialization, for
  ``dataflow`` at ``--lr`` and ``pipemare-t1`` (T1 held near ``1/tau``: ``anneal_steps`` 100 times the run, so ``p_k >= 0.99``) at each of
  ``--t1-lrs``; a run stops at its first loss above 100 or not finite (diverged at that step).

``meta.json`` records the date, machine, commit and command; ``python -m staleopt.docgen`` renders the page's
section from these files. Takes about 3 minutes on a 2-core machine (1 torch thread).
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

import staleopt
from staleopt import data, methods, models
from staleopt.machine import describe, source_commit

MODEL, STAGES, BATCH, DIVERGED = "cnn1d", 9, 128, 100.0


def _model(d, seed: int) -> torch.nn.Module:
    return models.get(MODEL, num_classes=d.num_classes, input_shape=d.input_shape, seed=seed)


def _batches(d, seed: int):
    """Minibatches of ``BATCH`` training samples, reshuffled every epoch by a generator seeded ``seed``."""
    x, y = d.train.tensors
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=g)
        for a in range(0, len(x) - BATCH + 1, BATCH):
            idx = order[a:a + BATCH]
            yield x[idx], y[idx]


def curvature(d, seed: int, sync_steps, lr: float):
    """Per stage, after each count of synchronous SGD steps: curvature and the advisor's bound for dataflow."""
    model, rows, done = _model(d, seed), [], 0
    base = torch.optim.SGD(model.parameters(), lr=lr)
    probe = tuple(t[:BATCH] for t in d.train.tensors)
    batches = _batches(d, seed)
    for k in sorted(sync_steps):
        while done < k:
            x, y = next(batches)
            base.zero_grad()
            F.cross_entropy(model(x), y).backward()
            base.step()
            done += 1
        advice = staleopt.advise(model, F.cross_entropy, probe, "dataflow", stages=STAGES, lr=lr, iters=100)
        for r in advice.table.itertuples():
            rows.append({"seed": seed, "sync_steps": k, "stage": r.stage, "tau_fwd": r.tau_fwd,
                         "curvature": r.curvature, "max_stable_lr": r.max_stable_lr, "converged": r.converged,
                         "t1_max_base_lr": r.max_stable_lr * max(r.tau_fwd, 1)})
    return rows


def trajectory(d, seed: int, method: str, lr: float, steps: int):
    """The loss of every step of a pipelined run of ``method`` from initialization, up to its divergence."""
    model = _model(d, seed)
    args = {"anneal_steps": 100 * steps} if "anneal_steps" in methods.hyperparameters(method) else {}
    pipeline = methods.build(method, STAGES, 1, **args)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=STAGES,
                                     schedule=pipeline.schedule, corrections=pipeline.corrections, seed=seed)
    rows, batches = [], _batches(d, seed)
    for step in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        value = float(loss.detach())
        rows.append({"method": method, "lr": lr, "seed": seed, "step": step, "loss": value})
        if not value <= DIVERGED:
            break
        opt.step()
    opt.remove_hooks()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for curvature.csv, losses.csv, meta.json")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--sync-steps", type=int, nargs="+", default=[0, 30, 60, 120])
    ap.add_argument("--lr", type=float, default=0.1, help="dataflow's lr and the synchronous steps' (default 0.1)")
    ap.add_argument("--t1-lrs", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    ap.add_argument("--steps", type=int, default=150, help="pipelined steps per run (default 150)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe(), "commit": source_commit(), "threads": 1,
            "command": "python experiments/advisor_during_training.py " + " ".join(argv or sys.argv[1:]),
            "model": MODEL, "stages": STAGES, "batch": BATCH, "lr": args.lr, "steps": args.steps}
    d = data.load("mnist1d")
    curv = [row for s in args.seeds for row in curvature(d, s, args.sync_steps, args.lr)]
    pd.DataFrame(curv).to_csv(out / "curvature.csv", index=False)
    runs = [("dataflow", args.lr)] + [("pipemare-t1", lr) for lr in args.t1_lrs]
    losses = [row for method, lr in runs for s in args.seeds for row in trajectory(d, s, method, lr, args.steps)]
    pd.DataFrame(losses).to_csv(out / "losses.csv", index=False)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out}/curvature.csv, losses.csv, meta.json in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
