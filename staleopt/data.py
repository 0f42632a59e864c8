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

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from . import registry
from .errors import ConfigError, DataError
from .validate import check_int

__all__ = ["Data", "ImageTensors", "load", "names", "options", "batches", "cache_dir", "data_dir", "CIFAR_FOLDERS",
           "read_cifar_batch", "register", "registered", "from_datasets", "shape"]

#: torchvision's folder name for each CIFAR dataset, under ``root``.
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


@dataclass
class Data:
    """A dataset split in two, with what a model and a loss need to know about it.

    ``num_classes`` is the model's output size: the number of classes for
    ``task == "classification"`` (targets are int64 class indices) and the
    number of regression targets for ``task == "regression"`` (float targets
    of shape ``(num_classes,)``).
    """

    name: str
    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: Tuple[int, ...]
    task: str
    info: Dict[str, Any] = field(default_factory=dict)

    def to(self, device) -> "Data":
        """The same data with its tensors on ``device`` when that is not the CPU (a GPU then reads, augments
        and normalizes batches without a copy from the host); unchanged on the CPU."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        return dataclasses.replace(self, train=_to(self.train, device), test=_to(self.test, device))


def _to(dataset: Dataset, device: torch.device) -> Dataset:
    if isinstance(dataset, ImageTensors):
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
            ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

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

    root = Path(root) if root is not None else data_dir()
    base = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    folder = root / CIFAR_FOLDERS[name]
    files = base.train_list + base.test_list
    missing = [f for f, _ in files if not (folder / f).is_file()]
    if missing and not download:
        raise DataError(
            f"{name} not found: {folder} lacks {missing}. Put the extracted python version of "
            f"the dataset there ({base.url} unpacks to {CIFAR_FOLDERS[name]}/), pass another root= "
            f"(or set $STALEOPT_DATA), or pass download=True (--download on the command line).")
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

    def read(split):  # N x 3072 channel-major rows -> N x H x W x C, as torchvision keeps them
        batches = [read_cifar_batch(folder / f) for f, _ in split]
        images = np.vstack([b["data"] for b in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        key = "labels" if "labels" in batches[0] else "fine_labels"
        return np.ascontiguousarray(images), sum((list(b[key]) for b in batches), [])

    train, test = read(base.train_list), read(base.test_list)
    mean, std = _channel_stats(train[0])

    def tensors(split, aug):
        images = torch.from_numpy(split[0]).permute(0, 3, 1, 2).contiguous()
        return ImageTensors(images, torch.as_tensor(split[1], dtype=torch.int64), mean, std, augment=aug)

    return Data(name, tensors(train, augment), tensors(test, False), num_classes=100 if name == "cifar100" else 10,
                input_shape=(3, 32, 32), task="classification",
                info={"root": str(root), "mean": mean, "std": std, "augment": augment, "verify": verify})


# ---------------------------------------------------------------------------------------------
# synthetic

def _synthetic(root=None, download=False, task="classification", num_samples=1000, input_shape=(1, 40),
               num_classes=10, separation=1.0, noise=1.0, train_split=0.8, seed=0) -> Data:
    """Gaussian data from a private generator seeded by ``seed``.

    classification: class means ``mu_c ~ N(0, separation^2 I)``, labels uniform,
    ``x = mu_y + noise * eps``. regression: ``x ~ N(0, I)``,
    ``y = W x / sqrt(d) + noise * eps`` with ``W ~ N(0, 1)`` of shape
    ``(num_classes, d)``, ``d = prod(input_shape)``.
    """
    if task not in ("classification", "regression"):
        raise ConfigError(f"synthetic task must be 'classification' or 'regression', got {task!r}")
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or min(input_shape) < 1 or num_classes < 1 or num_samples < 2:
        raise ConfigError("synthetic needs a non-empty input_shape of positive sizes, num_classes >= 1 "
                          f"and num_samples >= 2; got {input_shape}, {num_classes}, {num_samples}")
    if not 0.0 < train_split < 1.0:
        raise ConfigError(f"train_split must lie in (0, 1), got {train_split!r}")
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


_LOADERS = {
    "mnist1d": _mnist1d,
    "cifar10": lambda **kw: _cifar("cifar10", **kw),
    "cifar100": lambda **kw: _cifar("cifar100", **kw),
    "synthetic": _synthetic,
}

_OPTIONS = {
    "mnist1d": lambda: sorted(set(_mnist1d_defaults()) | {"cache"}),
    "cifar10": lambda: ["augment", "verify"],
    "cifar100": lambda: ["augment", "verify"],
    "synthetic": lambda: ["input_shape", "noise", "num_classes", "num_samples", "seed", "separation",
                          "task", "train_split"],
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
    if name in _USER:
        return _USER[name]
    if registry.is_spec(name):
        _USER[name] = registry.load_spec(name, "dataset")
        return _USER[name]
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


def load(name: str = "mnist1d", *, root=None, download: bool = False, **kwargs) -> Data:
    """Load dataset ``name``; ``kwargs`` are the dataset's own options (see the module table).

    ``root`` is where downloaded datasets live (CIFAR); ``download=True``
    fetches missing CIFAR files. Raises :class:`~staleopt.errors.DataError`
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
    extra = {k: v for k, v in (("root", root), ("download", download)) if k in params}
    out = factory(**extra, **kwargs)
    if isinstance(out, Data):
        return out
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return from_datasets(*out, name=name)
    raise ConfigError(f"dataset {name!r}: the factory returned a {type(out).__name__}; return a staleopt.data.Data "
                      "or a pair (train, test) of datasets of (x, y) samples")


