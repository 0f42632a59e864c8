"""Datasets: MNIST-1D generation and cache, CIFAR through torchvision's real loader, synthetic data, batching."""
import math
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

def write_cifar(root, name, n_per_file=4, seed=0, images=None):
    """Files as in the official python archive (Python 2 pickles, protocol 2): a dict per batch with
    ``data`` (N x 3072 uint8 rows, channel-major), labels, ``batch_label`` and ``filenames``.

    ``images`` (N x 3 x 32 x 32 uint8) fill the training batches in order instead of random pixels.
    """
    rng = np.random.default_rng(seed)
    folder = root / data.CIFAR_FOLDERS[name]
    folder.mkdir(parents=True)
    label_key, classes = ("labels", 10) if name == "cifar10" else ("fine_labels", 100)
    train_files = [f"data_batch_{i}" for i in range(1, 6)] if name == "cifar10" else ["train"]
    files = train_files + (["test_batch"] if name == "cifar10" else ["test"])
    written = {}
    for f in files:
        n = n_per_file * (5 if name == "cifar100" and f == "train" else 1)
        rows = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        if images is not None and f in train_files:
            k = train_files.index(f) * n
            rows = np.asarray(images[k:k + n], dtype=np.uint8).reshape(n, 3072)
        batch = {"batch_label": f"{f} of {len(files)}", "data": rows,
                 label_key: rng.integers(0, classes, n).tolist(), "filenames": [f"img_{f}_{i}.png" for i in range(n)]}
        written[f] = batch
        with open(folder / f, "wb") as fh:
            pickle.dump(batch, fh, protocol=2)
    meta = ("batches.meta", "label_names") if name == "cifar10" else ("meta", "fine_label_names")
    with open(folder / meta[0], "wb") as fh:
        pickle.dump({meta[1]: [f"class{i}" for i in range(classes)]}, fh, protocol=2)
    return written


def _train_rows(written):
    rows = np.concatenate([written[f"data_batch_{i}"]["data"] for i in range(1, 6)])  # N x 3072, CHW rows
    return rows, sum((written[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])


def test_cifar10_keeps_the_files_as_uint8_tensors_and_normalizes_batches(tmp_path):
    written = write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False, augment=False)
    assert isinstance(d.train, data.ImageTensors) and isinstance(d.test, data.ImageTensors)
    assert (len(d.train), len(d.test), d.num_classes, d.input_shape) == (20, 4, 10, (3, 32, 32))
    rows, labels = _train_rows(written)
    assert d.train.images.dtype == torch.uint8 and d.train.images.shape == (20, 3, 32, 32)
    assert torch.equal(d.train.images, torch.from_numpy(rows).view(20, 3, 32, 32))
    assert d.train.targets.tolist() == labels and d.train.targets.dtype == torch.int64
    chw = rows.reshape(-1, 3, 32, 32).astype(np.float64) / 255
    mean, std = chw.mean(axis=(0, 2, 3)), chw.std(axis=(0, 2, 3))
    assert np.allclose(d.info["mean"], mean, rtol=1e-12) and np.allclose(d.info["std"], std, rtol=1e-12)
    x, y = next(data.batches(d.train, 20))
    assert x.dtype == torch.float32 and x.shape == (20, 3, 32, 32) and y.tolist() == labels
    assert np.allclose(x.numpy(), (chw - mean[:, None, None]) / std[:, None, None], atol=1e-5)
    x0, y0 = d.test[0]
    assert y0 == written["test_batch"]["labels"][0]
    assert np.allclose(x0.numpy(), (written["test_batch"]["data"][0].reshape(3, 32, 32) / 255
                                    - mean[:, None, None]) / std[:, None, None], atol=1e-5)


def _reference(dataset, i, params):
    """Sample ``i`` through the per-sample PIL path the tensors replace: torchvision's RandomCrop(32, padding=4)
    and RandomHorizontalFlip with their random draws fixed to ``params = (dy, dx, flip)``, ToTensor, Normalize."""
    from PIL import Image
    from torchvision.transforms import functional as TF
    img = Image.fromarray(dataset.images[i].permute(1, 2, 0).numpy())
    dy, dx, flip = params.tolist()
    img = TF.crop(TF.pad(img, 4), dy, dx, 32, 32)
    if flip:
        img = TF.hflip(img)
    return TF.normalize(TF.to_tensor(img), dataset.mean, dataset.std)


