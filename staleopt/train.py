"""Run one :class:`~staleopt.config.RunConfig`: ``run(config) -> pandas.DataFrame`` of per-epoch records.

The loop is the plain PyTorch one, with the base optimizer wrapped in a
:class:`~staleopt.optimizer.PipelineOptimizer`::

    opt.zero_grad(); loss = criterion(model(x), y); loss.backward(); opt.step(); scheduler.step()

Choices (each documented because it changes numbers):

* **Steps.** One optimizer step per minibatch of ``batch_size`` samples; the
  last incomplete minibatch of an epoch is dropped, so every step sees the same
  batch size (``steps_per_epoch = n_train // batch_size``) and ``max_steps``
  caps the run.
* **Microbatches.** ``N = microbatches`` enters only the delay formulas
  (docs/design.md §1: delays count optimizer steps). The step itself is one
  forward/backward of the whole minibatch: splitting it into ``N``
  microbatches and summing their gradients gives the same gradient, except
  that BatchNorm then normalizes over a microbatch instead of the minibatch.
* **Corrections.** The method's step counts left ``None`` in the config are
  scaled to the run (:func:`method_args`): T1's ``anneal_steps`` ``K`` is a
  quarter of the first learning-rate phase (PipeMare App. C, Table 8: "20
  epochs, which is a quarter of the total epochs before learning rate decay"),
  or five times the linear warmup of a warmup lr schedule (PipeMare §3.1, the
  Transformer recipe);
  PipeMareW's ``warmup_steps`` equals ``K`` (PipeMare App. C: IWSLT14 and
  WMT17 "use the same epochs for synchronous warmup and annealing"); the
  hybrid's ``pipelined_steps`` is half the run (stale-weights paper §6.5:
  100 pipelined + 100 non-pipelined epochs). T2's ``decay`` keeps the method's
  default (0.1, PipeMare Table 8).
* **Learning rate.** ``alpha_{k,base}`` follows ``lr_schedule`` per optimizer
  step through a ``torch.optim.lr_scheduler.LambdaLR`` on the wrapper
  (T1 scales on top of it): ``constant``; ``cosine``
  ``(1 + cos(pi k / T)) / 2`` over the ``T`` steps of the run;
  ``step`` ``gamma^{#{m in milestones : k >= m * steps_per_epoch}}``;
  ``linear-warmup`` ``min(n / W, 1)`` and ``inverse-sqrt`` ``n / W`` up to
  ``n = W``, then ``sqrt(W / n)`` (Fairseq's, PipeMare Table 7), for the
  ``n = k + 1``-th update and ``W = lr_warmup_steps``.
* **Recompute.** Under a schedule that recomputes in segments
  (``dataflow-recompute``, method ``pipemare-recompute``) the model's forward
  runs its layers (:func:`staleopt.models.steps`) with each of the schedule's
  segments (:meth:`~staleopt.schedules.Schedule.segments`) through one
  ``opt.checkpoint`` call (:func:`staleopt.segments.checkpoint_segments`), so
  the backward pass recomputes them with ``u_recomp`` (PipeMare App. A.3,
  App. D.1). Every other schedule runs the model's own forward, unwrapped.
* **Divergence.** A training loss that is non-finite or above
  ``divergence_loss`` ends the run before that step's update; the epoch is
  recorded with ``status = "diverged"``. So does a non-finite test loss (or
  an infinite test perplexity: a loss of 709 nats per token or more, whose
  ``exp`` is beyond a float) at an epoch's end: the training loss reads stale
  forward weights, so ``w_t`` can have overflowed up to ``tau_fwd`` steps
  before the training loss shows it, and the evaluation (on ``w_t``) is where
  it shows first. So does a step whose size the weights' dtype cannot hold
  (torch's "value cannot be converted ... without overflow", e.g.
  ``lr = 1e308``). Never an exception.
* **Evaluation** at the end of each epoch: ``model.eval()`` under
  ``torch.no_grad()``, so the model holds ``w_t`` (docs/design.md §1) and BatchNorm
  uses its running statistics.
* **Language models** (data of task ``"lm"``, model ``gpt``; other pairings
  are a :class:`~staleopt.errors.ConfigError`): the loss is the cross-entropy
  of the logits ``(B, T, V)`` at every position of every window, averaged
  over the predicted tokens (nats per token; all ``B T`` but those whose target
  is :data:`IGNORE_INDEX`, padding), in training and in evaluation alike.
* **Output shapes** are checked at every batch (:class:`~staleopt.errors.ConfigError`
  naming both): ``(B, C)`` for classification, ``(B, T, V)`` for ``"lm"``, and
  for regression as many values per sample as the targets (compared flattened,
  so a ``(B, 1)`` output fits scalar targets ``(B,)``; torch's losses would
  broadcast those into ``(B, B)`` without an error).
* **Determinism.** Initialization draws from ``seed``, the data order and
  the augmentation (:func:`staleopt.data.batches`) from a ``torch.Generator``
  seeded with ``seed``, and anything else random in the loop (dropout) from
  torch's global RNG seeded with ``seed`` inside a forked RNG state (the
  caller's RNG is left as it was). Python's ``random`` and numpy's global RNG,
  which a user's dataset or model may draw from (a transform's noise or
  flip), are seeded with ``seed`` too, and the caller's states put back when
  the run returns; a checkpoint holds all three. On CPU the same config gives
  identical records except ``wall_time``. On a GPU the datasets' tensors live
  on the GPU (:meth:`staleopt.data.Data.to`).

Record columns (one row per epoch; config keys are not repeated, a sweep adds
them): ``epoch``, ``step`` (optimizer steps so far), ``train_loss`` (mean over
the epoch's steps, computed with the stale views the pipeline would use),
``test_loss`` (per token for a language model), ``test_acc`` (NaN for
regression; next-token accuracy for a language model), ``test_ppl``
(``exp(test_loss)`` for a language model, ``inf`` where that overflows; else
NaN), ``best_loss`` (the data's best achievable test loss,
:attr:`staleopt.data.Data.best_loss`; NaN when unknown), ``lr_base`` (the
scheduler's ``alpha_{k,base}`` after the epoch), ``wall_time`` (seconds since
training began), ``status`` (``"ok"`` | ``"diverged"``), ``tau_max`` (largest
forward delay, steps), and the analytic hardware figures of
:mod:`staleopt.hardware`: ``utilization`` (fraction of busy pipeline
workers, averaged over the run), ``memory_bytes`` (weights + gradients +
optimizer state + the method's extra copies) and ``memory_ratio_gpipe``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
import time
import warnings
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Union

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import data as datasets
from . import hardware, methods, models, segments
from .config import LR_WARMUP_SCHEDULES, RunConfig
from .corrections.nesterov import ASYNCPP_MOMENTUM_DECAY
from .errors import CheckpointError, ConfigError, DataError
from .methods import Pipeline
from .optimizer import PipelineOptimizer
from .partition import partition_model

__all__ = ["run", "method_args", "steps_per_epoch", "total_steps", "build_optimizer", "lr_lambda",
           "loss_function", "RECORD_COLUMNS"]

#: Columns of the records :func:`run` returns, in order.
RECORD_COLUMNS = ("epoch", "step", "train_loss", "test_loss", "test_acc", "test_ppl", "best_loss", "lr_base",
                  "wall_time", "status", "tau_max", "utilization", "memory_bytes", "memory_ratio_gpipe")

#: The keys of the state :func:`run` saves and needs to resume (``finished`` and ``threads`` may be missing: older).
_STATE_KEYS = ("model", "optimizer", "scheduler", "rng", "epoch", "batch", "losses", "records", "elapsed")

#: Samples per evaluation batch; for language models, tokens per evaluation batch.
_EVAL_BATCH = 1000
_EVAL_TOKENS = 32768


def steps_per_epoch(config: RunConfig, n_train: int) -> int:
    """``n_train // batch_size`` (the last incomplete minibatch is dropped)."""
    if n_train < config.batch_size:
        raise ConfigError(f"batch_size = {config.batch_size} exceeds the {n_train} training samples of "
                          f"{config.data!r}: lower batch_size or use more samples")
    return n_train // config.batch_size


