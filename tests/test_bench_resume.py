"""Smoke test of experiments/bench_resume.py: a real sweep killed with SIGKILL and relaunched, as the script
measures it. It times nothing; it checks that the relaunch resumed from the checkpoint and matched the records."""
import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from staleopt import sweep

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench_resume.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_resume", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_file_has_the_asked_steps(bench, tmp_path):
    from staleopt.train import total_steps
    from staleopt import data
    c = sweep.load_sweep(bench.sweep_file(tmp_path / "s.toml", 120)).configs[0]
    assert total_steps(c, len(data.load(c.data, **c.data_kwargs).train)) == 120
    with pytest.raises(ValueError, match="multiple of 4"):
        bench.sweep_file(tmp_path / "t.toml", 30)


@pytest.mark.slow
def test_quick_run_resumes_the_killed_run(bench, tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--quick"]) == 0
    row = pd.read_csv(tmp_path / "resume.csv").iloc[0]
    assert row.steps == 80 and 56 <= row.resumed_at_step < 80 and row.resumed_at_step % 10 == 0
    assert row.steps_retrained == 80 - row.resumed_at_step and bool(row.records_equal)
    assert {"date", "command", "cpu", "load_average_1min"} <= set(json.loads((tmp_path / "meta.json").read_text()))
