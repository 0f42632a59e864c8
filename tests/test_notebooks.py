"""Every notebook in notebooks/ runs headlessly (nbclient) on small inputs and draws its figures."""
import tempfile
from pathlib import Path

import nbformat
import pytest

from helpers import PATIENCE

nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
#: Figures each of our notebooks must show (others: at least one).
FIGURES = {"accuracy_vs_stages.ipynb": 2, "hardware_model.ipynb": 2}


def test_there_are_notebooks():
    assert {"accuracy_vs_stages.ipynb", "hardware_model.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_draws_its_figures(path, monkeypatch, tmp_path):
    monkeypatch.setenv("STALEOPT_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("STALEOPT_SWEEP_DIR", str(tmp_path / "no-sweep-here"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=PATIENCE, startup_timeout=PATIENCE, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = sum("image/png" in o.get("data", {}) for o in outputs)
    assert figures >= FIGURES.get(path.name, 1), f"{path.name} drew {figures} figure(s)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebooks_carry_their_outputs(path):
    """``make notebooks`` (experiments/run_notebooks.py) executed them: every code cell ran, no cell failed, the
    figures are there, and no output names a path outside the repository."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: run `make notebooks`"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= FIGURES.get(path.name, 1)
    text = nbformat.writes(nb)
    for outside in (str(REPO.parent), tempfile.gettempdir(), "site-packages"):
        assert outside not in text, f"{path.name} names a path outside the repository ({outside})"


def test_committed_ledger_notebook_shows_every_check_of_the_ledger():
    """The committed outputs of notebooks/reproductions.ipynb are of today's ledger (every check of its files, the
    language-model ones included), not of an older one."""
    from staleopt.ledger import spec
    nb = nbformat.read(REPO / "notebooks" / "reproductions.ipynb", as_version=4)
    text = nbformat.writes(nb)
    missing = [k.id for e in spec.load_all("cpu", spec.LEDGER_DIR) for k in e.checks if k.id not in text]
    assert not missing, f"run `make reproduce` then `make notebooks`: the committed notebook lacks {missing}"


def test_run_notebooks_keeps_the_ledger_notebook_without_a_ledger_run(monkeypatch, tmp_path, capsys):
    import importlib.util
    loaded = importlib.util.spec_from_file_location("run_notebooks", REPO / "experiments" / "run_notebooks.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    monkeypatch.setenv("STALEOPT_LEDGER_DIR", str(tmp_path / "no-ledger-here"))
    monkeypatch.setattr(module, "run", lambda path: pytest.fail(f"executed {path.name}"))
    assert module.main(["reproductions.ipynb"]) == 0
    assert "kept notebooks/reproductions.ipynb as committed: no ledger run" in capsys.readouterr().err


def _fake_train(config, progress=False):
    import pandas as pd
    acc = {"gpipe": 0.9, "pipemare": 0.8 if config.decay == 0.1 else 0.6}[config.method] - 0.01 * config.seed
    return pd.DataFrame([{"epoch": e, "step": 10 * e, "train_loss": 1.0, "test_loss": 1.0, "test_acc": acc * e / 2,
                          "wall_time": 0.1, "status": "ok", "tau_max": 0} for e in (1, 2)])


def test_the_accuracy_notebooks_tables_have_a_row_per_figure_line(monkeypatch, tmp_path):
    """The notebook's summary and speedup tables grouped by method and P only: a sweep over pipemare's decay
    showed one pooled pipemare row beside the figure's two lines (write_report groups by the line keys)."""
    from staleopt import sweep
    from staleopt.config import RunConfig
    base = dict(model="mlp", data="synthetic", epochs=2, batch_size=20, microbatches=4)
    sweep.run_sweep([RunConfig(**base, method="gpipe", stages=p, seed=s) for p in (1, 3) for s in (0, 1)]
                    + [RunConfig(**base, method="pipemare", decay=d, stages=p, seed=s) for d in (0.1, 0.5)
                       for p in (1, 3) for s in (0, 1)], tmp_path / "sw", train_fn=_fake_train, bar=False)
    monkeypatch.delenv("STALEOPT_NOTEBOOK_SMALL", raising=False)
    monkeypatch.setenv("STALEOPT_SWEEP_DIR", str(tmp_path / "sw"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(REPO / "notebooks" / "accuracy_vs_stages.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=PATIENCE, startup_timeout=PATIENCE, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}}).execute()
    tables = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" and ("summarize" in c.source
              or "speedup_table" in c.source) for o in c.outputs if "text/html" in o.get("data", {})]
    assert len(tables) == 2 and all("pipemare decay=0.1" in t and "pipemare decay=0.5" in t for t in tables)


@pytest.mark.parametrize("chosen", ["docs/demo-lm", "no-such-folder"])
def test_the_accuracy_notebook_refuses_a_chosen_folder_that_is_not_a_sweep(monkeypatch, chosen):
    """STALEOPT_SWEEP_DIR naming a folder without runs/ (a typo, a report folder, docs/demo-lm) fell back to the
    committed MNIST-1D demo with one printed line: every table and figure after it was another experiment's."""
    monkeypatch.delenv("STALEOPT_NOTEBOOK_SMALL", raising=False)
    monkeypatch.setenv("STALEOPT_SWEEP_DIR", chosen)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "notebooks" / "accuracy_vs_stages.ipynb", as_version=4)
    nb.cells = nb.cells[:3]
    client = nbclient.NotebookClient(nb, timeout=PATIENCE, startup_timeout=PATIENCE, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    with pytest.raises(nbclient.exceptions.CellExecutionError, match=f"STALEOPT_SWEEP_DIR={chosen} is not a sweep"):
        client.execute()
