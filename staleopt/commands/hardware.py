"""``staleopt hardware``: price methods with the analytic hardware model (utilization and memory)."""
from __future__ import annotations

import argparse
import csv
import os

import torch

from .. import methods as methods_module
from .. import models
from ..errors import ConfigError, ScheduleError, StageError
from ..hardware import activation_sizes, memory_report
from ..methods import PHASE_LENGTHS, build
from ..partition import partition_model
from ..plot import plot_hardware_sweep
from ..validate import check_int, output_dir

__all__ = ["register", "run"]

DESCRIPTION = """\
Pipeline utilization and memory (bytes, shown in MiB) of a method on a model,
from the analytic hardware model (staleopt.hardware; PipeMare Table 1-2, App. A).

examples:
  staleopt hardware --model resnet50-cifar --method pipemare --stages 107 --microbatches 8
  staleopt hardware --model resnet50-cifar --compare gpipe,pipemare-stash,pipemare --stages 107 \\
      --microbatches 8 --optimizer sgd-momentum
  staleopt hardware --model resnet50-cifar --compare gpipe,pipemare --stages 107 --microbatches 8 \\
      --microbatch-size 8                       # adds activation memory (with/without recompute)
  staleopt hardware --model resnet50-cifar --compare gpipe,pipedream,pipemare \\
      --stages 1,2,4,8,16,32,64,107 --microbatches 8 --out runs/hw   # CSV + plot
  staleopt hardware --model resnet50-cifar --method pipemare-w --stages 107 --microbatches 16 \\
      --total-steps 90 --warmup-steps 30      # amortized utilization (phases in steps or epochs)
"""

_MIB = 2 ** 20

#: ``--stages`` when not given: one stage per parametrized operator of resnet50-cifar (PipeMare Table 2).
DEFAULT_STAGES = 107


def register(subparsers) -> None:
    p = subparsers.add_parser("hardware", help="utilization and memory of methods (analytic hardware model)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model name from staleopt.models (e.g. resnet50-cifar)")
    p.add_argument("--method", default=None, help="method or schedule name (e.g. pipemare)")
    p.add_argument("--compare", default=None, help="comma-separated methods side by side (e.g. gpipe,pipemare)")
    p.add_argument("--stages", default=None,
                   help=f"P, or a comma-separated list to sweep (e.g. 1,2,4,8); default {DEFAULT_STAGES}, "
                        "resnet50-cifar's operators (PipeMare's P on CIFAR-10)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per minibatch N (default: 1)")
    p.add_argument("--optimizer", default="sgd-momentum", choices=["sgd", "sgd-momentum", "adam", "adamw", "nadamw"],
                   help="optimizer whose state is counted (default: sgd-momentum)")
    p.add_argument("--microbatch-size", type=int, default=None,
                   help="samples per microbatch; adds activation memory (measured on one example input)")
    p.add_argument("--num-classes", type=int, default=None, help="model output classes (default: the model's)")
    p.add_argument("--data", default=None, metavar="NAME",
                   help="a dataset (staleopt.data, or file.py:function) whose classes and input shape build the "
                        "model and its example input: needed for a model of your own (file.py:function)")
    p.add_argument("--total-steps", type=float, default=None,
                   help="run length for phased methods (pipemare-w, pb-hybrid), in steps or epochs")
    p.add_argument("--warmup-steps", type=float, default=None, help="pipemare-w's synchronous warmup length")
    p.add_argument("--pipelined-steps", type=float, default=None, help="pb-hybrid's pipelined phase length")
    p.add_argument("--out", default=None, help="directory for hardware.csv (and hardware.png when sweeping)")
    p.set_defaults(func=run)


def _stages(text: str):
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--stages must be an int or comma-separated ints (e.g. 1,2,4,8), got {text!r}") from None
    if not values:
        raise ConfigError(f"--stages needs ints >= 1, got {text!r}")
    for i, value in enumerate(values):
        check_int("--stages", value, minimum=1)
        if value in values[:i]:  # (the same P twice would be priced twice: two identical rows)
            raise ConfigError(f"--stages {text}: {value} is already in the list; give each value once")
    return values


