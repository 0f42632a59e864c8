"""Datasets by name: ``load(name, **kwargs) -> Data`` with train/test sets, shapes and task.

==========  ==============  ===========  =======================================================
name        input_shape     outputs      source
==========  ==============  ===========  =======================================================
mnist1d     (1, 40)         10 classes   generated locally by the ``mnist1d`` package
                                         (Greydanus 2020), cached under the user cache dir
cifar10     (3, 32, 32)     10 classes   torchvision files under ``root``; train augmentation:
                                         random crop 32 (pad 4) + horizontal flip
cifar100    (3, 32, 32)     100 classes  as cifar10
synthetic   any (1, 40)     any (10)     Gaussian classes or a noisy linear regression, for tests
text-*      (T,) tokens     vocabulary   language modelling (task ``"lm"``): ``text-markov``
                                         generated locally with a known best loss; TinyShakespeare,
                                         WikiText-2/103 (raw) and enwik8 read from their files
==========  ==============  ===========  =======================================================

Everything is a deterministic function of the arguments (MNIST-1D and
synthetic data are generated from their own ``seed``; neither touches the
global RNGs). CIFAR images stay uint8 tensors (:class:`ImageTensors`, moved to
the training GPU by :meth:`Data.to`); :func:`batches` crops, flips and
normalizes a whole minibatch at once with tensor operations, drawing the
augmentation from the same generator as the data order, so a training loop is
deterministic given that generator.

CIFAR files are looked up in ``root`` (default ``$STALEOPT_DATA`` or
``<cache>/data``, ``<cache>`` = ``$XDG_CACHE_HOME/staleopt`` or
``~/.cache/staleopt``), in torchvision's layout
(``root/cifar-10-batches-py/data_batch_1`` ...), and each file's md5 is
checked against torchvision's list of the official files before it is read;
``verify=False`` skips only the md5s, which loads a re-packed or subsampled
copy (the tests write one). The files are pickles: they are read by a
restricted unpickler that builds only dicts, lists, strings, numbers and numpy
arrays (:func:`read_cifar_batch`), never ``pickle.load``, so a planted file
cannot run code, verified or not (it is refused with a
:class:`~staleopt.errors.DataError`).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import numbers
import os
import pickle
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from . import registry
from .errors import ConfigError, DataError
from .validate import check_int

__all__ = ["Data", "ImageTensors", "TokenWindows", "TEXT_CORPORA", "load", "task", "names", "options", "batches", "cache_dir", "data_dir", "CIFAR_FOLDERS",
           "read_cifar_batch", "register", "registered", "from_datasets", "shape", "first_batch"]

#: torchvision's folder name for each CIFAR dataset, under ``root``.
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


@dataclass
class Data:
    """A dataset split in two, with what a model and a loss need to know about it.

    ``num_classes`` is the model's output size: the number of classes for
    ``task == "classification"`` (targets are int64 class indices), the
    number of regression targets for ``task == "regression"`` (float targets
    of shape ``(num_classes,)``), and the vocabulary size for ``task == "lm"``
    (language modelling: samples are int64 token windows ``x`` of shape
    ``input_shape = (T,)`` and their next tokens ``y``, :class:`TokenWindows`).

    ``best_loss``: the smallest expected test loss any model can reach, in nats
    per predicted token, when the data's source is known (``text-markov``);
    ``None`` otherwise.
    """

    name: str
    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: Tuple[int, ...]
    task: str
    info: Dict[str, Any] = field(default_factory=dict)
    best_loss: Optional[float] = None

    def to(self, device) -> "Data":
        """The same data with its tensors on ``device`` when that is not the CPU (a GPU then reads, augments
        and normalizes batches without a copy from the host); unchanged on the CPU."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        return dataclasses.replace(self, train=_to(self.train, device), test=_to(self.test, device))


def _to(dataset: Dataset, device: torch.device) -> Dataset:
    if isinstance(dataset, (ImageTensors, TokenWindows)):
        return dataset.to(device)
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t.to(device) for t in dataset.tensors))
    return dataset


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/staleopt``, else ``~/.cache/staleopt``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "staleopt"


def data_dir() -> Path:
    """Default root for downloaded datasets: ``$STALEOPT_DATA``, else ``cache_dir()/data``."""
    env = os.environ.get("STALEOPT_DATA")
    return Path(env) if env else cache_dir() / "data"


def _check_kwargs(name: str, given: Dict[str, Any], allowed) -> None:
    bad = sorted(set(given) - set(allowed))
    if bad:
        raise ConfigError(f"data {name!r} got unknown argument(s) {bad}; allowed: {sorted(allowed)}")


# ---------------------------------------------------------------------------------------------
# MNIST-1D

def _mnist1d_defaults() -> Dict[str, Any]:
    from mnist1d.data import get_dataset_args
    args = get_dataset_args(as_dict=True)
    args.pop("url")
    return args


def _atomic_save_npz(path: Path, **arrays) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def _mnist1d(root=None, download=False, cache=True, **kw) -> Data:
    """MNIST-1D from ``mnist1d.data.make_dataset`` with the package's defaults overridden by ``kw``.

    Generation seeds numpy's and Python's global RNGs; their states are
    restored afterwards. Arrays are cached as ``cache_dir()/mnist1d-<hash>.npz``
    keyed by the full argument dict.
    """
    from mnist1d.data import make_dataset
    from mnist1d.utils import ObjectView

    args = _mnist1d_defaults()
    args.update(kw)
    check_int("mnist1d num_samples", args["num_samples"], 20)
    if args["num_samples"] % 10:  # (mnist1d makes num_samples // 10 per class: 29 gave 20)
        raise ConfigError(f"mnist1d num_samples = {args['num_samples']} must be a multiple of 10 (it makes "
                          f"num_samples // 10 samples of each of its 10 classes): use {args['num_samples'] // 10 * 10}"
                          f" or {args['num_samples'] // 10 * 10 + 10}")
    _check_split("mnist1d", args["train_split"], args["num_samples"])
    key = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"mnist1d-{key}.npz"
    arrays = None
    if cache and path.exists():
        try:
            with np.load(path) as f:
                arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test")}
        except (OSError, ValueError, KeyError):
            arrays = None  # a corrupt cache file is regenerated
    if arrays is None:
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            d = make_dataset(ObjectView(dict(args)))
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = {k: d[k] for k in ("x", "y", "x_test", "y_test")}
        if cache:
            _atomic_save_npz(path, **arrays)

    def tensors(x, y):
        return TensorDataset(torch.as_tensor(x, dtype=torch.float32).unsqueeze(1),
                             torch.as_tensor(y, dtype=torch.int64))

    length = int(args["final_seq_length"])
    return Data("mnist1d", tensors(arrays["x"], arrays["y"]), tensors(arrays["x_test"], arrays["y_test"]),
                num_classes=10, input_shape=(1, length), task="classification",
                info={"args": args, "cache": str(path) if cache else None})


# ---------------------------------------------------------------------------------------------
# CIFAR

