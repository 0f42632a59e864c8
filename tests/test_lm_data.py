"""Language-modelling data (task "lm"): token windows, the Markov source and its best loss, the corpora's files."""
import math

import pytest
import torch
from torch import nn

from staleopt import data, train
from staleopt.errors import ConfigError, DataError

SMALL = dict(vocab_size=5, order=3, support=2, context=8, train_tokens=3000, test_tokens=4000, seed=1)


class SourcePredictor(nn.Module):
    """Logits ``log P(y_t | x_0..x_t)`` of the Markov source, its short contexts computed from the stationary
    distribution of the *first* ``c + 1`` tokens of a state (the data module sums out the *earliest* tokens:
    the two agree only when ``pi`` is stationary)."""

    def __init__(self, d, context_limit=None):
        super().__init__()
        v, k = d.num_classes, d.info["order"]
        self.v, self.k = v, min(k, context_limit or k)  # context_limit: the best predictor knowing that many tokens
        p, pi = d.info["transition"], d.info["stationary"].view((v,) * k)
        self.tables = {k: p}
        for c in range(1, k):
            first = pi.sum(dim=tuple(range(c + 1, k))) if c + 1 < k else pi  # the first c + 1 tokens of a state
            joint = first.reshape(v ** c, v)
            self.tables[c] = joint / joint.sum(1, keepdim=True)

    def forward(self, x):
        out = []
        for t in range(x.shape[1]):
            c = min(t + 1, self.k)
            state = torch.zeros(len(x), dtype=torch.int64)
            for j in range(t + 1 - c, t + 1):
                state = state * self.v + x[:, j]
            out.append(torch.log(self.tables[c][state]))
        return torch.stack(out, 1)


def test_markov_windows_are_the_shifted_token_sequence():
    d = data.load("text-markov", **SMALL)
    assert (d.task, d.num_classes, d.input_shape) == ("lm", 5, (8,))
    x, y = d.train[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
    tokens = d.train.tokens.long()
    assert torch.equal(x, tokens[24:32]) and torch.equal(y, tokens[25:33])
    assert len(d.train) == (3000 - 9) // 8 + 1 and len(d.test) == (4000 - 9) // 8 + 1
    assert int(tokens.max()) < 5
    overlapping = data.load("text-markov", **{**SMALL, "stride": 1})
    assert len(overlapping.train) == 3000 - 8 and torch.equal(overlapping.train[24][0], x)
    assert len(overlapping.test) == len(d.test), "the test windows never overlap"


def test_markov_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = data.load("text-markov", **SMALL), data.load("text-markov", **SMALL)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.train.tokens, b.train.tokens) and a.best_loss == b.best_loss
    c = data.load("text-markov", **{**SMALL, "seed": 2})
    assert not torch.equal(a.train.tokens, c.train.tokens)


def test_the_chain_is_sparse_and_its_distribution_stationary():
    d = data.load("text-markov", **SMALL)
    p, pi, v, k = d.info["transition"], d.info["stationary"], 5, 3
    assert torch.allclose(p.sum(1), torch.ones(v ** k, dtype=torch.float64))
    assert ((p > 0.02 / v + 1e-12).sum(1) == 2).all(), "support 2 plus the uniform smoothing"
    after = torch.zeros_like(pi).index_add_(0, ((torch.arange(v ** k)[:, None] * v + torch.arange(v)) % v ** k)
                                            .flatten(), (pi[:, None] * p).flatten())
    assert torch.allclose(after, pi, atol=1e-13, rtol=0) and abs(float(pi.sum()) - 1) < 1e-12