def rows_for(model, methods, stages_list, args, example_input=None):
    """One dict per (method, P): utilization and every memory field (bytes)."""
    phase = {k: v for k, v in (("total_steps", args.total_steps), ("warmup_steps", args.warmup_steps),
                               ("pipelined_steps", args.pipelined_steps)) if v is not None}
    for key, (_, what) in PHASE_LENGTHS.items():  # a phase's length goes to the methods with that phase
        if phase.get(key) and not any(key in build(m, 1, 1).phase_lengths for m in methods):
            raise ConfigError(f"--{key.replace('_', '-')} would change nothing: none of {', '.join(methods)} has "
                              f"that phase, a {what}; leave it out")
    if "total_steps" in phase and not any(build(m, 1, 1).phase_lengths for m in methods):
        raise ConfigError(f"--total-steps would change nothing: it averages a phased method's utilization over the "
                          f"run (pipemare-w, pb-hybrid), and none of {', '.join(methods)} has phases; leave it out")
    rows = []
    for P in stages_list:
        partition = partition_model(model, P)
        sizes = None if example_input is None else activation_sizes(model, partition, example_input,
                                                                    args.microbatch_size)
        for method in methods:
            pipeline = build(method, P, args.microbatches)
            util = pipeline.utilization(**{k: v for k, v in phase.items()
                                           if k not in PHASE_LENGTHS or k in pipeline.phase_lengths})
            rep = memory_report(model, pipeline, P, args.microbatches, optimizer=args.optimizer, partition=partition,
                                microbatch_size=args.microbatch_size if example_input is not None else None,
                                example_input=example_input, sizes=sizes)
            row = {"method": method, "stages": P, "microbatches": args.microbatches, "optimizer": args.optimizer,
                   "utilization": util}
            row.update({k: v for k, v in rep.rows() if k not in ("method", "stages", "microbatches", "optimizer")})
            rows.append(row)
    return rows


def format_sweep(rows, model_name: str = "model") -> str:
    """One line per (method, P): utilization, then (with activations) the total memory and its ratio to GPipe's,
    then the weight+optimizer memory and its ratio, the activations without and with recompute."""
    act = any(r["activation_bytes"] is not None for r in rows)
    head = (["method", "P", "utilization"] + (["total (MiB)", "total x GPipe"] if act else [])
            + ["weight+opt (MiB)", "weight+opt x GPipe"]
            + (["activations (MiB)", "with recompute (MiB)"] if act else []))
    body = [[r["method"], str(r["stages"]), f"{100 * r['utilization']:.1f}%"]
            + ([f"{r['total_bytes'] / _MIB:,.1f}", f"{r['total_ratio_to_gpipe']:.3f}x"] if act else [])
            + [f"{r['weight_optimizer_bytes'] / _MIB:,.1f}", f"{r['ratio_to_gpipe']:.3f}x"]
            + ([f"{r['activation_bytes'] / _MIB:,.1f}", f"{r['activation_recompute_bytes'] / _MIB:,.1f}"]
               if act else []) for r in rows]
    widths = [max(len(h), *(len(b[j]) for b in body)) for j, h in enumerate(head)]
    r0 = rows[0]
    lines = [f"{model_name}: N={r0['microbatches']}, optimizer {r0['optimizer']}",
             "| " + " | ".join(h.ljust(w) if j == 0 else h.rjust(w) for j, (h, w) in enumerate(zip(head, widths)))
             + " |",
             "|" + "|".join("-" * (w + 2) if j == 0 else "-" * (w + 1) + ":" for j, w in enumerate(widths)) + "|"]
    for b in body:
        lines.append("| " + " | ".join(c.ljust(w) if j == 0 else c.rjust(w)
                                      for j, (c, w) in enumerate(zip(b, widths))) + " |")
    return "\n".join(lines)