class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that builds plain containers, strings, numbers and numpy arrays only: every other global
    (a function a crafted pickle would call) is refused."""

    SAFE = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
            ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}  # (pickle protocol 5)

    def find_class(self, module, name):
        if (module, name) not in self.SAFE:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR file never holds")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> Dict[str, Any]:
    """One CIFAR python-version file (a pickled dict) read by :class:`_ArrayUnpickler`: a file that holds
    anything else (a pickle that would run code) is a :class:`~staleopt.errors.DataError` naming it."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise DataError(f"{path} is not a CIFAR data file ({e}): refused without running anything it holds. "
                        "Delete the folder and download the dataset again (--download)") from None
    if not isinstance(batch, dict) or not isinstance(batch.get("data"), np.ndarray) or \
            batch["data"].dtype != np.uint8 or batch["data"].ndim != 2 or batch["data"].shape[1] != 3072:
        raise DataError(f"{path} is not a CIFAR data file (a dict whose 'data' is an N x 3072 uint8 array); "
                        "delete the folder and download the dataset again (--download)")
    return batch


def _cifar_labels(path: Path, batch: Dict[str, Any], key: str, classes: int) -> List[int]:
    """The labels of one CIFAR file (``key``: ``labels``, or CIFAR-100's ``fine_labels``): one int in ``0..classes-1``
    per image of the file, else a :class:`~staleopt.errors.DataError` naming it (a re-packed copy read with
    ``verify=False`` whose labels do not match its images would otherwise train on shifted labels)."""
    labels = batch.get(key)
    if labels is None:
        raise DataError(f"{path} has no {key!r} entry (its keys: {sorted(map(str, batch))}): not a "
                        f"{'CIFAR-100' if classes == 100 else 'CIFAR-10'} file; delete the folder and download the "
                        "dataset again (--download)")
    values = list(labels)
    if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in values):
        raise DataError(f"{path}: its {key!r} are not all integers; delete the folder and download the dataset "
                        "again (--download)")
    if len(values) != len(batch["data"]):
        raise DataError(f"{path} holds {len(batch['data'])} images but {len(values)} {key!r}: its labels would "
                        "not match its images; delete the folder and download the dataset again (--download)")
    bad = [int(v) for v in values if not 0 <= v < classes]
    if bad:
        raise DataError(f"{path}: {key!r} outside 0..{classes - 1} (e.g. {bad[0]}); delete the folder and "
                        "download the dataset again (--download)")
    return [int(v) for v in values]


def _channel_stats(images: np.ndarray) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 ``N x H x W x C`` images, scaled to [0, 1].

    From each channel's histogram of the 256 values: exact, and no float copy of the images.
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(images.shape[-1]):
        counts = np.bincount(images[..., c].ravel(), minlength=256).astype(np.float64)
        n = counts.sum()
        mean = (values * counts).sum() / n
        means.append(float(mean))
        stds.append(float(np.sqrt(((values - mean) ** 2 * counts).sum() / n)))
    return tuple(means), tuple(stds)


