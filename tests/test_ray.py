"""The optional Ray executor for sweeps: same run directories, same resume rules as the local runner.

Skipped when Ray is not installed (``pip install 'staleopt[ray]'``), except the
check that a missing Ray gives a clear error.
"""
import random
import sys
import time

import pandas as pd
import pytest

from staleopt import checkpoint, sweep
from staleopt.errors import ConfigError

SWEEP = """\
name = "tiny"
[base]
model = "mlp"
data = "synthetic"
epochs = 2
[grid]
method = ["gpipe", "1f1b"]
stages = [1, 2]
"""


def fake_train(config, progress=False):
    """Records that depend only on the run id; stages == 3 raises (a failing run)."""
    if config.stages == 3:
        raise RuntimeError("boom")
    rng = random.Random(config.run_id())
    return pd.DataFrame([{"epoch": e, "step": 10 * e, "train_loss": rng.random(), "test_acc": rng.random(),
                          "status": "ok"} for e in (1, 2)])


def _sweep_file(tmp_path, text=SWEEP):
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def _records(out):
    return sweep.collect(out).sort_values(["run", "epoch"], ignore_index=True)


def _ray_sweep(path, out, **kw):
    """What ``run_sweep(..., executor="ray")`` does: skip finished runs, run the others as Ray jobs."""
    from staleopt.ray_executor import run_jobs
    root = out / "runs"
    root.mkdir(parents=True, exist_ok=True)
    todo = [c for c in sweep.load_sweep(path).configs if sweep.run_state(root / c.run_id()) != "done"]
    jobs = [("test_ray:fake_train", c.to_dict(), str(root / c.run_id()), False, {"launch": "test"}) for c in todo]
    return list(run_jobs(sweep._execute, jobs, **kw))


def test_missing_ray_is_a_clear_error(monkeypatch, tmp_path):
    from staleopt import ray_executor
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert not ray_executor.is_available()
    with pytest.raises(ConfigError, match=r"pip install 'staleopt\[ray\]'"):
        list(ray_executor.run_jobs(sweep._execute, [("test_ray:fake_train", {}, str(tmp_path), False, {})]))


#: Seconds Ray may take to start its head node and workers, or to answer a health check, on a loaded machine:
#: a limit for a hung Ray only. Ray's own (20-60 s, one of them fixed) are missed on a busy 2-core machine.
PATIENCE = 600


def _patient(get_node):
    """``ray._private.services.get_node``, retried until the node is registered (or ``PATIENCE`` s pass).

    A starting head node polls this for its raylet's registration with the GCS and gives up after a fixed
    30 s ("The current node timed out during startup", ``ray/_private/node.py``; no setting changes it): a
    call that returns once the raylet registered makes that wait an event, not a deadline."""
    def patient(*args, **kwargs):
        deadline = time.monotonic() + PATIENCE
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return patient