def format_table(rows, model_name: str = "model") -> str:
    """Fields down, methods across; bytes shown in MiB."""
    keys = [k for k in rows[0] if k not in ("method", "stages", "microbatches", "optimizer")]
    keys = [k for k in keys if any(r[k] is not None for r in rows)]
    if any(r.get("total_ratio_to_gpipe") is not None for r in rows):  # the headline: memory in all, first
        head = [k for k in ("utilization", "total_bytes", "total_ratio_to_gpipe") if k in keys]
        keys = head + [k for k in keys if k not in head]
    heads = [r["method"] for r in rows]

    def cell(k, v):
        if v is None:
            return "-"
        if k.endswith("_bytes"):
            return f"{v / _MIB:,.1f}"
        if k == "utilization":
            return f"{100 * v:.1f}%"
        if isinstance(v, float):
            return f"{v:.3f}x" if "ratio" in k else f"{v:.3f}"
        return str(v)

    label = {k: (k[:-6] + " (MiB)" if k.endswith("_bytes") else k) for k in keys}
    width0 = max(len(v) for v in label.values())
    cols = [[cell(k, r[k]) for k in keys] for r in rows]
    widths = [max(len(h), *(len(c) for c in col)) for h, col in zip(heads, cols)]
    r0 = rows[0]
    lines = [f"{model_name}: P={r0['stages']}, N={r0['microbatches']}, optimizer {r0['optimizer']}",
             "| " + "field".ljust(width0) + " | " + " | ".join(h.rjust(w) for h, w in zip(heads, widths)) + " |",
             "|" + "-" * (width0 + 2) + "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    for j, k in enumerate(keys):
        lines.append("| " + label[k].ljust(width0) + " | "
                     + " | ".join(col[j].rjust(w) for col, w in zip(cols, widths)) + " |")
    return "\n".join(lines)


def _pipeline_of(name: str, stages: int, microbatches: int) -> str:
    """What ``name`` runs on ``stages`` and ``microbatches``: its schedule, corrections and timeline (an alias, or a
    schedule's name such as ``sync`` for ``gpipe``, runs the same as the method it stands for); the name itself
    where it builds nothing (``rows_for`` names the error)."""
    try:
        p = methods_module.build(name, stages, microbatches)
    except (ScheduleError, ConfigError):
        return name
    return f"{p.schedule!r} {p.corrections!r} {p.timeline_name}"


def run(args) -> int:
    if not args.method and not args.compare:
        raise ConfigError("give --method NAME or --compare NAME,NAME,...")
    if args.method and args.compare:
        raise ConfigError(f"give --method {args.method} or --compare {args.compare}, not both (one method: "
                          "--method; several side by side: --compare, which may include it)")
    if args.out:
        output_dir(args.out)
    methods = [m.strip() for m in (args.compare or args.method).split(",") if m.strip()]
    if not methods:
        raise ConfigError(f"{'--compare' if args.compare else '--method'} names no method: give NAME (--method) or "
                          "NAME,NAME,... (--compare), names from staleopt.methods.names()")
    flag = "--compare" if args.compare else "--method"
    for m in methods:  # (before any partition: a misspelt name is the error, not the stage count)
        try:
            methods_module.build(m, 1, 1)
        except ScheduleError as e:
            raise ScheduleError(f"{flag}: {e}") from None
    stages_list = _stages(str(DEFAULT_STAGES) if args.stages is None else args.stages)
    runs = [_pipeline_of(m, stages_list[0], args.microbatches) for m in methods]  # ("1f1b-flush" is "pipedream-flush")
    twice = [m for m, r in zip(methods, runs) if runs.count(r) > 1]
    if twice:
        raise ConfigError(f"--compare names one pipeline more than once ({', '.join(twice)}: an alias, or a schedule "
                          "that a method runs without corrections; its column would be printed twice): name each once")
    kwargs = {} if args.num_classes is None else {"num_classes": check_int("--num-classes", args.num_classes, 1)}
    data = None
    if args.data is not None:
        from .. import data as datasets
        data = datasets.load(args.data)
        kwargs = {"num_classes": data.num_classes, **kwargs, "input_shape": tuple(data.input_shape)}
    try:
        model = models.get(args.model, **kwargs)
    except TypeError as e:  # (a factory of the user's that needs num_classes and input_shape)
        raise ConfigError(f"model {args.model!r} could not be built from the options given ({e}): pass --data NAME "
                          "(a dataset of staleopt.data or file.py:function), whose classes and input shape build it")
    if args.stages is None:
        most = len(partition_model(model, "max"))
        if DEFAULT_STAGES > most:
            raise StageError(f"--stages defaults to {DEFAULT_STAGES} (resnet50-cifar's parametrized operators), and "
                             f"model {args.model!r} has {most}: pass --stages P with 1 <= P <= {most}")
    example = None
    if args.microbatch_size is not None:
        check_int("--microbatch-size", args.microbatch_size, 1, why="samples per microbatch")
        if data is not None:  # (one sample: activation_sizes scales it to the microbatch size)
            example = torch.as_tensor(data.train[0][0]).unsqueeze(0)
        else:
            info = models.info(args.model)  # a language model reads int64 tokens
            if not info.input_shape:
                raise ConfigError(f"--microbatch-size needs the input shape of model {args.model!r}, which does not "
                                  "declare one: pass --data NAME (a dataset of staleopt.data or file.py:function)")
            example = torch.zeros(1, *info.input_shape, dtype=torch.long if info.lm else torch.float32)
    rows = rows_for(model, methods, stages_list, args, example)
    print(format_table(rows, args.model) if len(stages_list) == 1 else format_sweep(rows, args.model))
    if example is None:
        print("(weights, gradients, optimizer state and correction buffers only: --microbatch-size B adds the "
              "activations in flight, which often decide the order of the methods)")
    if args.out:
        path = os.path.join(args.out, "hardware.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
        if len(stages_list) > 1:
            axes = plot_hardware_sweep(rows)
            fig = axes[0].figure
            fig.suptitle(f"{args.model}, N={args.microbatches}, {args.optimizer}", fontsize=10)
            fig.tight_layout()
            png = os.path.join(args.out, "hardware.png")
            fig.savefig(png, dpi=120)
            print(f"wrote {png}")
    return 0
