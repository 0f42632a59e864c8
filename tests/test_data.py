"""Datasets: MNIST-1D generation and cache, CIFAR through torchvision's real loader, synthetic data, batching."""
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from staleopt import data
from staleopt.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("STALEOPT_DATA", raising=False)


# --------------------------------------------------------------------------------- MNIST-1D

def test_mnist1d_matches_package_and_caches(tmp_path, monkeypatch):
    from mnist1d.data import get_dataset_args, make_dataset
    args = get_dataset_args()
    args.num_samples = 200
    ref = make_dataset(args)

    state = np.random.get_state()
    d = data.load("mnist1d", num_samples=200)
    assert np.array_equal(np.random.get_state()[1], state[1]), "generation must restore numpy's global RNG"
    assert (d.num_classes, d.input_shape, d.task) == (10, (1, 40), "classification")
    x, y = d.train.tensors
    assert x.shape == (160, 1, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x[:, 0], torch.as_tensor(ref["x"], dtype=torch.float32))
    assert torch.equal(y, torch.as_tensor(ref["y"]))
    assert torch.equal(d.test.tensors[1], torch.as_tensor(ref["y_test"]))

    cached = list((tmp_path / "xdg" / "staleopt").glob("mnist1d-*.npz"))
    assert len(cached) == 1 and d.info["cache"] == str(cached[0])

    import mnist1d.data
    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda *a, **k: pytest.fail("cache not used"))
    again = data.load("mnist1d", num_samples=200)
    assert torch.equal(again.train.tensors[0], x) and torch.equal(again.test.tensors[0], d.test.tensors[0])


def test_mnist1d_cache_is_keyed_by_arguments(tmp_path):
    a = data.load("mnist1d", num_samples=100)
    b = data.load("mnist1d", num_samples=100, seed=7)
    assert len(list((tmp_path / "xdg" / "staleopt").glob("mnist1d-*.npz"))) == 2
    assert not torch.equal(a.train.tensors[0], b.train.tensors[0])
    c = data.load("mnist1d", num_samples=100, final_seq_length=20, cache=False)
    assert c.input_shape == (1, 20) and c.train.tensors[0].shape == (80, 1, 20)


def test_mnist1d_bad_arguments():
    with pytest.raises(ConfigError, match="num_sample.*allowed.*num_samples"):
        data.load("mnist1d", num_sample=100)
    with pytest.raises(ConfigError, match="unknown dataset 'mnist'.*mnist1d"):
        data.load("mnist")


# --------------------------------------------------------------------------------- CIFAR

def _write_cifar(root, name, n_per_file=4, seed=0):
    """Files in torchvision's on-disk layout, with random pixels: pickled dicts of uint8 rows."""
    rng = np.random.default_rng(seed)
    folder = root / data.CIFAR_FOLDERS[name]
    folder.mkdir(parents=True)
    label_key, classes = ("labels", 10) if name == "cifar10" else ("fine_labels", 100)
    files = ([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if name == "cifar10"
             else ["train", "test"])
    written = {}
    for f in files:
        n = n_per_file * (5 if name == "cifar100" and f == "train" else 1)
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 label_key: rng.integers(0, classes, n).tolist()}
        written[f] = batch
        with open(folder / f, "wb") as fh:
            pickle.dump(batch, fh)
    meta = ("batches.meta", "label_names") if name == "cifar10" else ("meta", "fine_label_names")
    with open(folder / meta[0], "wb") as fh:
        pickle.dump({meta[1]: [f"class{i}" for i in range(classes)]}, fh)
    return written