def from_datasets(train: Dataset, test: Dataset, name: str = "custom", task: Optional[str] = None,
                  num_classes: Optional[int] = None) -> Data:
    """A :class:`Data` from two datasets of ``(x, y)`` samples, the rest read off the samples.

    ``input_shape`` is the first sample's ``x.shape``. ``task``: ``"classification"`` when the
    targets are integers (then ``num_classes`` = the largest label + 1 over both splits), else
    ``"regression"`` (``num_classes`` = the number of target values per sample).
    """
    for split, ds in (("train", train), ("test", test)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__") or len(ds) == 0:
            raise DataError(f"dataset {name!r}: the {split} split must be a non-empty Dataset of (x, y) samples, "
                            f"got {type(ds).__name__}")
    x, y = train[0]
    y = torch.as_tensor(y)
    integer = not (y.is_floating_point() or y.is_complex())
    task = task or ("classification" if integer else "regression")
    if task not in ("classification", "regression"):
        raise ConfigError(f"dataset {name!r}: task must be 'classification' or 'regression', got {task!r}")
    if num_classes is None:
        if task == "regression":
            num_classes = int(y.numel())
        else:
            def labels(ds):
                if isinstance(ds, TensorDataset):
                    return ds.tensors[1]
                return torch.as_tensor([int(ds[i][1]) for i in range(len(ds))])
            num_classes = int(max(labels(train).max(), labels(test).max())) + 1
    return Data(name, train, test, num_classes=int(num_classes), input_shape=tuple(torch.as_tensor(x).shape),
                task=task)


@functools.lru_cache(maxsize=None)
def shape(name: str, kwargs_json: str = "{}") -> Tuple[int, Tuple[int, ...]]:
    """``(num_classes, input_shape)`` of ``load(name, **json.loads(kwargs_json))`` (loaded once per process)."""
    d = load(name, **json.loads(kwargs_json))
    return d.num_classes, tuple(d.input_shape)


def batches(dataset: Dataset, batch_size: int, *, shuffle: bool = False,
            generator: Optional[torch.Generator] = None, drop_last: bool = False, start: int = 0) -> Iterator:
    """Yield ``(x, y)`` minibatches in-process, deterministic given ``generator``.

    One pass draws, from ``generator`` (torch's global RNG when ``None``), the
    order (``randperm(n)`` when ``shuffle``) and then, for an augmenting
    :class:`ImageTensors`, the augmentation of every position of the pass
    (:meth:`ImageTensors.draw`), so the generator's state after a pass does not
    depend on how much of it was read. A :class:`TensorDataset` is sliced and an
    :class:`ImageTensors` augmented a whole batch at once, on the tensors'
    device; any other dataset goes through a ``DataLoader`` with
    ``num_workers=0``, so its random transforms draw from this process's torch
    RNG. ``start`` skips the first ``start`` minibatches of the pass without
    loading them (the draws are the same), which is how a run resumes in the
    middle of an epoch.
    """
    check_int("batch_size", batch_size, 1)
    check_int("start", start, 0, why="minibatches to skip")
    n = len(dataset)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    first = min(start * batch_size, stop)
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
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, order[first:stop].tolist()),
                                         batch_size=batch_size, shuffle=False, num_workers=0)
    yield from loader
