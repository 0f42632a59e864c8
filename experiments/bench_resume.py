"""What a kill -9 costs a sweep: the relaunch after a SIGKILL at a fraction of a run, against a full run.

    python experiments/bench_resume.py --out runs/bench_resume            # about a minute
    python experiments/bench_resume.py --out /tmp/br --quick              # smoke run: seconds, measures little

One sweep of one run (an MLP on synthetic data, ``--steps`` optimizer steps,
checkpointing every ``--every`` steps) is launched as a real ``staleopt sweep``
process three times:

1. uninterrupted, into a fresh directory: the time of a full launch;
2. into a second directory, killed with SIGKILL as soon as the run's
   checkpoint holds a step >= ``--kill-at`` of the run;
3. relaunched into that directory: it resumes from the checkpoint.

Reported: the step the relaunch resumed from (its ``done`` file), the steps it
trained, the wall time of the relaunch divided by the full launch's (both
include starting Python and loading torch), and the same ratio for the time
inside the run (``seconds`` of the ``done`` files: loading the data and the
checkpoint, training, evaluating, checkpointing). Without checkpoints the relaunch
retrained every step.

Outputs in ``--out``: ``resume.csv`` and ``meta.json`` (date, machine, load average, command).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import torch

from staleopt import checkpoint, sweep, train
from staleopt.errors import CheckpointError
from staleopt.machine import cpu_name, load_average, source_commit

__all__ = ["main", "sweep_file", "launch"]

REPO = Path(__file__).resolve().parents[1]


def sweep_file(path: Path, steps: int) -> Path:
    """A one-run sweep: MLP on synthetic data, 4 epochs, ``steps`` optimizer steps in all."""
    if steps < 8 or steps % 4:
        raise ValueError(f"steps must be a multiple of 4 and >= 8, got {steps}")
    samples = steps // 4 * 16 * 5 // 4  # train split 0.8, batch 16: steps / 4 per epoch
    path.write_text(f"""name = "resume"
[base]
model = "mlp"
model_kwargs = {{depth = 3, hidden = 256}}
data = "synthetic"
data_kwargs = {{num_samples = {samples}, input_shape = [1, 64], num_classes = 10}}
batch_size = 16
epochs = 4
lr = 0.02
method = "pipemare"
stages = 4
""")
    return path


#: Environment variable: the step at which :func:`train_stalling`'s run holds still once its checkpoint is saved.
STALL_AT = "STALEOPT_BENCH_STALL_AT"


@functools.wraps(train.run, assigned=("__module__", "__name__", "__qualname__"))
def train_stalling(config, progress=False, checkpoint=None):
    """``staleopt.train.run`` whose run, once it has saved a checkpoint at or after step ``$STALEOPT_BENCH_STALL_AT``,
    holds still until the process is killed: the killer finds the checkpoint it waits for however fast the run
    is (polling alone could miss it when the rest of the run takes less than one poll). It gives
    ``staleopt.train.run``'s results, and says so (``functools.wraps``), so the relaunch with the default train
    function resumes its checkpoint."""
    at, save = int(os.environ[STALL_AT]), checkpoint.save

    def save_then_stall(state):
        save(state)
        while state["optimizer"]["staleopt"]["step"] >= at:
            time.sleep(1)
    checkpoint.save = save_then_stall
    return train.run(config, progress=progress, checkpoint=checkpoint)


def launch(path: Path, out: Path, every: int, kill_at: Optional[float] = None, total: int = 0) -> float:
    """Run ``staleopt sweep PATH --out OUT``; with ``kill_at``, SIGKILL it once its checkpoint reaches that
    fraction of ``total`` steps. Returns the wall time in seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "staleopt.cli", "sweep", str(path), "--out", str(out), "--no-bar",
           "--checkpoint-every", str(every)]
    if kill_at is not None:
        cmd += ["--train-fn", "experiments.bench_resume:train_stalling"]
        env[STALL_AT] = str(math.ceil(kill_at * total))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if kill_at is not None:
        ckpt = out / "runs" / sweep.load_sweep(path).configs[0].run_id() / "checkpoint.pt"
        while proc.poll() is None:
            try:
                step = checkpoint.read(ckpt)["optimizer"]["staleopt"]["step"]
            except CheckpointError:  # not written yet
                step = 0
            if step >= kill_at * total:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    _, err = proc.communicate()
    if kill_at is None and proc.returncode != 0:
        raise RuntimeError(f"staleopt sweep failed:\n{err.decode()}")
    return time.perf_counter() - t0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench_resume", help="output directory")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps of the run (a multiple of 4)")
    ap.add_argument("--every", type=int, default=50, help="checkpoint every this many steps")
    ap.add_argument("--kill-at", type=float, default=0.7, help="fraction of the run at which to kill it")
    ap.add_argument("--quick", action="store_true", help="a short run: checks the script runs")
    args = ap.parse_args(argv)
    steps, every = (80, 10) if args.quick else (args.steps, args.every)
    if not 0 < args.kill_at < 1:
        raise ValueError(f"--kill-at must lie in (0, 1), got {args.kill_at}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = sweep_file(tmp / "resume.toml", steps)
        run_id = sweep.load_sweep(path).configs[0].run_id()
        full = launch(path, tmp / "full", every)
        killed = launch(path, tmp / "killed", every, kill_at=args.kill_at, total=steps)
        relaunch = launch(path, tmp / "killed", every)
        done = json.loads((tmp / "killed" / "runs" / run_id / "done").read_text())
        full_train = json.loads((tmp / "full" / "runs" / run_id / "done").read_text())["seconds"]
        same = sweep.collect(tmp / "full").drop(columns="wall_time").equals(
            sweep.collect(tmp / "killed").drop(columns="wall_time"))
    resumed = int(done["resumed_at_step"])
    row = {"steps": steps, "checkpoint_every": every, "kill_at": args.kill_at, "resumed_at_step": resumed,
           "steps_retrained": steps - resumed, "full_s": round(full, 2), "killed_launch_s": round(killed, 2),
           "relaunch_s": round(relaunch, 2), "relaunch_over_full": round(relaunch / full, 3),
           "full_train_s": round(full_train, 2), "relaunch_train_s": round(done["seconds"], 2),
           "relaunch_train_over_full": round(done["seconds"] / full_train, 3),
           "records_equal": bool(same)}
    pd.DataFrame([row]).to_csv(out / "resume.csv", index=False)
    cpu = cpu_name()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "commit": source_commit(), "cpu": cpu, "cpus": os.cpu_count(),
            "load_average_1min": load_average(),
            "torch": torch.__version__, "quick": args.quick}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(pd.DataFrame([row]).T.to_string(header=False))
    print(f"\n[{meta['date']}, {cpu}, {os.cpu_count()} CPUs, load {meta['load_average_1min']}]\n"
          f"wrote {out}/resume.csv, meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