def test_best_loss_is_the_loss_of_the_source_and_beats_weaker_predictors():
    d = data.load("text-markov", **SMALL)
    known = train._evaluate(SourcePredictor(d), d, torch.device("cpu"), "source")
    assert math.isclose(known["test_loss"], d.best_loss, rel_tol=1e-12)
    assert math.isclose(known["test_ppl"], math.exp(d.best_loss), rel_tol=1e-12)
    shorter = train._evaluate(SourcePredictor(d, context_limit=2), d, torch.device("cpu"), "source")
    assert shorter["test_loss"] > d.best_loss + 0.05, "the order-2 predictor of an order-3 source is worse"
    assert d.info["unigram_loss"] > shorter["test_loss"] + 0.05
    # the window's first positions know fewer tokens: the average sits above the entropy rate
    assert d.best_loss > d.info["entropy_rate"] - 0.05


def test_default_markov_source_leaves_room_to_learn():
    d = data.load("text-markov")
    assert (d.num_classes, d.input_shape, len(d.train), len(d.test)) == (16, (32,), 6249, 624)
    assert 0.5 < d.best_loss < 1.5 and d.info["unigram_loss"] > d.best_loss + 1.0


def test_markov_bad_arguments():
    with pytest.raises(ConfigError, match="smoothing = 0 must lie in"):
        data.load("text-markov", smoothing=0)
    with pytest.raises(ConfigError, match="support = 20 must be an int in 1..16"):
        data.load("text-markov", support=20)
    for vocab, order in ((256, 3), (2 ** 22, 1)):  # (a table of V^(k+1) entries: order 1 asked for 140 TB)
        with pytest.raises(ConfigError, match="entries, more than 2\\^22"):
            data.load("text-markov", vocab_size=vocab, order=order)
    with pytest.raises(ConfigError, match="test_tokens = 10 must be an int >= 33"):
        data.load("text-markov", test_tokens=10)
    with pytest.raises(ConfigError, match="unknown argument.*'vocab'"):
        data.load("text-markov", vocab=3)


def test_batches_of_windows_equal_the_windows_by_index():
    d = data.load("text-markov", **SMALL)
    g = torch.Generator().manual_seed(0)
    xs, ys = zip(*data.batches(d.train, 10, shuffle=True, generator=g, drop_last=True))
    order = torch.randperm(len(d.train), generator=torch.Generator().manual_seed(0))[:len(xs) * 10]
    assert torch.equal(torch.cat(xs), torch.stack([d.train[int(i)][0] for i in order]))
    assert torch.equal(torch.cat(ys), torch.stack([d.train[int(i)][1] for i in order]))
    assert d.train[-1][0].shape == (8,)
    with pytest.raises(IndexError):
        d.train[len(d.train)]


def test_task_is_known_without_loading():
    assert data.task("text-markov") == data.task("text-enwik8") == "lm"
    assert data.task("mnist1d") == "classification" and data.task("synthetic", task="regression") == "regression"


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. Ça va?\n" * 3


def test_tinyshakespeare_bytes_and_characters(tmp_path):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text(TEXT, encoding="utf-8")
    raw = TEXT.encode()
    d = data.load("text-shakespeare", root=tmp_path, context=16)
    assert (d.num_classes, d.input_shape, d.task, d.best_loss) == (256, (16,), "lm", None)
    cut = round(len(raw) * 0.9)
    assert bytes(d.train.tokens.tolist()) == raw[:cut] and bytes(d.test.tokens.tolist()) == raw[cut:]
    assert bytes(d.train[1][1].tolist()) == raw[17:33]
    c = data.load("text-shakespeare", root=tmp_path, context=16, level="char")
    chars = c.info["characters"]
    assert c.num_classes == len(set(TEXT)) and chars == "".join(sorted(set(TEXT)))
    assert "".join(chars[i] for i in torch.cat([c.train.tokens, c.test.tokens]).tolist()) == TEXT
    with pytest.raises(ConfigError, match="test_split = 'valid' must be 'test'"):
        data.load("text-shakespeare", root=tmp_path, test_split="valid")