class ImageTensors(Dataset):
    """Images kept as one uint8 tensor ``N x C x H x W``; each batch is augmented and normalized at once.

    A batch of indices ``idx`` becomes ``(x, y)`` with
    ``x = (A(images[idx]) / 255 - mean) / std`` in float32 (``ToTensor`` then
    ``Normalize``, operation for operation) and ``y = targets[idx]``. With
    ``augment``, ``A`` is the standard ResNet recipe (He et al. 2016 §4.2):
    zero-pad ``padding`` pixels on each side, crop ``H x W`` at offsets
    ``(dy, dx)`` drawn uniformly from ``{0, ..., 2 padding}^2``, then flip
    left-right with probability 1/2: torchvision's ``RandomCrop(H,
    padding=padding)`` followed by ``RandomHorizontalFlip()``, each sample drawn
    independently. Crop and flip are one gather of the padded batch; the random
    draws come from the generator :func:`batches` is given (:meth:`draw`).

    :meth:`to` moves the images to a device (a GPU: augmentation runs there);
    indexing one sample (``dataset[i]``) augments it with torch's global RNG.
    """

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, mean, std, augment: bool = False,
                 padding: int = 4):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise DataError(f"images must be a uint8 tensor N x C x H x W, got {images.dtype} of shape "
                            f"{tuple(images.shape)}")
        if len(targets) != len(images):
            raise DataError(f"{len(images)} images but {len(targets)} targets")
        check_int("padding", padding, 0, why="pixels")
        self.images, self.targets = images, targets
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.augment, self.padding = bool(augment), padding
        c = images.shape[1]
        if len(self.mean) != c or len(self.std) != c:
            raise DataError(f"mean and std need one value per channel ({c}), got {self.mean} and {self.std}")
        self._mean = torch.tensor(self.mean, device=images.device).view(1, c, 1, 1)
        self._std = torch.tensor(self.std, device=images.device).view(1, c, 1, 1)

    def __len__(self) -> int:
        return len(self.images)

    def __repr__(self) -> str:
        return (f"ImageTensors({len(self)} x {tuple(self.images.shape[1:])} uint8 on {self.images.device}, "
                f"augment={self.augment})")

    def __getitem__(self, i: int):
        x, y = self.take(torch.tensor([int(i)]), self.draw(1))
        return x[0], int(y[0])

    def to(self, device) -> "ImageTensors":
        """The same dataset with its images and targets on ``device``."""
        return ImageTensors(self.images.to(device), self.targets.to(device), self.mean, self.std,
                            self.augment, self.padding)

    def draw(self, n: int, generator: Optional[torch.Generator] = None) -> Optional[torch.Tensor]:
        """The augmentation of ``n`` samples, ``n x 3`` int64 rows ``(dy, dx, flip)``; ``None`` without augment.

        Draws ``randint(0, 2 padding + 1, (n, 2))`` for the crop offsets, then
        ``rand(n) < 0.5`` for the flips, from ``generator`` (torch's global RNG
        when ``None``), on the CPU whatever the images' device.
        """
        if not self.augment:
            return None
        offsets = torch.randint(0, 2 * self.padding + 1, (n, 2), generator=generator)
        flips = torch.rand(n, generator=generator) < 0.5
        return torch.cat([offsets, flips.long()[:, None]], dim=1)

    def take(self, idx: torch.Tensor, params: Optional[torch.Tensor] = None):
        """``(x, y)`` of samples ``idx``, augmented by ``params`` (rows of :meth:`draw`, one per index)."""
        dev = self.images.device
        idx = idx.to(dev)
        images = self.images[idx]
        if params is not None:
            images = self._crop_flip(images, params.to(dev))
        x = images.float().div_(255).sub_(self._mean).div_(self._std)
        return x, self.targets[idx]

    def _crop_flip(self, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """Pad by ``padding`` zeros, crop at ``(dy, dx)`` and flip where asked, as one gather.

        Output pixel ``(r, c)`` of sample ``b`` is padded pixel
        ``(dy_b + r, dx_b + c)``, or ``(dy_b + r, dx_b + W - 1 - c)`` when flipped.
        """
        b, ch, h, w = images.shape
        p = self.padding
        padded = torch.nn.functional.pad(images, (p, p, p, p))
        pw = w + 2 * p
        r = torch.arange(h, device=images.device)
        c = torch.arange(w, device=images.device)
        cols = torch.where(params[:, 2:3].bool(), (w - 1 - c)[None], c[None]) + params[:, 1:2]  # b x w
        rows = r[None] + params[:, 0:1]  # b x h
        flat = (rows[:, :, None] * pw + cols[:, None, :]).view(b, 1, h * w).expand(b, ch, h * w)
        return padded.view(b, ch, -1).gather(2, flat).view(b, ch, h, w)


def _cifar(name: str, root=None, download=False, augment=True, verify=True) -> Data:
    """CIFAR-10/100 from torchvision's files (md5-checked unless ``verify=False``; read by
    :func:`read_cifar_batch`), kept as uint8 :class:`ImageTensors` normalized by the training set's own
    per-channel mean and std; the training set augmented by random crop (pad 4) and flip."""
    import torchvision
    from torchvision.datasets.utils import check_integrity, download_and_extract_archive

    for option, value in (("augment", augment), ("verify", verify), ("download", download)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} {option} must be true or false, got {value!r} ({type(value).__name__}; a "
                              "quoted 'false' in JSON or TOML is a string)")
    root = Path(root) if root is not None else data_dir()
    base = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    folder = root / CIFAR_FOLDERS[name]
    files = base.train_list + base.test_list
    missing = [f for f, _ in files if not (folder / f).is_file()]
    if missing and not download:
        raise DataError(
            f"{name} not found: {folder} lacks {missing}. Put the extracted python version of "
            f"the dataset there ({base.url} unpacks to {CIFAR_FOLDERS[name]}/), set $STALEOPT_DATA "
            f"to the folder that holds it (or pass root= in Python), or pass download=True (--download on the "
            "command line).")
    if missing:
        try:
            download_and_extract_archive(base.url, str(root), filename=base.filename, md5=base.tgz_md5)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{name} could not be downloaded to {root} ({e}); download "
                            f"{base.url} by hand and extract it into {root}.") from e
    if verify:
        bad = [f for f, md5 in files if not check_integrity(str(folder / f), md5)]
        if bad:
            raise DataError(f"{name} under {folder}: {bad} are not the official files (their md5s differ). "
                            "Delete the folder and pass download=True (--download). Only for a copy you "
                            "re-packed or subsampled yourself, pass verify=False: the md5s are then skipped "
                            "(the files are still read without running anything they hold).")

    classes = 100 if name == "cifar100" else 10
    key = "fine_labels" if name == "cifar100" else "labels"

    def read(split):  # N x 3072 channel-major rows -> N x H x W x C, as torchvision keeps them
        batches = [read_cifar_batch(folder / f) for f, _ in split]
        labels = [_cifar_labels(folder / f, b, key, classes) for (f, _), b in zip(split, batches)]
        images = np.vstack([b["data"] for b in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(images), sum(labels, [])

    train, test = read(base.train_list), read(base.test_list)
    mean, std = _channel_stats(train[0])

    def tensors(split, aug):
        images = torch.from_numpy(split[0]).permute(0, 3, 1, 2).contiguous()
        return ImageTensors(images, torch.as_tensor(split[1], dtype=torch.int64), mean, std, augment=aug)

    return Data(name, tensors(train, augment), tensors(test, False), num_classes=classes,
                input_shape=(3, 32, 32), task="classification",
                info={"root": str(root), "mean": mean, "std": std, "augment": augment, "verify": verify})


# ---------------------------------------------------------------------------------------------
# synthetic

def _check_split(dataset: str, split, num_samples: int) -> None:
    """``train_split`` a number that leaves samples on both sides of the split of ``num_samples``."""
    if isinstance(split, bool) or not isinstance(split, numbers.Real) or \
            not 1 <= int(num_samples * split) < num_samples:
        raise ConfigError(f"{dataset} train_split must lie in (0, 1) and leave samples on both sides of the split of "
                          f"num_samples={num_samples}, got {split!r}")


def _check_synthetic_task(task) -> None:
    if task not in ("classification", "regression"):
        raise ConfigError(f"synthetic task must be 'classification' or 'regression', got {task!r}")


def _synthetic(root=None, download=False, task="classification", num_samples=1000, input_shape=(1, 40),
               num_classes=10, separation=1.0, noise=1.0, train_split=0.8, seed=0) -> Data:
    """Gaussian data from a private generator seeded by ``seed``.

    classification: class means ``mu_c ~ N(0, separation^2 I)``, labels uniform,
    ``x = mu_y + noise * eps``. regression: ``x ~ N(0, I)``,
    ``y = W x / sqrt(d) + noise * eps`` with ``W ~ N(0, 1)`` of shape
    ``(num_classes, d)``, ``d = prod(input_shape)``.
    """
    _check_synthetic_task(task)
    if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, (tuple, list)) or not input_shape:
        raise ConfigError(f"synthetic input_shape must be a non-empty list of sizes, got {input_shape!r}")
    input_shape = tuple(check_int("synthetic input_shape size", s, 1) for s in input_shape)  # ([1, 40.7] was 40)
    check_int("synthetic num_classes", num_classes, 1)
    check_int("synthetic num_samples", num_samples, 2)
    check_int("synthetic seed", seed)
    _check_split("synthetic", train_split, num_samples)
    for name, v in (("separation", separation), ("noise", noise)):  # (-1 gave the data of 1: another run id)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"synthetic {name} is a standard deviation, a finite number >= 0; got {v!r}")
    g = torch.Generator().manual_seed(int(seed))
    d = int(np.prod(input_shape))
    if task == "classification":
        means = separation * torch.randn(num_classes, d, generator=g, dtype=torch.float64)
        y = torch.randint(num_classes, (num_samples,), generator=g)
        x = means[y] + noise * torch.randn(num_samples, d, generator=g, dtype=torch.float64)
    else:
        w = torch.randn(num_classes, d, generator=g, dtype=torch.float64)
        x = torch.randn(num_samples, d, generator=g, dtype=torch.float64)
        y = (x @ w.T / d ** 0.5 + noise * torch.randn(num_samples, num_classes, generator=g,
                                                      dtype=torch.float64)).float()
    x = x.float().reshape(num_samples, *input_shape)
    n_train = int(num_samples * train_split)
    return Data("synthetic", TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:]),
                num_classes=int(num_classes), input_shape=input_shape, task=task,
                info={"seed": int(seed), "separation": separation, "noise": noise})


# ---------------------------------------------------------------------------------------------
# text: language modelling (task "lm")

class TokenWindows(Dataset):
    """The windows of a token sequence: sample ``i`` is ``x = tokens[s:s+T]``, ``y = tokens[s+1:s+T+1]``
    with ``s = i * stride`` (int64, ``T = context``), every window that fits.

    ``tokens`` is kept as given (uint8 bytes, int32 characters; a numpy array, e.g. a tokenized corpus's
    ``np.memmap`` of uint16, or a list becomes a tensor by ``torch.as_tensor``); a batch is gathered at once by
    :meth:`take` and widened to int64 then. ``stride = T`` (default) cuts the sequence into
    non-overlapping windows, so one pass over them predicts every token but the first once.
    """

    def __init__(self, tokens: torch.Tensor, context: int, stride: Optional[int] = None):
        check_int("context", context, 1, why="tokens per window")
        stride = check_int("stride", context if stride is None else stride, 1, why="tokens between windows")
        if not isinstance(tokens, torch.Tensor):
            try:
                tokens = torch.as_tensor(tokens)
            except (TypeError, ValueError, RuntimeError) as e:
                raise DataError(f"tokens must be a 1-D sequence of integer token ids (a tensor, numpy array or "
                                f"list), got {type(tokens).__name__} ({e})") from None
        if tokens.dim() != 1 or tokens.dtype.is_floating_point:
            raise DataError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        self.tokens, self.context, self.stride = tokens, int(context), int(stride)
        self._span = torch.arange(self.context + 1, device=tokens.device)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - self.context - 1) // self.stride + 1)

    def __repr__(self) -> str:
        return (f"TokenWindows({len(self)} windows of {self.context} of {len(self.tokens)} {self.tokens.dtype} "
                f"tokens, stride {self.stride})")

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        x, y = self.take(torch.tensor([int(i) % len(self)]))
        return x[0], y[0]

    def take(self, idx: torch.Tensor):
        """``(x, y)`` of windows ``idx``: two int64 ``len(idx) x T`` tensors."""
        rows = self.tokens[(idx.to(self.tokens.device) * self.stride)[:, None] + self._span].long()
        return rows[:, :-1], rows[:, 1:]

    def to(self, device) -> "TokenWindows":
        """The same windows with the tokens on ``device``."""
        return TokenWindows(self.tokens.to(device), self.context, self.stride)


