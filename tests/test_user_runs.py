"""A user's own data through ``staleopt.train``: a run resumed mid-epoch equals the uninterrupted one on a map-style
dataset too, and what the data (not the method) gets wrong is named as such."""
import math

import pytest
import torch

from staleopt import checkpoint, data, models, train
from staleopt.errors import ConfigError, DataError


class Noisy(torch.utils.data.Dataset):
    """A map-style dataset with a random augmentation drawn from torch's global RNG."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.5 * torch.randn(self.x[i].shape), int(self.y[i])


def _noisy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return Noisy(x[:96], y[:96]), torch.utils.data.TensorDataset(x[96:], y[96:])


def test_a_run_resumed_mid_epoch_on_a_map_style_dataset_equals_the_uninterrupted_one(tmp_path):
    """torch's DataLoader drew its base seed from the global RNG each pass: resumed mid-epoch (the global RNG
    restored first), the augmentation ran one draw off (train loss 0.6327 against 0.6353, silently)."""
    data.register("noisy-resume", _noisy, replace=True)
    cfg = dict(model="mlp", data="noisy-resume", epochs=2, batch_size=16, lr=0.05)
    ref = train.run(cfg)
    saver = checkpoint.Checkpoint(tmp_path / "c.ckpt", every=3, keep=True)
    save = saver.save

    def killed(state):
        save(state)
        if state["batch"] == 3:
            raise KeyboardInterrupt
    saver.save = killed
    with pytest.raises(KeyboardInterrupt):
        train.run(cfg, checkpoint=saver)
    res = train.run(cfg, checkpoint=checkpoint.Checkpoint(tmp_path / "c.ckpt", every=3))
    assert res.attrs["resumed_at_step"] == 3
    cols = ["epoch", "step", "train_loss", "test_loss", "test_acc"]
    assert ref[cols].equals(res[cols])


def test_what_the_data_gets_wrong_is_not_recorded_as_the_method_diverging():
    """A NaN in the first batch ended the run as "diverged" at step 0; uint8 images gave a raw dtype error at the first
    step; a model factory missing a required argument a raw TypeError; --device cuda without a GPU a raw error."""
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    nan = x.clone()
    nan[:, 0] = math.nan
    data.register("nan-first", lambda: (torch.utils.data.TensorDataset(nan, y), torch.utils.data.TensorDataset(x, y)),
                  replace=True)
    with pytest.raises(DataError, match="first training loss is nan before any update.*inputs hold NaN"):
        train.run(dict(model="mlp", data="nan-first", epochs=1, batch_size=16))
    images = (torch.rand(64, 8) * 255).to(torch.uint8)
    data.register("uint8", lambda: (torch.utils.data.TensorDataset(images, y),) * 2, replace=True)
    with pytest.raises(DataError, match=r"torch.uint8 inputs.*x.float\(\) / 255"):
        train.run(dict(model="mlp", data="uint8", epochs=1, batch_size=16))
    models.register("needs-width", lambda width, num_classes=2: torch.nn.Linear(8, width), replace=True)
    with pytest.raises(ConfigError, match=r"needs the argument\(s\) \['width'\].*model-kwargs"):
        models.get("needs-width")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device.*--device cpu"):
            train.run(dict(model="mlp", data="nan-first", epochs=1, batch_size=16, device="cuda"))