def total_steps(config: RunConfig, n_train: int) -> int:
    """``epochs * steps_per_epoch``, capped by ``max_steps``."""
    steps = config.epochs * steps_per_epoch(config, n_train)
    return steps if config.max_steps is None else min(steps, config.max_steps)


def method_args(config: RunConfig, n_train: int) -> Dict[str, Any]:
    """The hyperparameters passed to the method: the config's, else defaults scaled to the run.

    Only keys the method accepts (``staleopt.methods.get(method).defaults``)
    appear. ``anneal_steps = max(1, first_phase // 4)`` with ``first_phase``
    the steps before the first ``step``-schedule milestone (the whole run
    otherwise), or ``5 * lr_warmup_steps`` with a linear-warmup lr schedule
    (PipeMare §3.1: "five times the linear warmup steps", its Transformer
    recipe); ``warmup_steps = anneal_steps``; ``pipelined_steps = total // 2``
    (module docstring gives the papers' reasons).
    """
    accepted = methods.hyperparameters(config.method)
    if not accepted:
        return {}
    total = total_steps(config, n_train)
    first = total
    if config.lr_schedule == "step" and config.lr_milestones:
        first = min(total, config.lr_milestones[0] * steps_per_epoch(config, n_train))
    anneal = max(1, first // 4)
    if config.lr_schedule in LR_WARMUP_SCHEDULES:
        anneal = 5 * config.lr_warmup_steps         # PipeMare §3.1: five times the linear warmup steps
    scaled = {"anneal_steps": anneal, "warmup_steps": anneal, "pipelined_steps": total // 2}
    out = {k: scaled[k] for k in accepted if k in scaled}
    out.update(config.method_overrides())
    return out


def build_optimizer(config: RunConfig, params) -> torch.optim.Optimizer:
    """The base optimizer: SGD, SGD with ``momentum``, Adam/AdamW with ``betas = (momentum, 0.999)``, or
    ``nadamw``: NAdam with ``betas = (momentum, 0.999)``, ``momentum_decay = 0.004`` and decoupled weight decay
    (the AsyncPP recipe's ``nadamw``, with ``momentum = 0.99``)."""
    kw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, **kw)
    if config.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, momentum=config.momentum, **kw)
    if config.optimizer == "nadamw":
        return torch.optim.NAdam(params, betas=(config.momentum, 0.999), momentum_decay=ASYNCPP_MOMENTUM_DECAY,
                                 decoupled_weight_decay=True, **kw)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, betas=(config.momentum, 0.999), **kw)