def _markov_chain(vocab_size: int, order: int, support: int, smoothing: float, g: torch.Generator):
    """A random order-``k`` Markov source: for each state (the last ``k`` tokens, ``s = sum_j x_j V^(k-1-j)``,
    oldest first) a next-token distribution ``(1 - eps) q_s + eps / V``, ``q_s`` Dirichlet(1) weights on
    ``support`` tokens drawn without replacement; and its stationary distribution ``pi`` over states
    (power iteration to 1e-14 in L1; ``eps > 0`` makes the chain irreducible and aperiodic)."""
    states = vocab_size ** order
    chosen = torch.rand(states, vocab_size, generator=g, dtype=torch.float64).argsort(1)[:, :support]
    weights = -torch.log1p(-torch.rand(states, support, generator=g, dtype=torch.float64))  # Exp(1)
    q = torch.zeros(states, vocab_size, dtype=torch.float64).scatter_(1, chosen, weights / weights.sum(1, True))
    p = (1 - smoothing) * q + smoothing / vocab_size
    nxt = (torch.arange(states)[:, None] * vocab_size + torch.arange(vocab_size)) % states
    pi = torch.full((states,), 1.0 / states, dtype=torch.float64)
    for _ in range(100_000):
        new = torch.zeros_like(pi).index_add_(0, nxt.flatten(), (pi[:, None] * p).flatten())
        done = (new - pi).abs().sum().item() < 1e-14
        pi = new / new.sum()
        if done:
            return p, pi
    raise DataError(f"text-markov: the stationary distribution of the chain (vocab_size {vocab_size}, order {order}) "
                    "did not converge in 100000 power iterations; raise smoothing")


def _markov_predictors(p: torch.Tensor, pi: torch.Tensor, vocab_size: int, order: int) -> List[torch.Tensor]:
    """``tables[c]`` (``c = 1..k``): the source's next-token distribution given only the last ``c`` tokens,
    indexed like a state of ``c`` tokens. ``c = k`` is ``p``; for ``c < k`` the earlier tokens are summed out
    under ``pi``: ``P(x | last c) = sum_s pi(s) p(x | s) [s ends with them] / sum_s pi(s) [s ends with them]``."""
    tables = [None] * (order + 1)
    tables[order] = p
    for c in range(1, order):
        joint = torch.zeros(vocab_size ** c, vocab_size, dtype=torch.float64)
        joint.index_add_(0, torch.arange(len(pi)) % vocab_size ** c, pi[:, None] * p)
        tables[c] = joint / joint.sum(1, True)
    return tables


def _window_loss(windows: TokenWindows, tables: List[torch.Tensor], vocab_size: int, order: int) -> float:
    """Mean ``-log P(y_t | x_0..x_t)`` over every position of every window under the source's predictor: a
    position ``t`` sees ``min(t + 1, k)`` tokens of the window (:func:`_markov_predictors`)."""
    idx = torch.arange(len(windows))
    x, y = windows.take(idx)
    total = torch.zeros((), dtype=torch.float64)
    for t in range(windows.context):
        c = min(t + 1, order)
        state = torch.zeros(len(idx), dtype=torch.int64)
        for j in range(t + 1 - c, t + 1):
            state = state * vocab_size + x[:, j]
        total += -torch.log(tables[c][state, y[:, t]]).sum()
    return float(total / y.numel())


