"""Claims: one owner per run, taken atomically, expiring with its owner; concurrent sweeps split the work."""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from staleopt import lease, sweep
from staleopt.cli import main
from staleopt.errors import ClaimLostError, ConfigError

from helpers import PATIENCE, wait_for

REPO = Path(__file__).resolve().parents[1]


def _claim_file(run_dir, generation, **owner):
    """A claim written by hand (another host, or a process that is gone)."""
    fields = {"host": socket.gethostname(), "pid": os.getpid(), "started": None, "launch": "someone",
              "claimed": "2025-01-01T00:00:00+0000", **owner}
    path = Path(run_dir) / f"claim.{generation}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields))
    return path


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_one_owner_at_a_time(tmp_path):
    run_dir = tmp_path / "r"
    first = lease.acquire(run_dir, "a")
    assert first is not None and first.path.name == "claim.0" and first.held()
    assert lease.acquire(run_dir, "b") is None  # this process is alive: the claim is respected
    owner, age = lease.holder(run_dir)
    assert owner.launch == "a" and owner.pid == os.getpid() and 0 <= age < 60
    assert sweep.run_state(run_dir) == "running"
    first.release()
    assert not first.path.exists() and lease.holder(run_dir) is None
    again = lease.acquire(run_dir, "b")
    assert again is not None and again.owner.launch == "b"


def test_racing_claims_have_exactly_one_winner(tmp_path):
    run_dir = tmp_path / "r"
    barrier, won = threading.Barrier(8), []

    def claim(i):
        barrier.wait()
        got = lease.acquire(run_dir, f"launch{i}")
        if got is not None:
            won.append(got)
    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and [p.name for _, p in lease.claims(run_dir)] == ["claim.0"]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]  # no private file left


def test_a_dead_owners_claim_is_taken_over(tmp_path):
    run_dir = tmp_path / "r"
    stale = _claim_file(run_dir, 0, pid=_dead_pid())
    assert lease.holder(run_dir) is None and sweep.run_state(run_dir) == "incomplete"
    mine = lease.acquire(run_dir, "next")
    assert mine is not None and mine.path.name == "claim.1" and not stale.exists()
    # a reused pid: alive, but started at another time than the claim says
    pid_reused = _claim_file(tmp_path / "s", 3, started=-1)
    assert lease.holder(pid_reused.parent) is None and lease.acquire(pid_reused.parent, "x").generation == 4


def test_claims_from_other_hosts_expire_with_their_heartbeat(tmp_path):
    run_dir = tmp_path / "r"
    other = _claim_file(run_dir, 0, host="elsewhere.example", pid=1)
    assert lease.acquire(run_dir, "me", timeout=60) is None  # fresh heartbeat: respected
    old = time.time() - 61
    os.utime(other, (old, old))
    assert lease.holder(run_dir, timeout=60) is None
    assert lease.acquire(run_dir, "me", timeout=60).generation == 1
    with pytest.raises(ConfigError, match="> 0 seconds"):
        lease.acquire(run_dir, "me", timeout=0)


def test_a_claim_is_judged_by_its_owners_timeout_not_the_callers(tmp_path):
    """An owner with a long --claim-timeout beats every tenth of it: a launch or a status query with the default
    (shorter) timeout must not call it stale between two beats, nor take its run over (double training)."""
    run_dir = tmp_path / "r"
    other = _claim_file(run_dir, 0, host="elsewhere.example", pid=1, timeout=3600.0)
    old = time.time() - 700  # older than the default 600 s, within the owner's own 3600 s
    os.utime(other, (old, old))
    assert lease.holder(run_dir)[0].timeout == 3600.0 and sweep.run_state(run_dir) == "running"
    assert lease.acquire(run_dir, "me") is None
    old = time.time() - 3601
    os.utime(other, (old, old))
    assert lease.holder(run_dir, timeout=10_000) is None  # stale by its own timeout, whatever the caller's
    mine = lease.acquire(run_dir, "me", timeout=42)
    assert mine.generation == 1 and lease.read_owner(mine.path).timeout == 42.0 and mine.held()
    for bad in (0, -1, "600", True, float("inf")):  # a claim whose timeout is no such number is damaged
        assert lease.read_owner(_claim_file(tmp_path / "bad", 0, timeout=bad)) is None
    assert lease.read_owner(_claim_file(tmp_path / "old", 0)).timeout is None  # written before: the caller's


def test_an_owner_that_lost_its_claim_stops_and_leaves_the_new_owners_files(tmp_path):
    run_dir = tmp_path / "r"
    slow = lease.acquire(run_dir, "slow", timeout=30)
    old = time.time() - 31
    os.utime(slow.path, (old, old))  # its heartbeat stalled (a suspended process)
    new = lease.acquire(run_dir, "new", timeout=30)
    assert new is not None and new.generation == 1
    assert not slow.held()
    with pytest.raises(ClaimLostError, match="took over"):
        slow.check()
    slow.release()  # must not delete the new owner's claim
    assert new.path.exists() and new.held()