def lr_lambda(config: RunConfig, steps_per_epoch: int, total: int):
    """``k -> alpha_{k,base} / lr`` for the config's ``lr_schedule`` (module docstring)."""
    if config.lr_schedule == "cosine":
        return lambda k: 0.5 * (1.0 + math.cos(math.pi * min(k, total) / total))
    if config.lr_schedule == "step":
        bounds = [m * steps_per_epoch for m in config.lr_milestones]
        return lambda k: config.lr_gamma ** sum(k >= b for b in bounds)
    if config.lr_schedule in LR_WARMUP_SCHEDULES:
        # step k is the (k+1)-th update: lr (k+1)/W up to W, then lr or (Fairseq's inverse_sqrt) lr sqrt(W/(k+1))
        W, decay = config.lr_warmup_steps, config.lr_schedule == "inverse-sqrt"
        return lambda k: (k + 1) / W if k + 1 <= W else (math.sqrt(W / (k + 1)) if decay else 1.0)
    return lambda k: 1.0


def _hardware(config: RunConfig, model, pipeline: Pipeline, partition, total: int,
              args: Dict[str, Any]) -> Dict[str, float]:
    """The record's analytic columns: largest forward delay, run-average utilization, weight+optimizer memory."""
    phase = {k: min(args[k], total) for k in ("warmup_steps", "pipelined_steps") if args.get(k) is not None}
    mem = hardware.memory_report(model, pipeline, pipeline.stages, pipeline.microbatches,
                                 optimizer=config.optimizer, partition=partition)
    return {"tau_max": max(pipeline.delays[0]), "utilization": float(pipeline.utilization(total, **phase)),
            "memory_bytes": int(mem.weight_optimizer_bytes), "memory_ratio_gpipe": float(mem.ratio_to_gpipe)}