def test_cifar10_loads_written_files_through_torchvision(tmp_path):
    import torchvision
    written = _write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False, augment=False)
    assert isinstance(d.train, torchvision.datasets.CIFAR10)
    assert (len(d.train), len(d.test), d.num_classes, d.input_shape) == (20, 4, 10, (3, 32, 32))
    rows = np.concatenate([written[f"data_batch_{i}"]["data"] for i in range(1, 6)])  # N x 3072, CHW rows
    labels = sum((written[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])
    chw = rows.reshape(-1, 3, 32, 32).astype(np.float64) / 255
    mean = chw.mean(axis=(0, 2, 3))
    std = chw.std(axis=(0, 2, 3))
    for i in (0, 7, 19):
        x, y = d.train[i]
        want = (chw[i] - mean[:, None, None]) / std[:, None, None]
        assert y == labels[i]
        assert np.allclose(x.numpy(), want, atol=1e-5)
    x0, y0 = d.test[0]
    assert y0 == written["test_batch"]["labels"][0]
    assert np.allclose(x0.numpy(), (written["test_batch"]["data"][0].reshape(3, 32, 32) / 255
                                    - mean[:, None, None]) / std[:, None, None], atol=1e-5)


def test_cifar_augmentation_is_crop_and_flip_and_seeded(tmp_path):
    _write_cifar(tmp_path, "cifar10")
    plain = data.load("cifar10", root=tmp_path, verify=False, augment=False)
    aug = data.load("cifar10", root=tmp_path, verify=False)
    base = plain.train[3][0]
    zero = (0 - torch.tensor(aug.info["mean"])) / torch.tensor(aug.info["std"])  # a padded pixel
    padded = torch.where(torch.ones(3, 40, 40, dtype=torch.bool), zero[:, None, None], 0.0).clone()
    padded[:, 4:36, 4:36] = base
    crops = {(dy, dx, f): (padded[:, dy:dy + 32, dx:dx + 32].flip(-1) if f else padded[:, dy:dy + 32, dx:dx + 32])
             for dy in range(9) for dx in range(9) for f in (0, 1)}
    torch.manual_seed(5)
    first = [aug.train[3][0] for _ in range(6)]
    torch.manual_seed(5)
    second = [aug.train[3][0] for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for x in first:  # every augmented sample is one of the 162 crops/flips of the padded image
        assert any(torch.allclose(x, c, atol=1e-5) for c in crops.values())
    assert len({tuple(x.flatten()[:50].tolist()) for x in first}) > 1


def test_cifar100_layout(tmp_path):
    written = _write_cifar(tmp_path, "cifar100")
    d = data.load("cifar100", root=tmp_path, verify=False)
    assert (len(d.train), len(d.test), d.num_classes) == (20, 4, 100)
    assert d.test[2][1] == written["test"]["fine_labels"][2]


def test_cifar_missing_files_say_where_and_how(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"cifar-10-batches-py.*download=True \(--download"):
        data.load("cifar10", root=tmp_path)
    monkeypatch.setenv("STALEOPT_DATA", str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match="elsewhere.*cifar-100-python"):
        data.load("cifar100")


def test_cifar_verification_rejects_foreign_files(tmp_path):
    _write_cifar(tmp_path, "cifar10")
    with pytest.raises(DataError, match="verify=False"):
        data.load("cifar10", root=tmp_path)  # md5s differ from the official archive's


# --------------------------------------------------------------------------------- synthetic

def test_synthetic_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = data.load("synthetic", num_samples=50, num_classes=3, input_shape=(4,), seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    b = data.load("synthetic", num_samples=50, num_classes=3, input_shape=(4,), seed=1)
    c = data.load("synthetic", num_samples=50, num_classes=3, input_shape=(4,), seed=2)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0]) and torch.equal(a.test.tensors[1], b.test.tensors[1])
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])
    assert a.train.tensors[0].shape == (40, 4) and a.task == "classification" and a.num_classes == 3
    assert set(a.train.tensors[1].tolist()) <= {0, 1, 2}


def test_synthetic_classes_are_separated_gaussians():
    d = data.load("synthetic", num_samples=4000, num_classes=2, input_shape=(8,), separation=3.0, noise=0.5)
    x, y = d.train.tensors
    m0, m1 = x[y == 0].mean(0), x[y == 1].mean(0)
    assert (x[y == 0] - m0).std().item() == pytest.approx(0.5, rel=0.05)
    assert (m0 - m1).norm().item() > 5  # means ~ N(0, 9 I) in 8 dims: distance ~ 12


def test_synthetic_regression_is_a_noisy_linear_map():
    d = data.load("synthetic", task="regression", num_samples=3000, num_classes=2, input_shape=(1, 5),
                  noise=0.1, train_split=0.5)
    assert d.task == "regression" and d.input_shape == (1, 5)
    x, y = d.train.tensors
    assert y.shape == (1500, 2) and y.dtype == torch.float32
    w = torch.linalg.lstsq(x.flatten(1).double(), y.double()).solution
    resid = y.double() - x.flatten(1).double() @ w
    assert resid.std().item() == pytest.approx(0.1, rel=0.1)


def test_synthetic_bad_arguments():
    with pytest.raises(ConfigError, match="'regresion'"):
        data.load("synthetic", task="regresion")
    with pytest.raises(ConfigError, match="unknown argument.*classes.*allowed.*num_classes"):
        data.load("synthetic", classes=3)


# --------------------------------------------------------------------------------- batching

def test_batches_cover_the_data_once_and_follow_the_generator():
    ds = TensorDataset(torch.arange(10).float()[:, None], torch.arange(10))
    seen = [y for _, yb in data.batches(ds, 3) for y in yb.tolist()]
    assert seen == list(range(10))
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    a = [yb.tolist() for _, yb in data.batches(ds, 4, shuffle=True, generator=g1)]
    b = [yb.tolist() for _, yb in data.batches(ds, 4, shuffle=True, generator=g2)]
    assert a == b and sorted(sum(a, [])) == list(range(10)) and [len(x) for x in a] == [4, 4, 2]
    assert sum(a, []) == torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    assert [len(yb) for _, yb in data.batches(ds, 4, drop_last=True)] == [4, 4]


def test_batches_of_a_map_dataset_equal_the_tensor_path():
    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 7

        def __getitem__(self, i):
            return torch.tensor([float(i)]), i

    tensors = TensorDataset(torch.arange(7).float()[:, None], torch.arange(7))
    fast = list(data.batches(tensors, 3, shuffle=True, generator=torch.Generator().manual_seed(1)))
    slow = list(data.batches(Plain(), 3, shuffle=True, generator=torch.Generator().manual_seed(1)))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fast, slow))