def test_batched_crop_and_flip_equal_torchvisions_per_sample_transforms(tmp_path):
    write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False)
    params = torch.tensor([[dy, dx, f] for dy in (0, 3, 4, 8) for dx in (0, 5, 8) for f in (0, 1)])
    idx = torch.arange(len(params)) % len(d.train)
    x, y = d.train.take(idx, params)
    assert x.shape == (len(params), 3, 32, 32) and torch.equal(y, d.train.targets[idx])
    for k in range(len(params)):
        assert torch.equal(x[k], _reference(d.train, int(idx[k]), params[k])), params[k].tolist()


def test_augmented_batches_follow_the_generator_and_vary(tmp_path):
    write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False)

    def epoch(seed, **kw):
        return list(data.batches(d.train, 8, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw))

    a, b, c = epoch(3), epoch(3), epoch(4)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], c[0][0])
    # the order is drawn first, then one augmentation per position of the pass
    g = torch.Generator().manual_seed(3)
    order = torch.randperm(20, generator=g)
    params = d.train.draw(20, g)
    assert params.shape == (20, 3) and set(params[:, 2].tolist()) <= {0, 1}
    assert torch.equal(torch.cat([x for x, _ in a]), d.train.take(order, params)[0])
    # a pass resumed at batch 1 yields the rest of the same pass and leaves the generator where a full pass does
    g_full, g_part = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    full = list(data.batches(d.train, 8, shuffle=True, generator=g_full))
    part = list(data.batches(d.train, 8, shuffle=True, generator=g_part, start=1))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(full[1:], part)) and len(part) == 2
    assert torch.equal(g_full.get_state(), g_part.get_state())
    # the same image is augmented differently from one pass to the next (the generator moves on)
    g = torch.Generator().manual_seed(0)
    views = [next(data.batches(d.train, 20, generator=g))[0][5] for _ in range(6)]
    assert len({tuple(v.flatten().tolist()) for v in views}) > 1
    assert not d.test.augment and d.test.draw(4, g) is None


def test_value_ranges_and_padding(tmp_path):
    write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False)
    mean, std = torch.tensor(d.info["mean"])[:, None, None], torch.tensor(d.info["std"])[:, None, None]
    x, _ = next(data.batches(d.train, 20, generator=torch.Generator().manual_seed(1)))
    pixels = (x * std + mean) * 255  # back to the uint8 scale
    assert torch.allclose(pixels, pixels.round(), atol=1e-3) and pixels.min() > -1e-3 and pixels.max() < 255 + 1e-3
    # a crop at the corner (0, 0) shows 4 rows and 4 columns of zero padding
    x, _ = d.train.take(torch.tensor([2]), torch.tensor([[0, 0, 0]]))
    zero = (0 - mean) / std
    assert torch.allclose(x[0, :, :4, :], zero.expand(3, 4, 32))
    assert torch.allclose(x[0, :, :, :4], zero.expand(3, 32, 4))
    assert torch.equal(x[0, :, 4:, 4:], d.train.take(torch.tensor([2]))[0][0, :, :28, :28])  # the rest: the image


