"""The wrapper inside the real trainers, where they are installed (they are not test dependencies: each test skips
without its package): Lightning, the Hugging Face Trainer and Accelerate each train bit for bit as the loop they
stand for, written by hand, with gradient accumulation, gradient clipping and an lr scheduler; a Lightning run
resumed from its checkpoint ends as the uninterrupted one. (tests/test_engine_trainers.py recreates, without the
packages, the ways trainers once made the wrapper fail.)"""
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import staleopt

ACC, CLIP, EPOCHS, BATCH = 2, 0.5, 2, 16  # 96 samples: 6 batches, 3 steps per epoch
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(96, 10, generator=g), torch.randint(0, 3, (96,), generator=g)


def net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def wrap(model, base=None):
    base = base or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return staleopt.PipelineOptimizer(model, base, stages=3, schedule="pipemare")


def by_hand(model, lr_lambda=None, per_epoch=False):
    """The loop the trainers stand for: ACC microbatches of BATCH per step (loss / ACC), the gradient clipped
    to norm CLIP, then the step; an lr scheduler stepped after every step, or every epoch."""
    opt = wrap(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for _ in range(EPOCHS):
        for k in range(0, len(X), BATCH * ACC):
            opt.zero_grad()
            for j in range(k, k + BATCH * ACC, BATCH):
                (F.cross_entropy(model(X[j:j + BATCH]), Y[j:j + BATCH]) / ACC).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            if sched and not per_epoch:
                sched.step()
        if sched and per_epoch:
            sched.step()
    assert opt.step_count == EPOCHS * len(X) // (BATCH * ACC)
    return [p.detach().clone() for p in model.parameters()]


def same(model, weights):
    return all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def _lightning():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self, scheduled=True):
            super().__init__()
            self.net, self.scheduled = net(), scheduled

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):  # the wrapper wraps the LightningModule itself
            self.opt = wrap(self)
            if not self.scheduled:
                return self.opt
            return {"optimizer": self.opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(self.opt, halve)}

    def trainer(epochs, **kw):
        kw = {"enable_checkpointing": False, **kw}
        return L.Trainer(max_epochs=epochs, accumulate_grad_batches=ACC, gradient_clip_val=CLIP, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1, **kw)
    return Module, trainer


def halve(epoch):
    return 0.5 ** epoch


def test_lightning_trains_as_the_loop_by_hand():
    Module, trainer = _lightning()
    module = Module()
    trainer(EPOCHS).fit(module, DataLoader(TensorDataset(X, Y), batch_size=BATCH))
    assert module.opt.step_count == 6 and module.opt.tau_fwd == [5, 3, 1]
    assert same(module.net, by_hand(net(), halve, per_epoch=True))  # (Lightning steps this scheduler per epoch)


def test_lightning_resumes_from_its_checkpoint_as_if_uninterrupted():
    Module, trainer = _lightning()
    loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH)
    straight = Module(scheduled=False)
    trainer(EPOCHS).fit(straight, loader)
    with tempfile.TemporaryDirectory() as d:
        first = Module(scheduled=False)
        t = trainer(1, default_root_dir=d)
        t.fit(first, loader)
        t.save_checkpoint(Path(d) / "last.ckpt")  # (the wrapper's history travels in its state_dict)
        resumed = Module(scheduled=False)
        trainer(EPOCHS).fit(resumed, loader, ckpt_path=Path(d) / "last.ckpt")
    assert resumed.opt.step_count == straight.opt.step_count == 6
    assert same(resumed, [p.detach() for p in straight.parameters()])


class _Pairs(Dataset):
    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return {"x": X[i], "labels": Y[i]}


class _HFNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = net()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.cross_entropy(out, labels), "logits": out}


def test_hugging_face_trainer_trains_as_the_loop_by_hand():
    pytest.importorskip("accelerate")  # (first: the Trainer needs it, and it imports faster)
    transformers = pytest.importorskip("transformers")

    class InOrder(transformers.Trainer):  # (the loop by hand reads the batches in order)
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = _HFNet()
    opt = wrap(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, halve)
    with tempfile.TemporaryDirectory() as d:
        args = transformers.TrainingArguments(output_dir=d, per_device_train_batch_size=BATCH,
                                              gradient_accumulation_steps=ACC, max_grad_norm=CLIP,
                                              num_train_epochs=EPOCHS, report_to=[], save_strategy="no",
                                              logging_strategy="no", use_cpu=True, disable_tqdm=True)
        InOrder(model=model, args=args, train_dataset=_Pairs(), optimizers=(opt, sched)).train()
    assert opt.step_count == 6
    assert same(model.net, by_hand(net(), halve))  # (the Trainer steps the scheduler after every step)


def test_accelerate_trains_as_the_loop_by_hand():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACC)
    model = net()
    opt = wrap(model)
    prepared, wrapped, loader = accelerator.prepare(model, opt, DataLoader(TensorDataset(X, Y), batch_size=BATCH))
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(prepared):
                accelerator.backward(F.cross_entropy(prepared(x), y))
                accelerator.clip_grad_norm_(prepared.parameters(), CLIP)
                wrapped.step()
                wrapped.zero_grad()
    assert opt.step_count == 6
    assert same(model, by_hand(net()))