def test_the_heartbeat_keeps_a_claim_fresh(tmp_path):
    mine = lease.acquire(tmp_path / "r", "me", timeout=0.5)
    with mine:
        old = time.time() - 100
        os.utime(mine.path, (old, old))
        wait_for(lambda: mine.path.stat().st_mtime > old + 50, "heartbeat")  # a beat every timeout / 10
    assert not mine.path.exists()


# --------------------------------------------------------------------------------- concurrent sweeps

SWEEP = """\
name = "twice"
[base]
model = "mlp"
data = "synthetic"
epochs = 2
[grid]
method = ["gpipe", "1f1b", "pipedream"]
stages = [1, 2, 3]
"""


def _env(**extra):
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_two_launches_at_once_train_every_run_exactly_once(tmp_path):
    path = tmp_path / "twice.toml"
    path.write_text(SWEEP)
    out, log = tmp_path / "out", tmp_path / "calls.log"
    cmd = [sys.executable, "-m", "staleopt.cli", "sweep", str(path), "--out", str(out), "--no-bar",
           "--train-fn", "test_sweep:fake_train"]
    # each launch's first run waits until the other launch runs one too: both take part however slowly they start
    env = _env(FAKE_SLEEP="0.7", FAKE_LOG=str(log), FAKE_PIDS=str(tmp_path / "pids"), FAKE_PROCESSES="2")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=PATIENCE) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr.decode()
        assert b"Traceback" not in stderr
    calls = log.read_text().split()
    assert sorted(calls) == sorted(c.run_id() for c in sweep.load_sweep(path).configs)  # each once
    finished = [int(re.search(r"9 runs; \d+ already done, (\d+) finished now", out.decode()).group(1))
                for out, _ in results]
    assert sum(finished) == 9 and min(finished) > 0, finished  # the launches split the work
    assert set(sweep.runs(out)["state"]) == {"done"} and not list(out.glob("runs/*/claim.*"))


def test_dry_run_shows_claimed_runs_and_their_owners(tmp_path, capsys):
    path = tmp_path / "twice.toml"
    path.write_text(SWEEP)
    first = sweep.load_sweep(path).configs[0]
    run_dir = tmp_path / "out" / "runs" / first.run_id()
    held = lease.acquire(run_dir, "abc123")
    _claim_file(tmp_path / "out" / "runs" / sweep.load_sweep(path).configs[1].run_id(), 0, pid=_dead_pid())
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == [first.run_id(), "running"]
    assert f"claimed by {socket.gethostname()}:{os.getpid()} (launch abc123), heartbeat" in lines[0]
    assert lines[1].split()[1] == "incomplete"  # its owner is gone: free to take over
    held.release()


def test_a_claim_number_used_again_is_not_the_stalled_owners(tmp_path):
    """After a takeover and a release the numbering starts over at claim.0: a stalled owner whose claim was taken
    over found a claim of its name again (a later launch's), and held() compared only the path, so two processes
    trained one run and the stalled one's release deleted the other's claim. The owner is compared now (here all
    three are this process and one launch id: the claim's time tells them apart)."""
    run_dir = tmp_path / "r"
    stalled = lease.acquire(run_dir, "L", timeout=30)
    old = time.time() - 31
    os.utime(stalled.path, (old, old))  # suspended past the timeout
    lease.acquire(run_dir, "L", timeout=30).release()  # taken over, then let go (its train function raised)
    third = lease.acquire(run_dir, "L", timeout=30)
    assert third.path == stalled.path and third.held()  # the same file name, another owner
    assert not stalled.held()
    with pytest.raises(ClaimLostError, match="took over"):
        stalled.check()
    stalled.release()  # must not delete the third's claim
    assert third.path.exists() and third.held()
    third.release()
    assert not third.path.exists()


def test_a_claim_that_is_a_folder_blocks_nothing(tmp_path):
    """A folder named claim.0 (not a claim) ended the launch with an untyped IsADirectoryError."""
    run_dir = tmp_path / "r"
    (run_dir / "claim.0").mkdir(parents=True)
    assert lease.holder(run_dir) is None
    mine = lease.acquire(run_dir, "me")
    assert mine is not None and mine.generation == 1 and mine.held()
    mine.release()


def test_claims_of_another_prefix_are_apart(tmp_path):
    """``staleopt train --out OUT`` claims OUT.claim.<n> in the user's folder: neither it nor a run's claim.<n>
    sees the other."""
    mine = lease.acquire(tmp_path, "me", prefix="a.csv.claim.")
    assert mine.path.name == "a.csv.claim.0" and lease.claims(tmp_path) == []
    assert lease.acquire(tmp_path, "other", prefix="a.csv.claim.") is None
    assert lease.holder(tmp_path, prefix="a.csv.claim.")[0].launch == "me"
    assert lease.acquire(tmp_path, "other", prefix="b.csv.claim.") is not None
    mine.release()
    assert not mine.path.exists()