def test_wikitext_reads_its_three_raw_files(tmp_path):
    folder = tmp_path / "wikitext-2-raw"
    folder.mkdir()
    parts = {"train": " = Valkyria = \n" * 20, "valid": " = Robert = \n" * 5, "test": " = Tower = \n é \n" * 5}
    for split, text in parts.items():
        (folder / f"wiki.{split}.raw").write_text(text, encoding="utf-8")
    d = data.load("text-wikitext2", root=tmp_path, context=8)
    assert bytes(d.train.tokens.tolist()) == parts["train"].encode()
    assert bytes(d.test.tokens.tolist()) == parts["test"].encode()
    v = data.load("text-wikitext2", root=tmp_path, context=8, test_split="valid")
    assert bytes(v.test.tokens.tolist()) == parts["valid"].encode()
    c = data.load("text-wikitext2", root=tmp_path, context=8, level="char")
    assert c.num_classes == len(set("".join(parts.values())))  # the test split's 'é' is in the vocabulary


def test_enwik8_is_cut_90_5_5(tmp_path):
    blob = bytes(range(256)) * 4 + b"\xff" * 976  # 2000 bytes, not all UTF-8
    (tmp_path / "enwik8").write_bytes(blob)
    d = data.load("text-enwik8", root=tmp_path, context=10)
    assert d.info["tokens"] == {"train": 1800, "valid": 100, "test": 100}
    assert bytes(d.test.tokens.tolist()) == blob[1900:]
    assert bytes(data.load("text-enwik8", root=tmp_path, context=10, test_split="valid").test.tokens.tolist()) \
        == blob[1800:1900]
    with pytest.raises(DataError, match="not UTF-8 text.*level='byte'"):
        data.load("text-enwik8", root=tmp_path, level="char")


def test_enwik8_characters_are_cut_where_its_bytes_are(tmp_path):
    """At ``level="char"`` the splits are the byte splits' stretches of the file, decoded (they were cut by
    characters: with multi-byte characters, other text); a cut inside a character moves past it."""
    blob = ("h\u00e9llo w\u00f6rld " * 25 + "\u20ac" * 200).encode("utf-8")  # 2 and 3 bytes a character
    (tmp_path / "enwik8").write_bytes(blob)
    c = data.load("text-enwik8", root=tmp_path, context=4, level="char")
    chars = c.info["characters"]
    def past(k):  # the cut moved past a character's continuation bytes
        return k if blob[k] & 0xC0 != 0x80 else past(k + 1)

    a, b = round(len(blob) * 0.9), round(len(blob) * (0.9 + 0.05))  # (the byte level's cuts, 855 and 903)
    assert past(a) == a + 2 and past(b) == b + 2  # (both fall inside a character)
    assert "".join(chars[i] for i in c.test.tokens.tolist()) == blob[b + 2:].decode("utf-8")
    valid = data.load("text-enwik8", root=tmp_path, context=4, level="char", test_split="valid").test
    assert "".join(chars[i] for i in valid.tokens.tolist()) == blob[a + 2:b + 2].decode("utf-8")


def test_missing_or_malformed_corpora_say_where_and_how(tmp_path):
    with pytest.raises(DataError, match=r"text-enwik8 not found: .* lacks \[.enwik8.\].*Set \$STALEOPT_DATA.*download=True.*enwik8.zip"):
        data.load("text-enwik8", root=tmp_path)
    with pytest.raises(DataError, match=r"lacks \['wikitext-103-raw/wiki.train.raw'.*by hand"):
        data.load("text-wikitext103", root=tmp_path)
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("too short")
    with pytest.raises(DataError, match="training split holds 8 tokens, fewer than context \\+ 1 = 129"):
        data.load("text-shakespeare", root=tmp_path)
    with pytest.raises(ConfigError, match="level = 'word' must be 'byte'"):
        data.load("text-shakespeare", root=tmp_path, level="word")