@pytest.fixture(scope="module")
def ray():
    """Ray, with its startup and health-check limits raised to ``PATIENCE`` for the Ray this module starts."""
    with pytest.MonkeyPatch.context() as mp:
        # read by the GCS and raylet processes Ray starts (RayConfig: RAY_<name>); seconds, or ms where named
        for key, value in (("RAY_worker_register_timeout_seconds", PATIENCE),
                           ("RAY_gcs_rpc_server_reconnect_timeout_s", PATIENCE),
                           ("RAY_health_check_failure_threshold", PATIENCE // 3),  # checks 3 s apart
                           ("RAY_NUM_REDIS_GET_RETRIES", PATIENCE)):
            mp.setenv(key, str(value))
        ray = pytest.importorskip("ray")
        from ray._private import ray_constants, services
        mp.setattr(ray_constants, "NUM_REDIS_GET_RETRIES", PATIENCE)  # (ray may have been imported before)
        mp.setattr(services, "get_node", _patient(services.get_node))
        yield ray


def test_local_ray_sweep_equals_the_serial_sweep(ray, tmp_path):
    path = _sweep_file(tmp_path)
    sweep.run_sweep(path, tmp_path / "serial", train_fn=fake_train, bar=False)
    running = ray.is_initialized()  # False in file order: run_jobs starts a local Ray
    results = _ray_sweep(path, tmp_path / "ray", workers=2)
    assert ray.is_initialized() == running  # a Ray it started is stopped again
    assert sorted(s for _, s, _ in results) == ["ok"] * 4
    assert set(sweep.runs(tmp_path / "ray")["state"]) == {"done"}
    pd.testing.assert_frame_equal(_records(tmp_path / "ray"), _records(tmp_path / "serial"))


@pytest.fixture(scope="module")
def running_ray(ray):
    """One local Ray for the tests below; ``run_jobs`` uses it as it is and leaves it running."""
    import os
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    yield ray
    ray.shutdown()


def test_resume_skips_done_runs_and_restarts_unfinished_ones(running_ray, tmp_path):
    path = _sweep_file(tmp_path)
    configs = sweep.load_sweep(path).configs
    out = tmp_path / "resume"
    sweep.run_sweep(configs[:1], out, train_fn=fake_train, bar=False)  # one run finished earlier
    broken = out / "runs" / configs[1].run_id()  # one killed mid-run: config.json, no records, no done
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (broken / "records.csv").write_text("partial")
    results = _ray_sweep(path, out)
    assert running_ray.is_initialized()
    assert sorted(r for r, _, _ in results) == sorted(c.run_id() for c in configs[1:])
    sweep.run_sweep(path, tmp_path / "clean", train_fn=fake_train, bar=False)
    pd.testing.assert_frame_equal(_records(out), _records(tmp_path / "clean"))
    assert _ray_sweep(path, out) == []  # everything done: nothing runs


def test_failing_run_is_marked_failed_and_the_sweep_goes_on(running_ray, tmp_path):
    path = _sweep_file(tmp_path, SWEEP.replace("stages = [1, 2]", "stages = [1, 3]"))
    results = _ray_sweep(path, tmp_path / "s")
    states = sweep.runs(tmp_path / "s").set_index("run")["state"]
    assert sorted(s for _, s, _ in results) == ["failed", "failed", "ok", "ok"]
    for run_id, status, _ in results:
        assert states[run_id] == ("failed" if status == "failed" else "done")
        if status == "failed":
            assert "boom" in (tmp_path / "s" / "runs" / run_id / "error.txt").read_text()


def test_ray_tasks_resume_runs_from_their_checkpoints(running_ray, tmp_path):
    from staleopt import train
    from staleopt.checkpoint import Checkpoint
    from staleopt.config import RunConfig
    config = RunConfig(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, data="synthetic",
                       data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4},
                       batch_size=16, epochs=3, lr=0.05, method="pipemare", stages=3)
    run_dir = tmp_path / "s" / "runs" / config.run_id()
    ckpt = Checkpoint(run_dir / "checkpoint.pt", every=10)
    save = ckpt.save

    def crash_after_first_save(state):
        save(state)
        raise KeyboardInterrupt  # as if the process died here
    ckpt.save = crash_after_first_save
    with pytest.raises(KeyboardInterrupt):
        train.run(config, checkpoint=ckpt)
    assert checkpoint.read(ckpt.path)["optimizer"]["staleopt"]["step"] == 10
    report = sweep.run_sweep([config], tmp_path / "s", executor="ray", bar=False, checkpoint_every=10)
    assert report.ok and report.finished == {config.run_id(): "ok"}
    assert '"resumed_at_step": 10' in (run_dir / "done").read_text() and not ckpt.path.exists()
    pd.testing.assert_frame_equal(
        sweep.collect(tmp_path / "s")[list(train.RECORD_COLUMNS)].drop(columns="wall_time"),
        train.run(config).drop(columns="wall_time"))