def _text_markov(root=None, download=False, vocab_size=16, order=2, support=3, smoothing=0.02, context=32,
                 train_tokens=200_000, test_tokens=20_000, stride=None, seed=0) -> Data:
    """Tokens of a random sparse order-``k`` Markov source (:func:`_markov_chain`), generated from a private
    generator seeded by ``seed``: one chain of ``train_tokens + test_tokens`` tokens whose first state is
    drawn from ``pi`` (so every window starts in the stationary distribution), the first ``train_tokens``
    the training split and the rest the test split, cut into windows of ``context`` tokens
    (:class:`TokenWindows`; the test split's never overlap).

    ``best_loss`` is the loss of the source's own predictor on the test windows: a position ``t`` of a
    window knows ``min(t + 1, k)`` tokens (:func:`_markov_predictors`), and no model reading the window
    can do better in expectation. ``info`` holds the chain (``transition``, ``stationary``), the entropy
    rate ``sum_s pi(s) H(p(. | s))`` (nats) and the test split's unigram loss (the loss of predicting
    the training split's token frequencies).
    """
    check_int("text-markov vocab_size", vocab_size, 2)
    check_int("text-markov order", order, 1)
    check_int("text-markov support", support, 1, vocab_size, why="tokens each state can be followed by")
    check_int("text-markov context", context, 1, why="tokens per window")
    if vocab_size ** (order + 1) > 2 ** 22:  # (the transition table: a next-token distribution per state)
        raise ConfigError(f"text-markov's transition table has vocab_size ** (order + 1) = "
                          f"{vocab_size ** (order + 1)} entries, more than 2^22: lower vocab_size or order")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 < smoothing <= 1:
        raise ConfigError(f"text-markov smoothing = {smoothing!r} must lie in (0, 1] (the weight of the uniform "
                          "distribution mixed into every state's: it keeps the chain irreducible)")
    check_int("text-markov train_tokens", train_tokens, context + 1, why="at least one window")
    check_int("text-markov test_tokens", test_tokens, context + 1, why="at least one window")
    g = torch.Generator().manual_seed(check_int("text-markov seed", seed, 0))
    p, pi = _markov_chain(vocab_size, order, support, float(smoothing), g)
    n = train_tokens + test_tokens
    u = torch.rand(n, generator=g, dtype=torch.float64).tolist()
    cum = p.cumsum(1)
    cum[:, -1] = 1.0
    rows = cum.tolist()
    state = int(torch.searchsorted(pi.cumsum(0), torch.tensor([u[0]], dtype=torch.float64)).clamp_max(len(pi) - 1))
    out = [(state // vocab_size ** (order - 1 - j)) % vocab_size for j in range(order)]
    states = vocab_size ** order
    for i in range(order, n):
        x = bisect.bisect_right(rows[state], u[i])
        out.append(x)
        state = (state * vocab_size + x) % states
    tokens = torch.tensor(out, dtype=torch.uint8 if vocab_size <= 256 else torch.int32)
    train = TokenWindows(tokens[:train_tokens], context, stride)
    test = TokenWindows(tokens[train_tokens:], context)
    tables = _markov_predictors(p, pi, vocab_size, order)
    freq = torch.bincount(tokens[:train_tokens].long(), minlength=vocab_size).double() + 1
    unigram = -torch.log(freq / freq.sum())[test.take(torch.arange(len(test)))[1]].mean()
    entropy = float(-(pi[:, None] * p * torch.log(p)).sum())
    return Data("text-markov", train, test, num_classes=vocab_size, input_shape=(context,), task="lm",
                info={"seed": int(seed), "order": order, "transition": p, "stationary": pi, "entropy_rate": entropy,
                      "unigram_loss": float(unigram)},
                best_loss=_window_loss(test, tables, vocab_size, order))


@dataclass(frozen=True)
class _Corpus:
    """A published text corpus: its files under ``root``, where to get them, how its splits are cut."""

    name: str
    files: Tuple[str, ...]           # (train, valid, test), or one file cut by ``fractions``
    source: str                      # where the files come from, for the error message
    url: Optional[str] = None        # a stable download (None: the files must be put there by hand)
    archive: bool = False            # the url is a zip that unpacks to ``files``
    fractions: Tuple[float, float] = (0.9, 0.1)  # one file: train and valid shares (test: the rest)


#: The corpora read from their published files (``root / file``), by dataset name.
TEXT_CORPORA = {c.name: c for c in [
    _Corpus("text-shakespeare", ("tinyshakespeare/input.txt",),
            "TinyShakespeare (Karpathy's char-rnn, 1.1 MB): data/tinyshakespeare/input.txt of github.com/karpathy/char-rnn",
            url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            fractions=(0.9, 0.0)),
    _Corpus("text-wikitext2", ("wikitext-2-raw/wiki.train.raw", "wikitext-2-raw/wiki.valid.raw",
                               "wikitext-2-raw/wiki.test.raw"),
            "WikiText-2 raw (Merity et al. 2016): the archive wikitext-2-raw-v1.zip unpacks to wikitext-2-raw/"),
    _Corpus("text-wikitext103", ("wikitext-103-raw/wiki.train.raw", "wikitext-103-raw/wiki.valid.raw",
                                 "wikitext-103-raw/wiki.test.raw"),
            "WikiText-103 raw (Merity et al. 2016): the archive wikitext-103-raw-v1.zip unpacks to wikitext-103-raw/"),
    _Corpus("text-enwik8", ("enwik8",),
            "enwik8 (Hutter Prize, the first 10^8 bytes of an English Wikipedia dump): enwik8.zip unpacks to enwik8",
            url="http://mattmahoney.net/dc/enwik8.zip", archive=True, fractions=(0.9, 0.05)),
]}


def _download_corpus(corpus: _Corpus, root: Path) -> None:
    from torchvision.datasets.utils import download_and_extract_archive, download_url
    target = root / corpus.files[0]
    try:
        if corpus.archive:
            download_and_extract_archive(corpus.url, str(target.parent))
        else:
            download_url(corpus.url, str(target.parent), target.name)
    except (OSError, RuntimeError) as e:
        raise DataError(f"{corpus.name} could not be downloaded to {root} ({e}); download {corpus.url} by hand "
                        f"and put {corpus.files[0]} under {root}.") from e


def _read_corpus(corpus: _Corpus, root: Path, level: str) -> Tuple[List[torch.Tensor], int, Dict[str, Any]]:
    """The corpus's three splits (train, valid, test) as 1-D token tensors, the vocabulary size and info:
    bytes (uint8, vocabulary 256) or characters (int32 ids of the sorted characters of the whole corpus)."""
    blobs: List[bytes] = []
    for f in corpus.files:
        try:
            blobs.append((root / f).read_bytes())
        except OSError as e:
            raise DataError(f"{corpus.name}: {root / f} cannot be read ({e.strerror}); put the file there "
                            f"({corpus.source})") from None
    if len(blobs) == 1:  # one file: cut its bytes by the corpus's fractions (enwik8: 90M / 5M / 5M of its 10^8)
        blobs = _cut(blobs[0], corpus.fractions, at_characters=level != "byte")
    if level == "byte":
        splits = [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
                  for b in blobs]
        vocab, info = 256, {"level": "byte"}
    else:
        try:
            texts = [b.decode("utf-8") for b in blobs]
        except UnicodeDecodeError as e:
            raise DataError(f"{corpus.name}: a file under {root} is not UTF-8 text ({e}), so it has no characters "
                            "to count: check the file, or read its bytes (level='byte')") from None
        codes = [np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32) for t in texts]
        alphabet = np.unique(np.concatenate(codes))
        splits = [torch.from_numpy(np.searchsorted(alphabet, c).astype(np.int32)) for c in codes]
        vocab, info = len(alphabet), {"level": "char", "characters": "".join(map(chr, alphabet.tolist()))}
    return splits, vocab, info


def _cut(blob: bytes, fractions: Tuple[float, float], at_characters: bool) -> List[bytes]:
    """``blob`` cut into train, valid and test at ``fractions`` of its bytes, the same stretches of the file at
    every level; for characters each cut moves past the UTF-8 continuation bytes (``0b10xxxxxx``) of a character it
    falls inside (a cut by characters of text with multi-byte characters was other text than the standard split)."""
    n = len(blob)
    cuts = [int(round(n * fractions[0])), int(round(n * sum(fractions)))]
    if at_characters:
        cuts = [next((k for k in range(c, n) if blob[k] & 0xC0 != 0x80), n) for c in cuts]
    return [blob[:cuts[0]], blob[cuts[0]:cuts[1]], blob[cuts[1]:]]


def _text_corpus(name: str, root=None, download=False, context=128, level="byte", stride=None,
                 test_split="test") -> Data:
    """A published corpus (:data:`TEXT_CORPORA`) as token windows of ``context`` (:class:`TokenWindows`):
    bytes (``level="byte"``, vocabulary 256) or characters (``level="char"``: the UTF-8 text's distinct
    characters, sorted). The training split's windows lie ``stride`` tokens apart (default ``context``:
    one pass predicts each token once); the test split's never overlap. ``test_split``: the split
    evaluated, ``"test"`` or ``"valid"`` (TinyShakespeare has none: 90% train, 10% test)."""
    corpus = TEXT_CORPORA[name]
    root = Path(root) if root is not None else data_dir()
    if level not in ("byte", "char"):
        raise ConfigError(f"{name} level = {level!r} must be 'byte' (vocabulary 256) or 'char' (the corpus's "
                          "characters)")
    splits = ("test", "valid") if len(corpus.files) == 3 or corpus.fractions[1] > 0 else ("test",)
    if test_split not in splits:
        raise ConfigError(f"{name} test_split = {test_split!r} must be {' or '.join(map(repr, splits))}")
    check_int(f"{name} context", context, 1, why="tokens per window")
    missing = [f for f in corpus.files if not (root / f).is_file()]
    if missing and download and corpus.url is not None:
        _download_corpus(corpus, root)
        missing = [f for f in corpus.files if not (root / f).is_file()]
    if missing:
        how = (f"pass download=True (--download on the command line) to fetch {corpus.url}, or put it there by hand"
               if corpus.url else "put it there by hand (it has no download here)")
        raise DataError(f"{name} not found: {root} lacks {missing} ({corpus.source}). Set $STALEOPT_DATA to the "
                        f"folder that holds it (or pass root= in Python), or {how}.")
    (train, valid, test), vocab, info = _read_corpus(corpus, root, level)
    evaluated = test if test_split == "test" else valid
    for split, tokens in (("training", train), (test_split, evaluated)):
        if len(tokens) < context + 1:
            raise DataError(f"{name} under {root}: its {split} split holds {len(tokens)} tokens, fewer than "
                            f"context + 1 = {context + 1} (one window): check the files {list(corpus.files)} "
                            "(truncated or empty?) or lower context")
    info.update({"root": str(root), "tokens": {"train": len(train), "valid": len(valid), "test": len(test)},
                 "test_split": test_split})
    return Data(name, TokenWindows(train, context, stride), TokenWindows(evaluated, context), num_classes=vocab,
                input_shape=(int(context),), task="lm", info=info)


_LOADERS = {
    "mnist1d": _mnist1d,
    "cifar10": lambda **kw: _cifar("cifar10", **kw),
    "cifar100": lambda **kw: _cifar("cifar100", **kw),
    "synthetic": _synthetic,
    "text-markov": _text_markov,
    **{name: functools.partial(_text_corpus, name) for name in TEXT_CORPORA},
}

_OPTIONS = {
    "mnist1d": lambda: sorted(set(_mnist1d_defaults()) | {"cache"}),
    "cifar10": lambda: ["augment", "verify"],
    "cifar100": lambda: ["augment", "verify"],
    "synthetic": lambda: ["input_shape", "noise", "num_classes", "num_samples", "seed", "separation",
                          "task", "train_split"],
    "text-markov": lambda: ["context", "order", "seed", "smoothing", "stride", "support", "test_tokens",
                            "train_tokens", "vocab_size"],
    **{name: (lambda: ["context", "level", "stride", "test_split"]) for name in TEXT_CORPORA},
}


#: Datasets registered by the user (:func:`register`) and specs loaded (:mod:`staleopt.registry`), by name.
_USER: Dict[str, Callable[..., Any]] = {}


def register(name: str, factory: Callable[..., Any], *, replace: bool = False) -> str:
    """Make ``factory`` the dataset ``name`` everywhere a dataset name goes: ``RunConfig(data=name)``,
    sweeps (their worker processes too: :mod:`staleopt.registry`), :func:`staleopt.compare`.

    ``factory(**data_kwargs)`` returns a :class:`Data` or a pair ``(train, test)`` of datasets
    of ``(x, y)`` samples (:func:`from_datasets` infers the rest); it gets ``root`` and ``download``
    too when it has parameters of those names. It must return the same data every time it is
    called with the same arguments (seed any randomness of its own). Registering the same
    factory again is a no-op; another factory under a taken name needs ``replace=True``.
    Built-in names cannot be replaced. Returns ``name``.
    """
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ConfigError(f"a dataset name is a non-empty string without ':' or surrounding spaces, got {name!r} "
                          "(':' marks a 'module:function' spec)")
    if not callable(factory):
        raise ConfigError(f"dataset {name!r}: the factory must be callable, got {type(factory).__name__}")
    if name in _LOADERS:
        raise ConfigError(f"dataset {name!r} is built in; register yours under another name")
    old = _USER.get(name)
    if old is not None and old is not factory and not replace:
        raise ConfigError(f"dataset {name!r} is already registered with {old!r}; pass replace=True to register "
                          "another factory under this name")
    _USER[name] = factory
    shape.cache_clear()
    return name


def registered() -> Dict[str, Callable[..., Any]]:
    """The factories registered by name in this process (specs left out: they load anywhere)."""
    return {n: f for n, f in _USER.items() if not registry.is_spec(n)}


def names():
    """The dataset names :func:`load` accepts (built-in, then registered; any ``module:function`` spec too)."""
    return list(_LOADERS) + list(registered())


def _user(name: str):
    """The user's factory of ``name``, or ``None`` for a built-in; raises for an unknown name."""
    if name in _LOADERS:
        return None
    if name in _USER and not registry.is_spec(name):
        return _USER[name]
    if registry.is_spec(name):
        key = registry.spec_key(name)  # (a relative file spec names another file after os.chdir)
        if key not in _USER:
            _USER[key] = registry.load_spec(name, "dataset")
        return _USER[key]
    raise registry.unknown("dataset", name, names(), "staleopt.register_data")


def _parameters(factory) -> Dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return {}


def options(name: str) -> Optional[List[str]]:
    """The dataset's own keyword arguments (besides ``root`` and ``download``); ``None`` when a user's
    factory takes ``**kwargs`` (any option is passed on)."""
    factory = _user(name)
    if factory is None:
        return _OPTIONS[name]()
    params = _parameters(factory)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return [k for k, p in params.items() if k not in ("root", "download") and p.kind is not p.VAR_POSITIONAL]


def option_defaults(name: str) -> Dict[str, Any]:
    """The dataset's options whose loader declares a default, with it (what a given value's type is checked
    against: :class:`~staleopt.config.RunConfig`)."""
    factory = _user(name)
    if factory is None and name == "mnist1d":
        return {**_mnist1d_defaults(), "cache": True}
    params = _parameters(factory if factory is not None else _LOADERS[name])
    return {k: p.default for k, p in params.items() if p.default is not p.empty and k not in ("root", "download")}


def _int64_pieces(t, size: int = 1 << 22):
    """Integer tensor ``t`` flat, in pieces of ``size`` widened to int64 (torch has no min/max for uint16 or
    uint32, and compares uint8 with -100 as 156); a token file's dataset is not copied whole."""
    return (piece.long() for piece in torch.as_tensor(t).reshape(-1).split(size) if piece.numel())


def task(name: str, **kwargs) -> Optional[str]:
    """The task of ``load(name, **kwargs)`` without loading it: ``"classification"``, ``"regression"`` or
    ``"lm"`` for a built-in dataset; ``None`` for a user's (known once loaded)."""
    if _user(name) is not None:
        return None
    if name == "synthetic":
        _check_synthetic_task(kwargs.get("task", "classification"))
        return kwargs.get("task", "classification")
    return "lm" if name == "text-markov" or name in TEXT_CORPORA else "classification"


def load(name: str = "mnist1d", *, root=None, download: bool = False, **kwargs) -> Data:
    """Load dataset ``name``; ``kwargs`` are the dataset's own options (see the module table).

    ``root`` is where downloaded datasets live (CIFAR, the text corpora); ``download=True``
    fetches missing CIFAR files (and TinyShakespeare's and enwik8's). Raises :class:`~staleopt.errors.DataError`
    when files are missing and :class:`~staleopt.errors.ConfigError` for bad
    arguments. A user's dataset (:func:`register`, or a spec) is its factory's result.
    """
    allowed = options(name)
    if allowed is not None:
        _check_kwargs(name, kwargs, allowed)
    factory = _user(name)
    if factory is None:
        return _LOADERS[name](root=root, download=download, **kwargs)
    params = _parameters(factory)
    # root and download reach a factory that takes them where given (or where it has no default of its own): its
    # own defaults stand otherwise (root=None, download=False overrode them)
    extra = {k: v for k, v, given in (("root", root, root is not None), ("download", download, bool(download)))
             if k in params and (given or params[k].default is params[k].empty)}
    registry.check_arguments("dataset", name, params, kwargs, "data_kwargs", supplied=extra)
    out = factory(**extra, **kwargs)
    if isinstance(out, Data):
        return _checked(out)
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return from_datasets(*out, name=name)
    raise ConfigError(f"dataset {name!r}: the factory returned a {type(out).__name__}; return a staleopt.data.Data "
                      "or a pair (train, test) of datasets of (x, y) samples")


def _check_task(name: str, task) -> None:
    if task not in ("classification", "regression", "lm"):
        raise ConfigError(f"dataset {name!r}: task must be 'classification', 'regression' or 'lm', got {task!r}")


def _as_input(name: str, x, split: str) -> torch.Tensor:
    """The first ``split`` input ``x`` as a tensor, in the models' dtype (else a DataError naming the fix)."""
    try:
        inputs = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise DataError(f"dataset {name!r}: the first {split} input is a {type(x).__name__}, not an array of "
                        "numbers: convert it in the dataset (for images, torchvision.transforms.ToTensor())"
                        ) from None
    if inputs.is_floating_point() and inputs.dtype != torch.get_default_dtype():
        raise DataError(f"dataset {name!r}: the {split} inputs are {inputs.dtype} (numpy's default float64 for a "
                        f"numpy array) but the models are built in torch's default dtype, "
                        f"{torch.get_default_dtype()}: return x.astype(numpy.float32) or x.float() (or set "
                        "torch.set_default_dtype to match)")
    return inputs


def _checked(d: Data) -> Data:
    """A :class:`Data` a user's factory built: its task one of the three, and its first train input in the models'
    dtype and ``input_shape`` (float64 inputs failed at the first step inside torch; a misspelled task trained with
    the MSE loss)."""
    _check_task(d.name, d.task)
    if len(d.train) == 0 or len(d.test) == 0:
        raise DataError(f"dataset {d.name!r}: both splits must hold samples ({len(d.train)} train, {len(d.test)} "
                        "test)")
    x = _as_input(d.name, d.train[0][0], "train")
    if tuple(x.shape) != tuple(d.input_shape) and d.task != "lm":
        raise DataError(f"dataset {d.name!r}: input_shape = {tuple(d.input_shape)} but the first train input has "
                        f"shape {tuple(x.shape)}: the model is built for input_shape")
    return d


def from_datasets(train: Dataset, test: Dataset, name: str = "custom", task: Optional[str] = None,
                  num_classes: Optional[int] = None) -> Data:
    """A :class:`Data` from two datasets of ``(x, y)`` samples, the rest read off the samples.

    ``input_shape`` is the first sample's ``x.shape``. ``task``: ``"classification"`` when each
    target is one integer (then ``num_classes`` = the largest label + 1 over both splits), ``"lm"``
    when it is a sequence of integers (next tokens, or any per-position labels: the loss is the
    cross-entropy at every position; ``num_classes`` = the largest label, or token of an integer
    ``x``, + 1 over both splits), else ``"regression"`` (``num_classes`` = the number of target
    values per sample).
    """
    for split, ds in (("train", train), ("test", test)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__") or len(ds) == 0:
            raise DataError(f"dataset {name!r}: the {split} split must be a non-empty Dataset of (x, y) samples, "
                            f"got {type(ds).__name__}")
        first = ds[0]
        if isinstance(first, Mapping) or not isinstance(first, (tuple, list)) or len(first) != 2:
            what = (f"a {type(first).__name__} with the keys {sorted(map(str, first))}" if isinstance(first, Mapping)
                    else f"a {type(first).__name__} of {len(first)} fields" if isinstance(first, (tuple, list))
                    else f"a {type(first).__name__}")
            raise DataError(f"dataset {name!r}: a sample must be a pair (x, y), but the first {split} sample is "
                            f"{what}: wrap the dataset so that it returns (input, target), e.g. a Dataset whose "
                            "__getitem__ returns (d[i]['x'], d[i]['y']), or a TensorDataset of exactly two tensors")
    if train is test or (isinstance(train, TensorDataset) and isinstance(test, TensorDataset) and
                         len(train) == len(test) and train.tensors[0].data_ptr() == test.tensors[0].data_ptr()):
        warnings.warn(f"dataset {name!r}: the test split is the training split (the same samples): every test "
                      "metric is measured on the data the model trains on; split the samples (e.g. "
                      "torch.utils.data.random_split with a seeded generator) unless that is what you mean",
                      stacklevel=3)
    x, y = train[0]
    try:
        y = torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError):
        raise DataError(f"dataset {name!r}: the first train target is a {type(y).__name__} ({y!r:.40}), not a number "
                        "or an array of numbers: a class is an integer index (map names to 0..C-1, e.g. "
                        "{c: i for i, c in enumerate(sorted(classes))}), a regression target a float") from None
    inputs = _as_input(name, x, "train")
    seen = _as_input(name, test[0][0], "test")
    integer = not (y.is_floating_point() or y.is_complex())
    if task is None and integer and tuple(y.shape) == (1,) and torch.as_tensor(x).is_floating_point():
        raise DataError(f"dataset {name!r}: the first target is an integer tensor of shape (1,), which reads as a "
                        "one-token sequence (task 'lm'): a class label is a scalar (return y.squeeze(-1) or "
                        "int(y)); pass task='lm' if it is a one-token sequence")
    if task is None and not integer and _reads_as_classes(train):
        warnings.warn(f"dataset {name!r}: the targets are floats, so it trains as a regression (MSE loss, no "
                      "accuracy), but they read as class labels (whole numbers 0..C-1, or one-hot rows): return "
                      "integer targets (int(y), or y.argmax() of a one-hot row) to train a classifier; pass "
                      "task='regression' to from_datasets if they are regression values", stacklevel=3)
    task = task or (("lm" if y.dim() else "classification") if integer else "regression")
    _check_task(name, task)
    if seen.dtype != inputs.dtype or (task != "lm" and seen.shape != inputs.shape):  # (a text's windows may vary)
        raise DataError(f"dataset {name!r}: the first test input is {seen.dtype} of shape {tuple(seen.shape)}, the "
                        f"first train input {inputs.dtype} of shape {tuple(inputs.shape)}: the model is built for "
                        "one; give both splits the same preprocessing (e.g. the same resize or crop)")
    if task == "lm" and seen.dim() and inputs.dim() and seen.shape[0] > inputs.shape[0]:
        raise DataError(f"dataset {name!r}: the first test window has {seen.shape[0]} tokens, more than the "
                        f"{inputs.shape[0]} of the first training window, which a language model's positions are "
                        f"sized for (input_shape): cut the test tokens into windows of at most {inputs.shape[0]} "
                        f"(TokenWindows(test_tokens, {inputs.shape[0]}))")
    if task != "regression" and (not integer or (task == "lm") != bool(y.dim())):
        raise DataError(f"dataset {name!r}: task {task!r} needs " + ("one integer class per sample" if task ==
                        "classification" else "a sequence of integer tokens (labels) per sample") +
                        f", but the first target is a {y.dtype} tensor of shape {tuple(y.shape)}")
    if num_classes is None:
        if task == "regression":
            num_classes = int(y.numel())
        else:
            tokens = task == "lm" and not torch.as_tensor(x).is_floating_point()  # the vocabulary includes x's

            def span(ds, split):  # (smallest label but the ignored -100, largest label or token)
                pairs = [ds.tensors[:2]] if isinstance(ds, TensorDataset) else (ds[i] for i in range(len(ds)))
                lo, hi, lengths = 0, 0, set()
                for a, b in pairs:
                    for piece in _int64_pieces(b):
                        kept = piece[piece != -100]
                        lo = min(lo, int(kept.min())) if kept.numel() else lo
                        hi = max(hi, int(piece.max()))
                    for piece in _int64_pieces(a) if tokens else ():
                        hi = max(hi, int(piece.max()))
                    lengths.add(tuple(np.shape(a)))
                if task == "lm" and len(lengths) > 1:  # (a TensorDataset is one shape: its tensors)
                    shown = ", ".join(str(s[0]) for s in sorted(lengths)[:3]) + (", ..." if len(lengths) > 3 else "")
                    raise DataError(f"dataset {name!r}: its {split} windows have {len(lengths)} lengths ({shown}), "
                                    "but a batch stacks "
                                    "windows of one length (it failed at the first batch that mixed them, after "
                                    "training): cut the tokens into windows of one length and drop the short tail "
                                    "(staleopt.data.TokenWindows(tokens, T))")
                return lo, hi
            (lo_train, hi_train), (lo_test, hi_test) = span(train, "training"), span(test, "test")
            if min(lo_train, lo_test) < 0:
                raise DataError(f"dataset {name!r}: a label is {min(lo_train, lo_test)}, but class labels are 0.."
                                "C-1 (the loss's targets; -100 only marks a position left out): map them, e.g. "
                                "-1/+1 to 0/1 with (y + 1) // 2")
            num_classes = max(hi_train, hi_test) + 1
    return Data(name, train, test, num_classes=int(num_classes), input_shape=tuple(torch.as_tensor(x).shape),
                task=task)


def _reads_as_classes(train: Dataset, n: int = 64) -> bool:
    """Whether float targets (of a :class:`TensorDataset`: all of them, else the first ``n``) are all whole numbers
    ``>= 0`` (scalars) or one-hot rows: class labels stored as floats (``numpy.loadtxt``, a pandas column)."""
    ys = train.tensors[1] if isinstance(train, TensorDataset) else \
        torch.stack([torch.as_tensor(train[i][1]) for i in range(min(n, len(train)))])
    ys = ys.double()
    if ys.dim() == 1:
        return bool(((ys == ys.round()) & (ys >= 0)).all()) and len(ys) > 1
    if ys.dim() == 2 and ys.shape[1] > 1:
        return bool(((ys == 0) | (ys == 1)).all() and (ys.sum(1) == 1).all())
    return False


def shape(name: str, kwargs_json: str = "{}") -> Tuple[int, Tuple[int, ...]]:
    """``(num_classes, input_shape)`` of ``load(name, **json.loads(kwargs_json))`` (loaded once per process and
    file: a relative ``file.py:`` spec is keyed by its absolute path)."""
    return _shape(registry.spec_key(name) if registry.is_spec(name) else name, name, kwargs_json)


@functools.lru_cache(maxsize=None)
def _shape(key: str, name: str, kwargs_json: str) -> Tuple[int, Tuple[int, ...]]:
    d = load(name, **json.loads(kwargs_json))
    return d.num_classes, tuple(d.input_shape)


shape.cache_clear = _shape.cache_clear  # type: ignore[attr-defined]  (forget what was loaded: a registration changed)


def first_batch(dataset: Dataset, size: int) -> torch.Tensor:
    """The inputs of the first ``size`` samples (at most all) in dataset order: the forward pass that
    ``unit_order="execution"`` orders a run's units by (the trainer's and the memory report's; an augmenting dataset
    draws from a generator of its own, so no random stream of the caller moves)."""
    x, _ = next(batches(dataset, min(size, len(dataset)), generator=torch.Generator().manual_seed(0)))
    return x


def batches(dataset: Dataset, batch_size: int, *, shuffle: bool = False,
            generator: Optional[torch.Generator] = None, drop_last: bool = False, start: int = 0) -> Iterator:
    """Yield ``(x, y)`` minibatches in-process, deterministic given ``generator``.

    One pass draws, from ``generator`` (torch's global RNG when ``None``), the
    order (``randperm(n)`` when ``shuffle``) and then, for an augmenting
    :class:`ImageTensors`, the augmentation of every position of the pass
    (:meth:`ImageTensors.draw`), so the generator's state after a pass does not
    depend on how much of it was read. A :class:`TensorDataset` is sliced, a
    :class:`TokenWindows` gathered and an
    :class:`ImageTensors` augmented a whole batch at once, on the tensors'
    device; any other dataset goes through a ``DataLoader`` with
    ``num_workers=0``, so its random transforms draw from this process's global
    RNGs (torch's, numpy's, Python's ``random``: :func:`staleopt.train.run` seeds
    all three and its checkpoint holds them). ``start`` skips the first ``start`` minibatches of the pass without
    loading them (the draws are the same), which is how a run resumes in the
    middle of an epoch.
    """
    check_int("batch_size", batch_size, 1)
    check_int("start", start, 0, why="minibatches to skip")
    n = len(dataset)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    first = min(start * batch_size, stop)
    if isinstance(dataset, TokenWindows):
        order = order.to(dataset.tokens.device)
        for s in range(first, stop, batch_size):
            yield dataset.take(order[s:s + batch_size])
        return
    if isinstance(dataset, ImageTensors):
        params = dataset.draw(n, generator)
        device = dataset.images.device  # one copy of the pass's indices and draws, not one per batch
        order, params = order.to(device), None if params is None else params.to(device)
        for s in range(first, stop, batch_size):
            yield dataset.take(order[s:s + batch_size], None if params is None else params[s:s + batch_size])
        return
    if isinstance(dataset, TensorDataset):
        order = order.to(dataset.tensors[0].device)
        for s in range(first, stop, batch_size):
            idx = order[s:s + batch_size]
            yield tuple(t[idx] for t in dataset.tensors)
        return
    # (a private generator: a DataLoader without one draws its base seed from torch's global RNG each pass, so a
    # run resumed mid-epoch, whose global RNG is restored before this pass begins, would draw its transforms and
    # dropout masks one draw off)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, order[first:stop].tolist()),
                                         batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=_collate,
                                         generator=torch.Generator())
    yield from loader


def _collate(samples: List[Any]) -> Any:
    """torch's ``default_collate`` of ``(x, y)`` samples whose fields may also be Python lists of numbers
    (a token sequence): such a field becomes one tensor first, where ``default_collate`` would transpose a
    batch of length-``T`` lists into ``T`` tensors of the batch. Raises :class:`DataError` when a field is
    not a rectangular array of numbers or when the samples of one batch differ in shape."""
    def field(value, k: int):
        if not isinstance(value, (list, tuple)):
            return value
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"field {k} of a sample is a {type(value).__name__} that is not a rectangular array of "
                            f"numbers ({e}): return tensors, numpy arrays or lists of numbers") from None
    if all(isinstance(s, (list, tuple)) for s in samples):
        samples = [tuple(field(v, k) for k, v in enumerate(s)) for s in samples]
        for k, values in enumerate(zip(*samples)):
            shapes = {tuple(np.shape(v)) for v in values}
            if len(shapes) > 1:
                raise DataError(f"field {k} of the samples of one batch has {len(shapes)} shapes "
                                f"({sorted(shapes)[:3]}...): pad every sample to one shape (a padded target "
                                "of -100 is left out of the loss and the metrics)")
    return torch.utils.data.default_collate(samples)
