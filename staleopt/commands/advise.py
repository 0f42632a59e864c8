"""``staleopt advise``: per-stage stability check of a step size before training (staleopt.advisor)."""
from __future__ import annotations

import argparse

import torch

from .. import data as datasets
from .. import models
from ..advisor import advise
from ..train import loss_function
from ..validate import check_int

__all__ = ["register", "run"]

DESCRIPTION = """\
Estimate each pipeline stage's curvature (top Hessian eigenvalue of the loss on
one training batch, by power iteration) and compare the step size the stage
gets under METHOD with PipeMare's quadratic-model bound for its delay
(Lemma 1, or the momentum companion matrix with --momentum, or the Nesterov
look-ahead's for a method whose correction holds the momentum).

The loss is cross-entropy for classification data and mean squared error for
regression data; the model is built at its seeded initialization and, with
--warmup-steps K, first trained synchronously for K steps of SGD at --lr.
Curvature usually grows early in training (progressive sharpening), so the
bound at initialization is optimistic: check again after a warmup.

examples:
  staleopt advise --model resnet1d --method pipemare --stages 8 --lr 0.1
  staleopt advise --model cnn1d --method 1f1b --stages 9 --lr 0.05 --momentum 0.9
  staleopt advise --model mlp --method pipemare-t1 --stages 3 --lr 0.5 --step 1000 --markdown
  staleopt advise --model cnn1d --method dataflow --stages 9 --lr 0.1 --warmup-steps 60
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("advise", help="check a step size against each stage's stability bound",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet1d", help="model name (staleopt models; default: resnet1d)")
    p.add_argument("--data", default="mnist1d", help="dataset name for the batch (default: mnist1d)")
    p.add_argument("--method", required=True, help="method or schedule name, e.g. pipemare, 1f1b, dataflow")
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages P")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per minibatch N (default: 1)")
    p.add_argument("--lr", type=float, required=True, help="base step size to check")
    p.add_argument("--momentum", type=float, default=0.0, help="heavy-ball momentum beta (default: 0)")
    p.add_argument("--step", type=int, default=0,
                   help="T1 step k at which the method's lr factors are taken (default: 0, factor 1/tau)")
    p.add_argument("--batch-size", type=int, default=128, help="batch on which the Hessian is taken (default: 128)")
    p.add_argument("--iters", type=int, default=30, help="power iterations per stage, at most (default: 30)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="synchronous SGD steps at --lr (and --momentum) before measuring (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="model initialization, batch and power iteration seed")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.set_defaults(func=run)


def run(args) -> int:
    check_int("--warmup-steps", args.warmup_steps, minimum=0)
    check_int("--seed", args.seed, minimum=0)
    d = datasets.load(args.data)
    models.check_task(args.model, d.task, f"dataset {args.data!r}")
    model = models.get(args.model, num_classes=d.num_classes, input_shape=d.input_shape, seed=args.seed)
    check_int("--batch-size", args.batch_size, 1, len(d.train), why=f"samples of the batch the curvature is "
              f"measured on, at most the {len(d.train)} training samples")
    gen = torch.Generator().manual_seed(args.seed)
    batch = next(datasets.batches(d.train, args.batch_size, shuffle=True, generator=gen))
    loss_fn = loss_function(d.task)  # the trainer's loss: a language model's cross-entropy over every position
    _warmup(model, loss_fn, d.train, args)
    advice = advise(model, loss_fn, batch, args.method, args.stages, args.microbatches, lr=args.lr,
                    momentum=args.momentum, step=args.step, iters=args.iters, seed=args.seed)
    if args.markdown:
        print(_markdown(advice.table))
        print(f"\nlargest stable lr: {advice.max_lr:.4g}")
    else:
        print(advice)
    return 0


def _warmup(model, loss_fn, train, args) -> None:
    """``args.warmup_steps`` steps of synchronous SGD over shuffled training batches (seeded ``seed + 1``)."""
    if args.warmup_steps <= 0:
        return
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    gen = torch.Generator().manual_seed(args.seed + 1)
    step = 0
    while step < args.warmup_steps:
        for x, y in datasets.batches(train, args.batch_size, shuffle=True, generator=gen, drop_last=True):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            step += 1
            if step == args.warmup_steps:
                return


def _markdown(table) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    head = list(table.columns)
    rows = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    rows += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in table.itertuples(index=False)]
    return "\n".join(rows)