#: The target that the losses and the evaluation leave out (torch's ``ignore_index``; Hugging Face's padding label).
IGNORE_INDEX = -100


def _batch(x, y, task: str, device):
    """A batch on ``device``, integer targets (and a language model's integer tokens) as int64: torch compares a
    uint8 target with :data:`IGNORE_INDEX` as 156 (those targets were left out of the evaluation's count but not
    of its loss) and has neither min/max nor embeddings for uint16 (a GPT-2-tokenized corpus's dtype)."""
    x, y = x.to(device), y.to(device)
    if task != "regression" and not (y.is_floating_point() or y.is_complex()):
        y = y.long()
    if task == "lm" and not (x.is_floating_point() or x.is_complex()):
        x = x.long()
    return x, y


def _ce_loss(logits, y, reduction: str = "mean"):
    """Cross-entropy of logits ``(B, C)`` against class indices ``y`` of any integer dtype (int32 labels too),
    leaving out targets equal to :data:`IGNORE_INDEX`."""
    return F.cross_entropy(logits, y.long(), reduction=reduction, ignore_index=IGNORE_INDEX)


def _lm_loss(logits, y, reduction: str = "mean"):
    """Cross-entropy of next-token logits ``(B, T, V)`` against ``y`` ``(B, T)``, over the ``B T`` positions whose
    target is not :data:`IGNORE_INDEX` (padding)."""
    return _ce_loss(logits.flatten(0, 1), y.flatten(), reduction=reduction)


def _check_output(out, y, data, model: str) -> None:
    """The model's output fits the data's task: ``(B, C)`` logits for classification (``C`` = classes),
    ``(B, T, V)`` next-token logits for ``"lm"``, per sample as many values as the target for regression.
    (Else torch's losses would broadcast a ``(B, 1)`` output against ``(B,)`` targets into ``(B, B)``, or take
    ``T`` as the class axis: a wrong loss without an error.)"""
    task, C = data.task, data.num_classes
    want = {"classification": (len(y), C), "lm": (*y.shape, C)}.get(task)
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else None
    if want is not None and got == want:
        return
    if want is None and got is not None and got[:1] == tuple(y.shape[:1]) and out[0].numel() == y[0].numel():
        return
    if got is None:
        first = ("its 'logits' field" if hasattr(out, "logits") or (isinstance(out, Mapping) and "logits" in out)
                 else "its first element" if isinstance(out, (tuple, list)) and out else None)
        raise ConfigError(f"model {model!r} returns a {type(out).__name__}, but the trainer needs one tensor "
                          f"(logits for {task}, the predictions for regression)" + (
                              f": return {first} from the forward (a wrapper module whose forward returns "
                              "self.model(x).logits or self.model(x)[0])" if first else
                              ": make the forward return a tensor"))
    shown = f"shape {got}"
    need = (f"{want}" if want is not None else
            f"{len(y)} samples of {y[0].numel()} value(s) each, as the targets {tuple(y.shape)}")
    raise ConfigError(f"model {model!r} returns {shown} for a batch of {len(y)} of dataset {data.name!r} "
                      f"({task}, num_classes = {C}, targets {tuple(y.shape)}), but the loss needs {need}: build "
                      "the model with num_classes and input_shape from the data (models.get passes both), "
                      "and give a token dataset the task 'lm' (Data(..., task='lm'), or from_datasets with "
                      "integer sequence targets)")