def test_padding_targets_count_in_no_metric_and_any_integer_targets_train():
    """Targets -100 (torch's ignore_index, Hugging Face's padding) are left out of the test loss, accuracy and
    perplexity as the training loss leaves them out (they counted as wrong tokens in the divisor: ppl 2.24 for
    5.03); int32 targets and numpy samples train and evaluate (they raised at the first batch / evaluation)."""
    import numpy as np
    from torch import nn
    from torch.utils.data import Dataset, TensorDataset

    from staleopt import data as datasets, train

    g = torch.Generator().manual_seed(0)
    V, T = 5, 8
    x = torch.randint(V, (40, T), generator=g)
    y = torch.roll(x, -1, 1)
    y[:, T // 2:] = train.IGNORE_INDEX
    data = datasets.from_datasets(TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:]))
    assert data.task == "lm"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, V))
    got = train._evaluate(model, data, torch.device("cpu"), "m")
    with torch.no_grad():
        logits, target = model(x[32:]).flatten(0, 1), y[32:].flatten()
    kept = target != train.IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[kept], target[kept]).item()
    assert got["test_loss"] == pytest.approx(loss, rel=1e-6)
    assert got["test_ppl"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert got["test_acc"] == (logits[kept].argmax(-1) == target[kept]).float().mean().item()
    assert train._lm_loss(model(x[:4]), y[:4]).item() == pytest.approx(
        torch.nn.functional.cross_entropy(model(x[:4]).flatten(0, 1)[y[:4].flatten() >= 0],
                                          y[:4].flatten()[y[:4].flatten() >= 0]).item(), rel=1e-6)

    class Numpy(Dataset):
        def __init__(self, a, b):
            self.a, self.b = a.numpy().astype(np.int32), b.numpy().astype(np.int32)

        def __len__(self):
            return len(self.a)

        def __getitem__(self, i):
            return self.a[i], self.b[i]

    z = torch.roll(x, -1, 1)
    small = datasets.from_datasets(Numpy(x[:32], z[:32]), Numpy(x[32:], z[32:]))
    out = train._evaluate(model, small, torch.device("cpu"), "m")
    assert math.isfinite(out["test_loss"]) and 0 <= out["test_acc"] <= 1
    assert train.loss_function("lm")(model(x[:4]), z[:4].int()).item() == pytest.approx(
        train.loss_function("lm")(model(x[:4]), z[:4]).item(), rel=0)
    head = nn.Linear(T, 3)
    labels = torch.tensor([0, 2, 1, 1])
    assert train.loss_function("classification")(head(x[:4].float()), labels.int()).item() == \
        train.loss_function("classification")(head(x[:4].float()), labels).item()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int32])
def test_unsigned_and_narrow_integer_tokens_evaluate_and_train_as_int64(dtype):
    """uint8 targets 156 compared equal to -100 (the padding label): the evaluation left them out of its count and
    accuracy but kept their loss (test ppl 46.8 for 28.7, silently); uint16 token windows (a GPT-2-tokenized
    corpus's dtype) were a raw NotImplementedError at load (torch has no min/max for them) and at the embedding."""
    from torch.utils.data import TensorDataset

    from staleopt.config import RunConfig
    import staleopt
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(150, 160, (1200,), generator=g)  # (byte 156: a tenth of the targets)
    T = 8

    def windows(t):
        n = (len(t) - 1) // T
        return TensorDataset(t[:n * T].view(n, T), t[1:n * T + 1].view(n, T))

    runs = {}
    try:
        for kind, t in (("wide", tokens), ("narrow", tokens.to(dtype))):
            staleopt.register_data(f"tokens-{kind}", lambda t=t: (windows(t[:1000]), windows(t[1000:])))
            assert data.load(f"tokens-{kind}").num_classes == 160
            runs[kind] = train.run(RunConfig(model="gpt", model_kwargs={"d_model": 8, "heads": 2, "layers": 1},
                                             data=f"tokens-{kind}", optimizer="adam", lr=3e-3, batch_size=8,
                                             epochs=1, max_steps=6))
    finally:  # (this test's registrations end with it)
        for kind in ("wide", "narrow"):
            data._USER.pop(f"tokens-{kind}", None)
    columns = ["train_loss", "test_loss", "test_ppl", "test_acc"]
    assert runs["narrow"][columns].equals(runs["wide"][columns])


