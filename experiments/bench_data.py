"""Throughput of the CIFAR input pipeline: per-sample PIL transforms against batched uint8 tensors.

    python experiments/bench_data.py --out runs/bench_data            # about a minute on one CPU thread
    python experiments/bench_data.py --out /tmp/bd --quick            # smoke run: seconds, measures nothing

Both pipelines produce the same minibatches in distribution: random crop 32
with 4 pixels of zero padding, horizontal flip with probability 1/2,
``ToTensor`` scaling to [0, 1], per-channel ``Normalize`` (He et al. 2016
§4.2), shuffled batches of ``--batch-size`` with the last incomplete one dropped:

* **before** (the pipeline staleopt had before, kept here only to be
  measured): torchvision's ``CIFAR10`` dataset with the transforms
  ``Compose([RandomCrop(32, padding=4), RandomHorizontalFlip(), ToTensor(),
  Normalize(mean, std)])`` applied to one PIL image at a time, collated by a
  ``DataLoader`` with ``num_workers=0`` in the training process;
* **after**: :func:`staleopt.data.load` keeps the images as one uint8 tensor and
  :func:`staleopt.data.batches` crops, flips and normalizes each minibatch
  with tensor operations (one gather), on ``--device``.

The files are a copy in the official python format that the script writes
(random pixels: the cost does not depend on them) unless ``--root`` points to
the real dataset. Each pipeline is timed over ``--batches`` minibatches per
round, rounds interleaved (``--rounds``); reported are the median images/s and
ms per batch, the speedup (ratio of the medians) and the speedup within each
round (``meta.json``: on a shared machine the load drifts between rounds). On a GPU each round is timed between two
``torch.cuda.synchronize()``.

Outputs in ``--out``: ``data.csv`` and ``meta.json`` (date, machine, its load average, command); the
table is printed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from staleopt import data
from staleopt.machine import cpu_name, load_average, source_commit

__all__ = ["main", "write_copy", "before", "after", "images_per_second"]


def write_copy(root: Path, train_images: int, seed: int = 0) -> Path:
    """Write a CIFAR-10 copy with ``train_images`` random training images (5 files) and 1,000 test images."""
    if train_images < 5 or train_images % 5:
        raise ValueError(f"train_images must be a positive multiple of 5, got {train_images}")
    rng = np.random.default_rng(seed)
    folder = root / data.CIFAR_FOLDERS["cifar10"]
    folder.mkdir(parents=True, exist_ok=True)
    files = [(f"data_batch_{i}", train_images // 5) for i in range(1, 6)] + [("test_batch", 1000)]
    for name, n in files:
        batch = {"batch_label": name, "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, n).tolist(), "filenames": [f"{name}_{i}.png" for i in range(n)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f, protocol=2)
    return root


def before(root: Path, batch_size: int, seed: int) -> Iterator:
    """The per-sample PIL pipeline: an endless stream of shuffled, augmented minibatches."""
    import torchvision
    from torchvision import transforms
    d = data.load("cifar10", root=root, verify=False)
    base = torchvision.datasets.CIFAR10.__new__(torchvision.datasets.CIFAR10)  # its per-sample pipeline, same images
    base.data, base.targets = d.train.images.permute(0, 2, 3, 1).numpy(), d.train.targets.tolist()
    base.target_transform = None
    base.transform = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                         transforms.ToTensor(), transforms.Normalize(d.info["mean"], d.info["std"])])
    g = torch.Generator().manual_seed(seed)
    while True:
        loader = torch.utils.data.DataLoader(base, batch_size=batch_size, shuffle=True, generator=g, drop_last=True,
                                             num_workers=0)
        yield from loader


def after(root: Path, batch_size: int, seed: int, device: torch.device) -> Iterator:
    """The batched uint8 pipeline of :mod:`staleopt.data` on ``device``: an endless stream of minibatches."""
    d = data.load("cifar10", root=root, verify=False).to(device)
    g = torch.Generator().manual_seed(seed)
    while True:
        yield from data.batches(d.train, batch_size, shuffle=True, generator=g, drop_last=True)


def images_per_second(stream: Iterator, batches: int, sync: Callable[[], None]) -> float:
    """Images per second of ``batches`` minibatches taken from ``stream`` (after one warm-up batch)."""
    next(stream)
    sync()
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        x, _ = next(stream)
        n += len(x)
    sync()
    return n / (time.perf_counter() - t0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench_data", help="output directory")
    ap.add_argument("--root", default=None, help="a CIFAR-10 root to read (default: write a random copy)")
    ap.add_argument("--train-images", type=int, default=10000, help="training images of the written copy")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--batches", type=int, default=None, help="batches per round (default 40 before, 400 after)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="device of the batched pipeline (cpu, cuda)")
    ap.add_argument("--quick", action="store_true", help="tiny copy, few batches: checks the script runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n_before, n_after = (2, 4) if args.quick else (args.batches or 40, args.batches or 400)
    rounds = 1 if args.quick else args.rounds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root) if args.root else write_copy(Path(tmp), 500 if args.quick else args.train_images)
        streams = {"before": before(root, args.batch_size, 0), "after": after(root, args.batch_size, 0, device)}
        rates = {k: [] for k in streams}
        for _ in range(rounds):
            rates["before"].append(images_per_second(streams["before"], n_before, lambda: None))
            rates["after"].append(images_per_second(streams["after"], n_after, sync))
    rows = []
    for name, where in (("before", "cpu"), ("after", str(device))):
        ips = statistics.median(rates[name])
        rows.append({"pipeline": name, "device": where, "batch_size": args.batch_size, "threads": args.threads,
                     "images_per_s": round(ips), "ms_per_batch": round(1000 * args.batch_size / ips, 3),
                     "rounds": rounds, "min_images_per_s": round(min(rates[name])),
                     "max_images_per_s": round(max(rates[name]))})
    table = pd.DataFrame(rows)
    speedup = rows[1]["images_per_s"] / rows[0]["images_per_s"]
    table.to_csv(out / "data.csv", index=False)
    cpu = cpu_name()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "commit": source_commit(), "cpu": cpu, "cpus": os.cpu_count(),
            "load_average_1min": load_average(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "root": "written random copy" if not args.root else str(root), "quick": args.quick,
            "speedup": round(speedup, 2),
            "speedup_per_round": [round(a / b, 2) for a, b in zip(rates["after"], rates["before"])]}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(table.to_string(index=False))
    print(f"\nspeedup (after / before): {speedup:.1f}x   [{meta['date']}, {cpu}, {os.cpu_count()} CPUs, "
          f"load {meta['load_average_1min']}, torch {torch.__version__}]\nwrote {out}/data.csv, meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
