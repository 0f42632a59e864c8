"""Smoke test of experiments/bench_data.py: it runs and writes its table. It times nothing.

It checks what the comparison rests on: both pipelines read the same files and yield minibatches of the same
shape, type and pixel grid (random crops with zero padding, flips, the same normalization)."""
import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from staleopt import data

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench_data.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_pipelines_yield_the_same_kind_of_batches(bench, tmp_path):
    root = bench.write_copy(tmp_path, 50)
    d = data.load("cifar10", root=root, verify=False)
    mean, std = torch.tensor(d.info["mean"])[:, None, None], torch.tensor(d.info["std"])[:, None, None]
    torch.manual_seed(0)
    old, new = next(bench.before(root, 16, 0)), next(bench.after(root, 16, 0, torch.device("cpu")))
    for x, y in (old, new):
        assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (16,)
        pixels = (x * std + mean) * 255
        assert torch.allclose(pixels, pixels.round(), atol=2e-3) and pixels.min() > -2e-3 and pixels.max() < 255.01
        # each image is one of the training images, shifted and maybe flipped: its centre rows come from one image
        centre = pixels.round().to(torch.uint8)[:, :, 14:18, 14:18]
        assert all(any(_contains(img, c) for img in d.train.images) for c in centre)
    with pytest.raises(ValueError, match="multiple of 5"):
        bench.write_copy(tmp_path / "x", 12)


def _contains(image, patch):
    """Whether ``patch`` (C x 4 x 4) occurs in ``image`` or in its mirror image."""
    for img in (image, image.flip(-1)):
        windows = img.unfold(1, 4, 1).unfold(2, 4, 1)  # C x 29 x 29 x 4 x 4
        if (windows == patch[:, None, None]).all(-1).all(-1).all(0).any():
            return True
    return False


def test_quick_run_writes_the_table(bench, tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--quick", "--batch-size", "32"]) == 0
    table = pd.read_csv(tmp_path / "data.csv")
    assert list(table.pipeline) == ["before", "after"] and (table.images_per_s > 0).all()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert {"date", "command", "cpu", "speedup"} <= set(meta) and meta["quick"]
    assert "speedup (after / before)" in capsys.readouterr().out