class _Lists(torch.utils.data.Dataset):
    """Token windows whose samples are Python lists of ints (or, ``as_numpy``, int64 arrays)."""

    def __init__(self, x, y, as_numpy=False):
        self.x, self.y, self.as_numpy = x, y, as_numpy

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.as_numpy:
            return self.x[i].numpy(), self.y[i].numpy()
        return self.x[i].tolist(), self.y[i].tolist()


def test_samples_of_python_lists_train_as_arrays_do():
    """A dataset whose samples are lists of token ids trains and evaluates exactly as the same samples as numpy
    arrays (it crashed at the first batch: torch's default collate turns a batch of length-T lists into T tensors
    of the batch, which has no .to)."""
    from staleopt import data as datasets, registry, train
    from staleopt.config import RunConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randint(6, (120, 8), generator=g)
    y = torch.roll(x, -1, 1)
    kinds = {}
    for as_numpy in (False, True):
        name = f"list_tokens_{as_numpy}"
        datasets.register(name, lambda a=as_numpy: (_Lists(x[:96], y[:96], a), _Lists(x[96:], y[96:], a)),
                          replace=True)
        try:
            kinds[as_numpy] = train.run(RunConfig(model="gpt", model_kwargs={"d_model": 8, "layers": 1, "heads": 2},
                                                  data=name, optimizer="adam", lr=1e-2, batch_size=16, epochs=1,
                                                  method="pipemare", stages=2))
        finally:
            datasets._USER.pop(name, None)
    cols = ["train_loss", "test_loss", "test_acc"]
    assert kinds[False][cols].equals(kinds[True][cols]) and kinds[False]["status"].tolist() == ["ok"]
    batch, = datasets.batches(_Lists(x[:4], y[:4]), 4)
    assert batch[0].shape == (4, 8) and torch.equal(batch[0], x[:4]) and torch.equal(batch[1], y[:4])


def test_ragged_or_non_numeric_samples_are_refused_with_the_field_named():
    from staleopt import data as datasets
    from staleopt.errors import DataError

    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return list(range(i + 1)), [0] * (i + 1)

    with pytest.raises(DataError, match=r"field 0 of the samples of one batch has 4 shapes.*pad every sample"):
        list(datasets.batches(Ragged(), 4))

    class Words(Ragged):
        def __getitem__(self, i):
            return ["a", "b"], [0, 1]

    with pytest.raises(DataError, match=r"field 0 of a sample is a list that is not a rectangular array"):
        list(datasets.batches(Words(), 2))


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_vocabulary_smaller_than_the_tokens_is_a_data_error(split):
    """A Data that declares num_classes below its largest token or label raises a DataError naming the range
    (torch said only 'index out of range in self' at the embedding, or 'Target 5 is out of bounds')."""
    from torch.utils.data import TensorDataset

    from staleopt import data as datasets, train
    from staleopt.config import RunConfig
    from staleopt.errors import DataError

    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, (64, 8), generator=g)
    y = torch.roll(x, -1, 1)
    big_x, big_y = x.clone(), y.clone()
    big_x[-1, 0] = big_y[-1, 0] = 5  # the last sample (of the test split) or every train sample holds a 5
    tr = (TensorDataset(big_x[:48] + 1, big_y[:48] + 1) if split == "train" else TensorDataset(x[:48], y[:48]))
    te = TensorDataset(big_x[48:], big_y[48:])
    name = f"small_vocab_{split}"
    datasets.register(name, lambda: datasets.Data(name, tr, te, num_classes=4, input_shape=(8,), task="lm"),
                      replace=True)
    try:
        with pytest.raises(DataError, match=r"declares num_classes = 4, but a batch holds targets from \d to [45] "
                                            r"and input tokens from \d to [45], outside \[0, 4\)"):
            train.run(RunConfig(model="gpt", model_kwargs={"d_model": 8, "layers": 1, "heads": 2}, data=name,
                                optimizer="adam", lr=1e-2, batch_size=16, epochs=1, method="gpipe", stages=1))
    finally:
        datasets._USER.pop(name, None)
    # in range, the check stays out of the way of the model's own errors
    model = torch.nn.Linear(3, 4)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        train._forward_loss(model, x[:2].float(), y[:2], datasets.Data("d", tr, te, 4, (8,), "lm"), "m",
                            train.loss_function("lm"))