def test_crop_offsets_and_flips_are_uniform_and_independent(tmp_path):
    """Each pixel of the written images encodes its position (row + 1, column + 1): every augmented output tells
    which crop and flip made it. Over 12,000 draws, each of the 9 offsets per axis and each flip turn up with
    their probabilities (1/9, 1/2) within 5 standard deviations, also jointly (81 offset pairs)."""
    r, c = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    image = np.stack([r + 1, c + 1, np.zeros_like(r)]).astype(np.uint8)
    write_cifar(tmp_path, "cifar10", n_per_file=40, images=np.repeat(image[None], 200, axis=0))
    d = data.load("cifar10", root=tmp_path, verify=False)
    mean, std = torch.tensor(d.info["mean"])[:, None, None], torch.tensor(d.info["std"])[:, None, None]
    g = torch.Generator().manual_seed(0)
    found = []
    for _ in range(60):
        for x, _ in data.batches(d.train, 50, shuffle=True, generator=g):
            px = ((x * std + mean) * 255).round().long()
            rows, cols = px[:, 0, 16, 16], px[:, 1, 16, 16]  # the centre always shows the image
            flip = px[:, 1, 16, 17] < cols
            dy = rows - 1 + 4 - 16
            dx = torch.where(flip, cols - 32 + 4 + 16, cols - 1 + 4 - 16)
            found.append(torch.stack([dy, dx, flip.long()], 1))
    found = torch.cat(found)
    n = len(found)
    assert n == 12000 and found[:, :2].min() >= 0 and found[:, :2].max() <= 8

    def within(counts, p):
        sigma = (n * p * (1 - p)) ** 0.5
        assert (counts.double() - n * p).abs().max() < 5 * sigma, (counts.tolist(), n * p)

    within(torch.bincount(found[:, 0], minlength=9), 1 / 9)
    within(torch.bincount(found[:, 1], minlength=9), 1 / 9)
    within(torch.bincount(found[:, 2], minlength=2), 1 / 2)
    within(torch.bincount(found[:, 0] * 9 + found[:, 1], minlength=81), 1 / 81)
    within(torch.bincount(found[:, 0] * 2 + found[:, 2], minlength=18), 1 / 18)


def test_a_sample_by_index_is_augmented_with_the_global_rng(tmp_path):
    write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False)
    torch.manual_seed(5)
    first = [d.train[3] for _ in range(6)]
    torch.manual_seed(5)
    params = [d.train.draw(1)[0] for _ in range(6)]
    for k, (x, y) in enumerate(first):
        assert y == int(d.train.targets[3]) and torch.equal(x, _reference(d.train, 3, params[k]))
    assert len({tuple(p.tolist()) for p in params}) > 1