def _refuse_labels(x, y, data, model: str) -> None:
    """Raise :class:`DataError` when a batch holds a class, target or (``"lm"``, integer ``x``) input token
    outside ``[0, num_classes)``; called when the forward or the loss failed, where torch says only
    "index out of range in self" or "Target 7 is out of bounds". Returns when the batch is in range (the
    failure was something else)."""
    if data.task not in ("classification", "lm"):
        return
    C, found = data.num_classes, []
    for what, t in (("target", y), ("input token", x if data.task == "lm" else None)):
        if t is None or t.is_floating_point() or t.is_complex() or not t.numel():
            continue
        t = t[t != IGNORE_INDEX] if what == "target" else t
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= C):
            found.append(f"{what}s from {int(t.min())} to {int(t.max())}")
    if found:
        raise DataError(f"dataset {data.name!r} ({data.task}) declares num_classes = {C}, but a batch holds "
                        f"{' and '.join(found)}, outside [0, {C}) (model {model!r} is built for {C} classes): "
                        "declare num_classes as the largest label or token + 1, or leave it out "
                        f"(staleopt.data.from_datasets reads it off the samples); only {IGNORE_INDEX} (padding) "
                        "may fall outside")


def _forward_loss(model, x, y, data, name: str, criterion):
    """``(model(x), criterion(model(x), y))``, the output checked against the data (:func:`_check_output`)
    and a label outside the vocabulary named (:func:`_refuse_labels`) instead of torch's bare IndexError."""
    try:
        out = model(x)
        _check_output(out, y, data, name)
        return out, criterion(out, y)
    except (IndexError, RuntimeError) as e:
        try:
            _refuse_labels(x, y, data, name)
        except DataError as refused:
            raise refused from e
        if data.task != "lm" and not x.is_floating_point() and "type" in str(e):
            raise DataError(f"model {name!r} failed on the {x.dtype} inputs of dataset {data.name!r} ({e}): a model "
                            "that takes numbers needs floating inputs: convert them in the dataset (uint8 images: "
                            "x.float() / 255, or torchvision.transforms.ToTensor())") from e
        raise


def _mse_loss(out, y, reduction: str = "mean"):
    """Mean squared error of each sample's values, flattened (an output of shape ``(B, 1)`` against scalar
    targets ``(B,)``)."""
    return F.mse_loss(out.reshape(len(out), -1), y.reshape(len(y), -1), reduction=reduction)


def loss_function(task: str):
    """The training loss of ``task``, ``loss(out, y, reduction="mean")``: cross-entropy for ``"classification"``,
    per position for ``"lm"`` (targets equal to :data:`IGNORE_INDEX` left out), else mean squared error."""
    return {"classification": _ce_loss, "lm": _lm_loss}.get(task, _mse_loss)


def _ppl(loss: float) -> float:
    """``exp(loss)``; ``inf`` beyond a float's range and for a NaN loss (weights that overflowed: the worst
    perplexity, :mod:`staleopt.stats`)."""
    return math.exp(loss) if loss < 709.0 else math.inf