def test_a_minibatch_of_padding_only_is_skipped_not_recorded_as_divergence():
    """Its mean loss is 0/0 (no target kept): the run stopped there, recorded as diverged, though padding is
    documented as left out."""
    import warnings
    from torch.utils.data import TensorDataset
    from staleopt import train
    from staleopt.config import RunConfig
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 12, (40, 8), generator=g), torch.randint(0, 12, (40, 8), generator=g)
    y[::5] = -100  # every fifth sample: all of its targets padding

    def factory():
        return TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])
    data.register("padded-lm-test", factory, replace=True)
    cfg = RunConfig(model="gpt", model_kwargs={"d_model": 16, "layers": 1}, data="padded-lm-test", method="gpipe",
                    stages=2, optimizer="adam", lr=1e-3, batch_size=1, epochs=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rec = train.run(cfg)
    assert (rec["status"] == "ok").all() and rec["train_loss"].notna().all()
    assert rec["step"].tolist() == [32 - 7, 2 * (32 - 7)]  # 7 of the 32 training samples are padding only
    assert any("-100 (padding) was skipped" in str(w.message) for w in seen)


def test_token_windows_take_a_numpy_array_or_a_list():
    """A tokenized corpus as numpy (nanoGPT's ``np.memmap`` of uint16) or a list gives the windows of the same
    tensor (a raw AttributeError before); something that is no sequence of ids is a DataError."""
    np = pytest.importorskip("numpy")
    ids = (torch.arange(100) * 7) % 13
    want = data.TokenWindows(ids, 8, stride=5)
    for given in (ids.numpy().astype(np.uint16), ids.tolist()):
        got = data.TokenWindows(given, 8, stride=5)
        assert len(got) == len(want)
        every = torch.arange(len(want))
        assert all(torch.equal(a, b) for a, b in zip(got.take(every), want.take(every)))
    with pytest.raises(DataError, match="1-D sequence of integer token ids"):
        data.TokenWindows({"a": 1}, 8)


def test_test_windows_longer_than_the_training_windows_are_refused_at_load():
    """A language model's positions are sized for the training windows: longer test windows were found after a
    whole epoch, by an error naming a fix (input_shape) the config refuses."""
    tokens = torch.arange(300) % 11
    with pytest.raises(DataError, match=r"16 tokens, more than the 8 .*TokenWindows\(test_tokens, 8\)"):
        data.from_datasets(data.TokenWindows(tokens[:200], 8), data.TokenWindows(tokens[200:], 16), "long-test")
    assert data.from_datasets(data.TokenWindows(tokens[:200], 8), data.TokenWindows(tokens[200:], 4),
                              "short-test").input_shape == (8,)


def test_a_split_of_windows_of_several_lengths_is_refused_at_load():
    """A user's test split ending in a shorter tail window loaded, trained a whole epoch, then failed at the first
    evaluation batch that stacked both lengths."""
    import staleopt

    class Windows(torch.utils.data.Dataset):
        def __init__(self, n, tail):
            self.n, self.tail = n, tail

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            T = 3 if self.tail and i == self.n - 1 else 8
            return torch.arange(T) % 5, (torch.arange(T) + 1) % 5

    try:
        staleopt.register_data("tail-window", lambda: (Windows(10, False), Windows(4, True)))
        with pytest.raises(DataError, match="its test windows have 2 lengths \\(3, 8\\), but a batch stacks"):
            data.load("tail-window")
        staleopt.register_data("even-windows", lambda: (Windows(10, False), Windows(4, False)))
        assert data.load("even-windows").num_classes == 5
    finally:
        for name in ("tail-window", "even-windows"):
            data._USER.pop(name, None)