def test_data_moves_to_a_device_and_batches_stay_there(tmp_path):
    write_cifar(tmp_path, "cifar10")
    d = data.load("cifar10", root=tmp_path, verify=False)
    assert d.to("cpu") is d
    moved = d.to("meta")  # a device without data: only where the tensors live and their shapes are checked
    assert moved.train.images.device.type == "meta" and moved.test.targets.device.type == "meta"
    assert moved.train.augment and not moved.test.augment and d.train.images.device.type == "cpu"
    x, y = next(data.batches(moved.train, 8, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert x.device.type == "meta" and x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (8,)
    syn = data.load("synthetic", num_samples=20).to("meta")
    assert all(t.device.type == "meta" for t in syn.train.tensors)
    x, _ = next(data.batches(syn.train, 4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert x.device.type == "meta"


def test_image_tensors_reject_bad_inputs():
    good = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(DataError, match="uint8 tensor N x C x H x W.*float32"):
        data.ImageTensors(good.float(), torch.zeros(4), (0.5,) * 3, (0.2,) * 3)
    with pytest.raises(DataError, match="4 images but 3 targets"):
        data.ImageTensors(good, torch.zeros(3), (0.5,) * 3, (0.2,) * 3)
    with pytest.raises(DataError, match="one value per channel \\(3\\)"):
        data.ImageTensors(good, torch.zeros(4), (0.5,), (0.2,))
    with pytest.raises(ConfigError, match="padding = -1 must be an int >= 0"):
        data.ImageTensors(good, torch.zeros(4), (0.5,) * 3, (0.2,) * 3, padding=-1)


def test_cifar100_layout(tmp_path):
    written = write_cifar(tmp_path, "cifar100")
    d = data.load("cifar100", root=tmp_path, verify=False)
    assert (len(d.train), len(d.test), d.num_classes) == (20, 4, 100)
    assert int(d.test.targets[2]) == written["test"]["fine_labels"][2] and d.test[2][1] == int(d.test.targets[2])


def test_cifar_missing_files_say_where_and_how(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"cifar-10-batches-py.*set \$STALEOPT_DATA.*download=True \(--download"):
        data.load("cifar10", root=tmp_path)
    monkeypatch.setenv("STALEOPT_DATA", str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match="elsewhere.*cifar-100-python"):
        data.load("cifar100")


def test_cifar_verification_rejects_foreign_files(tmp_path):
    write_cifar(tmp_path, "cifar10")
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
    for name, bad in (("noise", -1.0), ("separation", -2.0), ("noise", math.nan)):  # (-1 acted as 1: a new run id)
        with pytest.raises(ConfigError, match=f"synthetic {name} is a standard deviation"):
            data.load("synthetic", **{name: bad})
    assert data.load("synthetic", noise=0.0, num_samples=10).train  # (noiseless data is allowed)
    import numpy as np  # (NumPy numbers, as a generated sweep passes them, were refused as "not a number")
    assert data.load("synthetic", noise=np.int64(1), separation=np.float32(0.5), num_samples=10).train
    with pytest.raises(ConfigError, match="'regresion'"):  # (the task is known before loading: same check)
        data.task("synthetic", task="regresion")


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


def _rewrite(path, **changes):
    with open(path, "rb") as fh:
        batch = pickle.load(fh, encoding="latin1")
    batch.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del batch[key]
    with open(path, "wb") as fh:
        pickle.dump(batch, fh, protocol=2)


@pytest.mark.parametrize("change, message", [
    ({"labels": [1, 2, 3, 4, 5, 6]}, "holds 4 images but 6 'labels'"),  # (another file then has 2: shifted labels)
    ({"labels": [1, 2, 3, 42]}, r"'labels' outside 0..9 \(e.g. 42\)"),
    ({"labels": [1.7, 2, 3, 1]}, "'labels' are not all integers"),
    ({"labels": None}, "has no 'labels' entry"),
])
def test_cifar_labels_that_do_not_match_their_images_are_refused(tmp_path, change, message):
    """A re-packed copy read with verify=False: each file's labels must be one int in range per image of that
    file (before, a file with 2 labels too many and the next with 2 too few loaded with every label shifted)."""
    write_cifar(tmp_path, "cifar10")
    _rewrite(tmp_path / data.CIFAR_FOLDERS["cifar10"] / "data_batch_1", **change)
    if len(change.get("labels") or []) == 6:
        _rewrite(tmp_path / data.CIFAR_FOLDERS["cifar10"] / "data_batch_2", labels=[7, 8])
    with pytest.raises(DataError, match=f"data_batch_1.*{message}|{message}"):
        data.load("cifar10", root=tmp_path, verify=False)


def test_cifar_switches_and_mnist1d_split_are_checked(tmp_path):
    write_cifar(tmp_path, "cifar10")
    with pytest.raises(ConfigError, match="augment must be true or false, got 'false'"):
        data.load("cifar10", root=tmp_path, verify=False, augment="false")
    for split in (1.0, 1.5, -0.5, 0.0):
        with pytest.raises(ConfigError, match="train_split must lie in"):
            data.load("mnist1d", num_samples=100, train_split=split, cache=False)


def test_samples_that_are_not_an_input_target_pair_are_refused_naming_the_fix():
    """A dict sample (the Hugging Face datasets style), a triple or a TensorDataset of three tensors failed with a
    bare TypeError (the dict's keys unpacked as x and y) or 'too many values to unpack'."""
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.randn(3), "y": i % 2}

    pairs = TensorDataset(torch.randn(4, 3), torch.arange(4) % 2)
    with pytest.raises(DataError, match=r"first train sample is a dict with the keys \['x', 'y'\].*\(d\[i\]\['x'\]"):
        data.from_datasets(Dicts(), pairs)
    with pytest.raises(DataError, match="first test sample is a tuple of 3 fields.*exactly two tensors"):
        data.from_datasets(pairs, TensorDataset(torch.randn(4, 3), torch.arange(4) % 2, torch.ones(4)))
    # an integer label of shape (1,) reads as a one-token sequence: told to squeeze it, or to say task='lm'
    column = TensorDataset(torch.randn(4, 3), (torch.arange(4) % 2)[:, None])
    with pytest.raises(DataError, match=r"shape \(1,\).*one-token sequence.*y.squeeze\(-1\)"):
        data.from_datasets(column, column)
    assert data.from_datasets(column, column, task="lm").task == "lm"
    assert data.from_datasets(pairs, pairs).task == "classification"


def test_float64_inputs_and_negative_labels_are_named_when_the_data_loads():
    """numpy samples are float64 unless made otherwise: torch's bare dtype mismatch came from the first matmul;
    labels -1/+1 gave num_classes = 2 and a DataError about a num_classes the user never declared."""
    x = np.random.default_rng(0).normal(size=(8, 3))
    ok = [(x[i].astype(np.float32), i % 2) for i in range(8)]
    assert data.from_datasets(ok, ok).num_classes == 2
    wide = [(x[i], i % 2) for i in range(8)]
    with pytest.raises(DataError, match="float64.*astype"):
        data.from_datasets(wide, wide)
    signs = [(x[i].astype(np.float32), 1 if i % 2 else -1) for i in range(8)]
    with pytest.raises(DataError, match="a label is -1.*0..C-1"):
        data.from_datasets(signs, signs)
    padded = [(torch.arange(4), torch.tensor([1, 2, -100, 3])) for _ in range(3)]  # -100: left out, not a label
    assert data.from_datasets(padded, padded).num_classes == 4


def test_a_cifar_copy_written_at_pickle_protocol_5_loads(tmp_path, monkeypatch):
    """numpy pickles a contiguous array at protocol 5 (pickle.HIGHEST_PROTOCOL; Python 3.14's default) through
    numpy's _frombuffer, which the unpickler's allow-list refused as "not a CIFAR data file"."""
    written = []
    real = pickle.dump
    monkeypatch.setattr(pickle, "dump", lambda obj, fh, protocol=None: written.append(real(obj, fh, protocol=5)))
    write_cifar(tmp_path, "cifar10")
    monkeypatch.setattr(pickle, "dump", real)
    assert written
    d = data.load("cifar10", root=tmp_path, verify=False)
    assert len(d.train) and len(d.test)


def test_user_data_is_checked_in_both_splits_and_named_where_it_is_wrong():
    """A float64 or differently shaped test split trained an epoch and then crashed in evaluation with a raw torch
    error; a PIL image gave "Could not infer dtype of Image"; a factory missing a required argument a raw TypeError."""
    x, y = torch.randn(20, 5), torch.randint(0, 2, (20,))
    with pytest.raises(DataError, match="test inputs are torch.float64.*astype"):
        data.from_datasets(TensorDataset(x, y), TensorDataset(x.double(), y))
    with pytest.raises(DataError, match=r"first test input is torch.float32 of shape \(6,\).*same preprocessing"):
        data.from_datasets(TensorDataset(x, y), TensorDataset(torch.randn(20, 6), y))

    class Pictures(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            from PIL import Image
            return Image.new("L", (4, 4)), 0
    with pytest.raises(DataError, match="input is a Image, not an array of numbers.*ToTensor"):
        data.from_datasets(Pictures(), Pictures())
    data.register("needs-n", lambda n: (TensorDataset(x[:n], y[:n]), TensorDataset(x, y)), replace=True)
    with pytest.raises(ConfigError, match=r"needs the argument\(s\) \['n'\].*data-kwargs"):
        data.load("needs-n")


def _pair(n=40, k=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 1, 8, generator=g).to(dtype)
    y = torch.arange(2 * n) % k
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def test_a_relative_file_spec_names_the_file_of_the_working_directory(tmp_path, monkeypatch):
    """The factories of file specs were cached under the spec as written: after os.chdir the same relative spec
    kept the first folder's file (its data and its model)."""
    from staleopt import models
    src = ("import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n"
           "def make():\n    x = torch.randn(80, 1, 8, generator=torch.Generator().manual_seed(0))\n"
           "    y = torch.arange(80) % {k}\n    return TensorDataset(x[:40], y[:40]), TensorDataset(x[40:], y[40:])\n"
           "def net(num_classes, input_shape):\n    return nn.Sequential(nn.Flatten(), nn.Linear({w}, num_classes))\n")
    seen = []
    for folder, k, w in (("a", 3, 8), ("b", 7, 16)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "mydata.py").write_text(src.format(k=k, w=w))
        monkeypatch.chdir(tmp_path / folder)
        seen.append((data.load("mydata.py:make").num_classes, data.shape("mydata.py:make")[0],
                     models.get("mydata.py:net", num_classes=k, input_shape=(1, 8))[1].in_features))
    assert seen == [(3, 3, 8), (7, 7, 16)]


def test_a_users_factory_keeps_its_own_root_and_download_defaults(tmp_path):
    """load() passed root=None and download=False to every factory that takes them, over its own defaults."""
    got = {}

    def make(root=str(tmp_path), download=True, n=40):
        got.update(root=root, download=download)
        return _pair(n)
    data.register("own-root", make)
    try:
        data.load("own-root")
        assert got == {"root": str(tmp_path), "download": True}
        data.load("own-root", root="elsewhere")
        assert got == {"root": "elsewhere", "download": True}
    finally:
        data._USER.pop("own-root")


def test_user_data_mistakes_are_refused_or_warned():
    """The test split being the training split (silent: warned), string labels (a raw TypeError), float class labels
    (trained as a regression without a word: warned), and a Data with a misspelled task or float64 inputs (failed
    inside torch)."""
    train, test = _pair()
    with pytest.warns(UserWarning, match="the test split is the training split"):
        data.from_datasets(train, train)
    with pytest.warns(UserWarning, match="the test split is the training split"):
        data.from_datasets(train, TensorDataset(*train.tensors))
    with pytest.raises(DataError, match=r"the first train target is a str .*map names to 0..C-1"):
        data.from_datasets([(torch.zeros(3), "cat")], [(torch.zeros(3), "dog")])
    floats = TensorDataset(train.tensors[0], train.tensors[1].float())
    with pytest.warns(UserWarning, match="they read as class labels"):
        assert data.from_datasets(floats, TensorDataset(test.tensors[0], test.tensors[1].float())).task == "regression"
    onehot = TensorDataset(train.tensors[0], torch.nn.functional.one_hot(train.tensors[1], 3).float())
    with pytest.warns(UserWarning, match="they read as class labels"):
        data.from_datasets(onehot, TensorDataset(test.tensors[0], torch.randn(40, 3)))
    values = TensorDataset(train.tensors[0], torch.randn(40))  # (regression values: no warning)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.from_datasets(values, TensorDataset(test.tensors[0], torch.randn(40)))
    for d, says in ((data.Data("typo", train, test, 3, (1, 8), "classfication"), "task must be"),
                    (data.Data("f64", *_pair(dtype=torch.float64), 3, (1, 8), "classification"), "float64"),
                    (data.Data("shape", train, test, 3, (1, 9), "classification"), r"input_shape = \(1, 9\)")):
        data.register("returns-data", lambda d=d: d)
        try:
            with pytest.raises((ConfigError, DataError), match=says):
                data.load("returns-data")
        finally:
            data._USER.pop("returns-data")


@pytest.mark.parametrize("kwargs, says", [
    ({"input_shape": [1, 40.7]}, "input_shape size = 40.7 must be an int"),
    ({"input_shape": [True, 40]}, "input_shape size = True"),
    ({"input_shape": None}, "input_shape must be a non-empty list"),
    ({"num_samples": 20, "train_split": 0.02}, "leave samples on both sides"),
    ({"seed": None}, "seed = None must be an int"),
    ({"num_classes": None}, "num_classes = None"),
])
def test_synthetic_options_are_checked(kwargs, says):
    """They were cast with int() ([1, 40.7] trained on (1, 40) under another run id), an empty training split was
    accepted, None was a raw TypeError."""
    with pytest.raises(ConfigError, match=says):
        data.load("synthetic", **kwargs)


def test_mnist1d_num_samples_is_a_multiple_of_10(tmp_path, monkeypatch):
    """mnist1d makes num_samples // 10 per class: 29 trained on 20 (and its split check read 29)."""
    with pytest.raises(ConfigError, match="num_samples = 29 must be a multiple of 10.*use 20 or 30"):
        data.load("mnist1d", num_samples=29, cache=False)