@torch.no_grad()
def _evaluate(model, data, device, name: str) -> Dict[str, float]:
    """``test_loss`` (mean per sample; per token for ``"lm"``), ``test_acc`` (classification: accuracy;
    lm: next-token accuracy; regression: NaN) and ``test_ppl`` (lm: ``exp(test_loss)``, ``inf`` beyond a
    float's range or for a NaN loss; else NaN) of model ``name`` on ``data``'s test split; targets equal to
    :data:`IGNORE_INDEX` (padding) count in none of them, as in the training loss."""
    dataset, task = data.test, data.task
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    size = max(1, _EVAL_TOKENS // torch.as_tensor(dataset[0][1]).numel()) if task == "lm" else _EVAL_BATCH
    summed = functools.partial(loss_function(task), reduction="sum")  # divided once, by the kept targets, at end
    for x, y in datasets.batches(dataset, size):
        x, y = _batch(x, y, task, device)
        out, loss = _forward_loss(model, x, y, data, name, summed)
        if task in ("classification", "lm"):
            logits, target = (out, y) if task == "classification" else (out.flatten(0, 1), y.flatten())
            kept = target != IGNORE_INDEX
            loss_sum += loss.item()
            correct += (logits.argmax(-1)[kept] == target[kept]).sum().item()
            n += int(kept.sum().item())
        else:
            loss_sum += loss.item() / out[0].numel()
            n += len(x)
    model.train()
    if n == 0:
        raise DataError(f"every target of the test split is {IGNORE_INDEX} (the padding label the losses leave "
                        "out): nothing to evaluate; check the test targets")
    loss = loss_sum / n
    return {"test_loss": loss, "test_acc": correct / n if task in ("classification", "lm") else math.nan,
            "test_ppl": _ppl(loss) if task == "lm" else math.nan}


def _rng_devices(device: torch.device):
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []


@contextlib.contextmanager
def _fork_host_rngs(seed: int) -> Iterator[None]:
    """Python's ``random`` and numpy's global RNG seeded with ``seed`` inside, the caller's states put back
    after (as ``torch.random.fork_rng`` does for torch's)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        random.seed(seed)
        # numpy takes a seed below 2**32, or a list of such words (a larger seed: its 32-bit words)
        np.random.seed(seed if seed < 2 ** 32 else [seed >> k & 0xFFFFFFFF for k in range(0, seed.bit_length(), 32)])
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def run(config: Union[RunConfig, Mapping[str, Any]], progress: bool = False,
        checkpoint: Optional[ckpt.Checkpoint] = None,
        on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None) -> pd.DataFrame:
    """Train ``config`` and return one record per epoch (columns :data:`RECORD_COLUMNS`).

    With a :class:`~staleopt.checkpoint.Checkpoint` the run saves itself at every
    epoch end (and every ``checkpoint.every`` steps), continues from the saved
    state when the file exists, and deletes it at the end (unless
    ``checkpoint.keep``, or a ``checkpoint.done`` marker that the caller writes
    first with :meth:`~staleopt.checkpoint.Checkpoint.complete`): the records
    equal an uninterrupted run's except
    ``wall_time``, which adds up the training seconds of every launch.
    ``records.attrs["resumed_at_step"]`` is the step it continued from (0: from scratch).
    A kept final checkpoint says the run is over (``finished``): resuming it trains nothing.
    A run resumed under another torch thread count than it was saved with trains under the saved count, with a
    warning; ``records.attrs["threads"]`` is the count the run trained under.
    ``progress`` shows a bar over the run's optimizer steps with its ETA and the running loss.
    ``on_epoch(record)`` is called with each epoch's record as the epoch ends (``staleopt train``
    prints it then).
    """
    config = config if isinstance(config, RunConfig) else RunConfig.from_dict(dict(config))
    config = config.resolve()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r}: this machine has no CUDA device that torch can use; train on "
                          "'cpu' (--device cpu) or on a machine with a GPU")
    with torch.random.fork_rng(devices=_rng_devices(device)), _fork_host_rngs(config.seed):
        torch.manual_seed(config.seed)
        return _train(config, device, progress, checkpoint, on_epoch)


def _warn_padding_batch() -> None:
    warnings.warn("a training minibatch whose every target is -100 (padding) was skipped: its loss is 0/0 and it "
                  "has nothing to learn from (no step, no record); pad less or drop such samples", stacklevel=3)


def _train(config: RunConfig, device: torch.device, progress: bool, checkpoint, on_epoch=None) -> pd.DataFrame:
    data = datasets.load(config.data, **config.data_kwargs).to(device)
    models.check_task(config.model, data.task, f"dataset {config.data!r}")
    model = models.get(config.model, seed=config.seed, num_classes=data.num_classes,
                       input_shape=data.input_shape, **config.model_kwargs).to(device)
    spe = steps_per_epoch(config, len(data.train))
    total = total_steps(config, len(data.train))
    args = method_args(config, len(data.train))
    if args.get("warmup_steps") is not None and args["warmup_steps"] >= total:
        warnings.warn(f"{config.method}'s synchronous warmup ({args['warmup_steps']} steps"
                      + (f", 5 x lr_warmup_steps = {config.lr_warmup_steps}" if config.lr_schedule in
                         LR_WARMUP_SCHEDULES and "warmup_steps" not in config.method_overrides() else "")
                      + f") covers the whole run of {total} steps: it trains as GPipe, no step is pipelined; set "
                      "warmup_steps below the run's length or train longer", stacklevel=2)
    pipeline = config.pipeline(**args)
    if config.unit_order == "execution":  # (the first training microbatch orders the units)
        first = datasets.first_batch(data.train, config.batch_size // config.microbatches).to(device)
        stages, strategy = partition_model(model, config.stages, config.partition, example_input=first), None
    else:
        stages, strategy = config.stages, config.partition
    opt = PipelineOptimizer(model, build_optimizer(config, model.parameters()), stages=stages,
                            schedule=pipeline.schedule, corrections=pipeline.corrections,
                            microbatches=config.microbatches, seed=config.seed, partition=strategy)
    if opt.schedule.segments(opt.partition.num_stages):  # PipeMare Recompute: checkpoint the segments
        model.forward = functools.partial(segments.checkpoint_segments, opt, models.steps(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config, spe, total))
    analytic = _hardware(config, model, pipeline, opt.partition, total, args)
    criterion = loss_function(data.task)
    best_loss = math.nan if data.best_loss is None else float(data.best_loss)
    order = torch.Generator().manual_seed(config.seed)
    bound = config.divergence_loss

    records, first_epoch, done_batches, losses, elapsed = [], 1, 0, [], 0.0
    saved = checkpoint.load(config.run_id()) if checkpoint is not None else None
    threads = torch.get_num_threads()
    run_threads = threads if saved is None else saved.get("threads", threads)  # (not saved before: as it was)
    if saved is not None:
        missing = [k for k in _STATE_KEYS if k not in saved]
        if missing:
            raise CheckpointError(f"{checkpoint.path} is not a checkpoint of staleopt.train.run (its state lacks "
                                  f"{missing}): another train function saved it. Resume it with that function, "
                                  "or delete the file to start the run over")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        ckpt.set_rng_state(saved["rng"], device, order=order)
        records, first_epoch, done_batches = saved["records"], saved["epoch"], saved["batch"]
        losses, elapsed = saved["losses"], saved["elapsed"]
        if saved.get("finished"):  # the final state of a run that is over: nothing left to train
            first_epoch = config.epochs + 1
        elif run_threads != threads:
            warnings.warn(f"{checkpoint.path} was saved under {run_threads} torch thread(s), this process has "
                          f"{threads}; torch's float results depend on the thread count, so the run continues under "
                          f"{run_threads} (then {threads} again). Resume with {run_threads} threads (staleopt sweep "
                          f"--worker-threads {run_threads}, torch.set_num_threads({run_threads})) to avoid this",
                          stacklevel=3)
            torch.set_num_threads(run_threads)
    resumed_at = opt.step_count

    def save(epoch, batch, epoch_losses, order_state, finished=False):
        checkpoint.save({"run_id": config.run_id(), "config": config.to_dict(), "model": model.state_dict(),
                         "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
                         "rng": ckpt.rng_state(device, order=order_state), "epoch": epoch, "batch": batch,
                         "losses": list(epoch_losses), "records": list(records),
                         "elapsed": time.perf_counter() - start, "finished": finished, "threads": run_threads})

    model.train()
    start = time.perf_counter() - elapsed
    bar = tqdm(total=total, initial=resumed_at, desc=f"{config.run_id()} {config.method} P={config.stages}",
               unit="step", disable=not progress)
    try:
        for epoch in range(first_epoch, config.epochs + 1):
            epoch_order, status = order.get_state(), "ok"  # a resumed epoch redraws its order from here
            for x, y in datasets.batches(data.train, config.batch_size, shuffle=True, generator=order,
                                         drop_last=True, start=done_batches):
                if opt.step_count >= total:
                    break
                x, y = _batch(x, y, data.task, device)
                if data.task != "regression" and not bool((y != IGNORE_INDEX).any()):
                    # every target is padding (-100): the loss is 0/0, nothing to learn and no divergence; the
                    # pipeline sees no minibatch (as for a batch a trainer skips)
                    done_batches += 1
                    _warn_padding_batch()
                    continue
                opt.zero_grad()
                _, loss = _forward_loss(model, x, y, data, config.model, criterion)
                value = loss.item()
                losses.append(value)
                if not math.isfinite(value) or (bound is not None and value > bound):
                    if opt.step_count == 0 and not math.isfinite(value):  # no update ran: the data, not the method
                        bad = [what for what, t in (("inputs", x), ("targets", y))
                               if t.is_floating_point() and not bool(torch.isfinite(t).all())]
                        raise DataError(f"the first training loss is {value} before any update, so the run would "
                                        "be recorded as diverged: " + (f"the first batch's {' and '.join(bad)} hold "
                                        "NaN or inf; clean or drop those samples" if bad else "the model's initial "
                                        "output or the loss is not finite on the first batch (check the data's "
                                        "scale and the loss)"))
                    if opt.step_count == 0 and math.isfinite(value):  # no update ran: the scale, not the method
                        raise ConfigError(f"the first training loss, {value:.4g}, is already above divergence_loss ="
                                          f" {bound:g} before any update, so every run would be recorded as "
                                          "diverged: set divergence_loss above your loss's scale (a regression's "
                                          "mean squared error grows with its targets' scale), or None to stop only "
                                          "at a non-finite loss")
                    status = "diverged"
                    break
                loss.backward()
                try:
                    opt.step()
                except RuntimeError as e:  # a step size beyond the weights' dtype (lr = 1e308): the run diverged
                    if "without overflow" not in str(e):
                        raise
                    status = "diverged"
                    break
                scheduler.step()
                bar.update(1)
                if progress and opt.step_count % 10 == 0:
                    bar.set_postfix(epoch=f"{epoch}/{config.epochs}", loss=f"{value:.3g}", refresh=False)
                done_batches += 1
                if checkpoint is not None and checkpoint.due(opt.step_count):
                    save(epoch, done_batches, losses, epoch_order)
            evaluation = _evaluate(model, data, device, config.model)
            # w_t diverged ahead of the stale training loss (or its perplexity overflowed: a loss >= 709 nats)
            if not (math.isfinite(evaluation["test_loss"]) and evaluation["test_ppl"] != math.inf):
                status = "diverged"
            records.append({"epoch": epoch, "step": opt.step_count,
                            "train_loss": sum(losses) / len(losses) if losses else math.nan,
                            **evaluation, "best_loss": best_loss,
                            "lr_base": opt.param_groups[0]["lr"], "wall_time": time.perf_counter() - start,
                            "status": status, **analytic})
            losses, done_batches = [], 0
            if on_epoch is not None:
                on_epoch(dict(records[-1]))
            shown = ({"ppl": f"{records[-1]['test_ppl']:.4g}"} if data.task == "lm"
                     else {"acc": f"{records[-1]['test_acc']:.3f}"})
            bar.set_postfix(epoch=f"{epoch}/{config.epochs}", loss=f"{records[-1]['train_loss']:.3g}", **shown)
            finished = status == "diverged" or opt.step_count >= total or epoch == config.epochs
            if checkpoint is not None:  # the checkpoint first: records on disk always have one (or a done marker)
                if not finished or checkpoint.keep:  # (a kept checkpoint holds the final state)
                    save(epoch + 1, 0, [], order.get_state(), finished)
                checkpoint.write_records(pd.DataFrame(records, columns=list(RECORD_COLUMNS)))
            if finished:
                break
    finally:
        bar.close()
        opt.remove_hooks()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    if checkpoint is not None:
        checkpoint.finish()
    out = pd.DataFrame(records, columns=list(RECORD_COLUMNS))
    out.attrs["resumed_at_step"] = resumed_at
    out.attrs["threads"] = run_threads
    return out
