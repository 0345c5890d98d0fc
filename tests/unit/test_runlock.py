"""One driver per run folder: the lease file (behemoth.driver.runlock), its refusal, takeover and heartbeat, and
train() / sweep refusing before Ray starts."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from behemoth.driver import runlock
from behemoth.driver.runlock import LOCK_NAME, RunLock, RunLockedError, read_lease
from behemoth.errors import LeaseLostError


def lease_of(pid: int, host: str | None = None, heartbeat_age: float = 0.0) -> dict:
    now = time.time()
    return {"host": host or socket.gethostname(), "pid": pid, "token": "theirs", "command": "behemoth train x",
            "started": now - 100, "heartbeat": now - heartbeat_age}


@pytest.fixture
def live_process():
    """Another live process on this host (a second driver)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p.pid
    p.kill()
    p.wait()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_held_while_running_and_removed_after(tmp_path):
    folder = tmp_path / "runs" / "a"
    with RunLock(str(folder), "run 'a'") as lock:
        lease = read_lease(str(folder))
        assert lease["pid"] == os.getpid() and lease["host"] == socket.gethostname()
        assert lease["token"] == lock.lease["token"] and lease["generation"] == 1
    assert not (folder / LOCK_NAME).exists()
    assert not (tmp_path / "runs").exists()  # the folders it created for a run that wrote nothing are gone


def test_a_folder_the_run_wrote_into_stays(tmp_path):
    folder = tmp_path / "runs" / "a"
    with RunLock(str(folder), "run 'a'"):
        (folder / "checkpoint_1").mkdir()
    assert (folder / "checkpoint_1").is_dir() and not (folder / LOCK_NAME).exists()


def test_a_second_driver_is_refused_naming_the_holder(tmp_path, live_process):
    (tmp_path / LOCK_NAME).write_text(json.dumps(lease_of(live_process)))
    with pytest.raises(RunLockedError, match=rf"run 'a' in {tmp_path} is held by another driver: pid {live_process} "
                                             rf"on {socket.gethostname()} \(`behemoth train x`"):
        RunLock(str(tmp_path), "run 'a'").acquire()
    assert read_lease(str(tmp_path))["token"] == "theirs"  # untouched


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path, capsys):
    pid = dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps(lease_of(pid)))
    with RunLock(str(tmp_path), "run 'a'") as lock:
        assert read_lease(str(tmp_path))["token"] == lock.lease["token"]
    out = capsys.readouterr().out
    assert f"taking over run 'a' in {tmp_path} from pid {pid}" in out and "no longer exists" in out


def test_a_holder_on_another_host_is_taken_over_only_after_the_expiry(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text(json.dumps(lease_of(1, host="elsewhere", heartbeat_age=runlock.EXPIRY_S / 2)))
    with pytest.raises(RunLockedError, match="on elsewhere"):
        RunLock(str(tmp_path), "run 'a'").acquire()
    (tmp_path / LOCK_NAME).write_text(json.dumps(lease_of(1, host="elsewhere", heartbeat_age=runlock.EXPIRY_S + 5)))
    lock = RunLock(str(tmp_path), "run 'a'")
    lock.acquire()
    assert read_lease(str(tmp_path))["token"] == lock.lease["token"]
    assert "no heartbeat for" in capsys.readouterr().out
    lock.release()


def test_the_heartbeat_refreshes_the_lease(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    with RunLock(str(tmp_path), "run 'a'"):
        first = read_lease(str(tmp_path))["heartbeat"]
        deadline = time.time() + 10
        while read_lease(str(tmp_path))["heartbeat"] == first:
            assert time.time() < deadline, "no heartbeat"
            time.sleep(0.02)


def test_a_torn_lease_does_not_block(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"host": "x", "pi')  # a crash mid-write (the lease is replaced atomically)
    with RunLock(str(tmp_path), "run 'a'") as lock:
        assert read_lease(str(tmp_path))["token"] == lock.lease["token"]


def test_a_storage_path_that_is_a_file_is_one_config_error(tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    from behemoth.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cannot create the run folder .*runs/r1 .*checkpoint.storage_path"):
        RunLock(str(tmp_path / "runs" / "r1"), "train").acquire()


def test_train_and_sweep_are_refused_before_ray_starts(tmp_path, live_process, no_ray):
    import ray
    from behemoth.job import config_from_dict
    from behemoth.driver.trainer import train
    from behemoth.driver.sweep_config import load_sweep
    from behemoth.driver.tune import run_sweep

    storage = tmp_path / "runs"
    (storage / "taken").mkdir(parents=True)
    (storage / "taken" / LOCK_NAME).write_text(json.dumps(lease_of(live_process)))
    job = {"data": {"kind": "image_folder", "root": str(tmp_path / "no-data")}, "train": {"epochs": 2},
           "checkpoint": {"storage_path": str(storage), "run_name": "taken"}}  # 2 epochs: ASHA has a rung
    with pytest.raises(RunLockedError, match="run 'taken'"):
        train(config_from_dict(job))
    assert not ray.is_initialized()

    (tmp_path / "job.yaml").write_text(json.dumps(job))
    (storage / "s" ).mkdir()
    (storage / "s" / LOCK_NAME).write_text(json.dumps(lease_of(live_process)))
    (tmp_path / "sweep.yaml").write_text(json.dumps({"job": "job.yaml", "space": {"train.lr": {"grid": [0.1, 0.01]}},
                                                     "name": "s", "storage_path": str(storage)}))
    with pytest.raises(RunLockedError, match="sweep 's'"):
        run_sweep(load_sweep(tmp_path / "sweep.yaml"))
    assert not ray.is_initialized()


def test_a_takeover_writes_the_next_generation_and_the_fence_fails_once_the_lease_is_lost(tmp_path, live_process):
    (tmp_path / LOCK_NAME).write_text(json.dumps({**lease_of(1, "elsewhere", runlock.EXPIRY_S + 5), "generation": 4}))
    with RunLock(str(tmp_path), "run 'a'") as lock:
        assert read_lease(str(tmp_path))["generation"] == 5 == lock.fence().generation
        lock.fence().check("deleting checkpoint_3")  # still held: nothing raised
        # another driver takes the folder over (this one was stopped past the expiry)
        (tmp_path / LOCK_NAME).write_text(json.dumps({**lease_of(live_process), "generation": 6}))
        with pytest.raises(LeaseLostError, match=rf"run 'a' in {tmp_path}: this driver no longer holds the folder's "
                                                 rf"lease \(generation 5\): it is now held by pid {live_process} on "
                                                 rf".*generation 6.* stops before deleting checkpoint_3"):
            lock.fence().check("deleting checkpoint_3")
        assert lock.heartbeat() is False  # a late heartbeat does not write over the new holder's lease
    assert read_lease(str(tmp_path))["token"] == "theirs"  # nor does the end of the run remove it


def test_two_drivers_starting_at_once_cannot_both_win(tmp_path, monkeypatch):
    """Both read the folder before either wrote (no lease, then an expired one): the lease is written only on
    the condition that it is still what was read, so the second is refused."""
    for expired in (None, {**lease_of(1, "elsewhere", runlock.EXPIRY_S + 5), "generation": 1}):
        if expired:
            (tmp_path / LOCK_NAME).write_text(json.dumps(expired))
        first, second = RunLock(str(tmp_path), "run 'a'"), RunLock(str(tmp_path), "run 'a'")
        seen = runlock._LocalLease(str(tmp_path)).read()
        first.acquire()
        with monkeypatch.context() as m:
            m.setattr(runlock._LocalLease, "read", lambda self, seen=seen: seen)  # the second driver's read came first
            with pytest.raises(RunLockedError, match="another driver took it at the same moment"):
                second.acquire()
        assert read_lease(str(tmp_path))["token"] == first.lease["token"]
        first.release()


DRIVER_A = """
import json, sys, time
from pathlib import Path
from types import SimpleNamespace
from behemoth import checkpoint
from behemoth.job import config_from_dict
from behemoth.driver import runlock
from behemoth.driver.lease_fence import LeaseFenceCallback
from behemoth.driver.trainer import retire_unregistered

runlock.HEARTBEAT_S = 0.1
storage, go = sys.argv[1], Path(sys.argv[2])
folder = f"{storage}/r"
cfg = config_from_dict({"data": {"root": "x"}, "checkpoint": {"storage_path": storage, "run_name": "r", "keep": 1}})
with runlock.RunLock(folder, "run 'r'") as lock:
    transfer = LeaseFenceCallback(lock.fence())  # what Ray Train's workers run around a checkpoint's upload
    for step in (10, 20):
        while not go.exists():
            time.sleep(0.02)
        go.unlink()
        with transfer.on_checkpoint_transfer():
            checkpoint.write(f"{folder}/checkpoint_{step}",
                             checkpoint.Snapshot({}, {"train_state.json": json.dumps({"step": step})}, step))
        retire_unregistered(cfg, [(SimpleNamespace(path=f"{folder}/checkpoint_{step}"), {})], lock.fence())
        print("round", step, flush=True)
"""


def test_a_driver_stopped_past_the_expiry_stops_before_touching_the_new_holders_checkpoints(tmp_path, monkeypatch):
    """Real processes: driver A holds run 'r', writes checkpoint 10 (through the workers' fence) and applies
    retention (the driver's deleting step), then is SIGSTOPped past the expiry. This process, driver B, takes
    the folder over and writes checkpoints 13 and 16. A gets SIGCONT and goes on to its next round, which would
    write checkpoint 20 and remove every unregistered checkpoint older than it: it stops with LeaseLostError
    before either, and B's checkpoints are all there."""
    import signal

    from behemoth import checkpoint

    monkeypatch.setattr(runlock, "EXPIRY_S", 1.0)
    folder, go = tmp_path / "r", tmp_path / "go"
    a = subprocess.Popen([sys.executable, "-c", DRIVER_A, str(tmp_path), str(go)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        go.touch()
        assert a.stdout.readline() == "round 10\n", a.stderr.read() if a.poll() is not None else ""
        os.kill(a.pid, signal.SIGSTOP)
        time.sleep(runlock.EXPIRY_S + 0.5)
        with RunLock(str(folder), "run 'r'") as b:
            assert b.fence().generation == 2
            for step in (13, 16):
                checkpoint.write(folder / f"checkpoint_{step}",
                                 checkpoint.Snapshot({}, {"train_state.json": json.dumps({"step": step})}, step))
            go.touch()
            os.kill(a.pid, signal.SIGCONT)
            out, err = a.communicate(timeout=120)
            assert sorted(p.name for p in folder.glob("checkpoint_*")) == ["checkpoint_10", "checkpoint_13",
                                                                          "checkpoint_16"], err
            assert [s for s, _ in checkpoint.complete_checkpoints(folder)] == [16, 13, 10]
            assert a.returncode == 1 and "round 20" not in out
            assert (f"LeaseLostError: run 'r' in {folder}: this driver no longer holds the folder's lease "
                    f"(generation 1): it is now held by pid {os.getpid()}") in err, err
            assert "stops before writing a checkpoint into it" in err
            assert read_lease(str(folder))["token"] == b.lease["token"]
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
        a.wait()


def test_a_restore_deletes_an_unfinished_upload_only_while_its_driver_holds_the_lease(tmp_path, live_process):
    """A worker group's restore removes checkpoint folders without a manifest (uploads cut short). Once another
    driver holds the folder, an unfinished upload may be that driver's live one: the restore stops with
    LeaseLostError and deletes nothing; while the lease is its driver's, it removes the dead upload."""
    import pyarrow.fs

    from behemoth.worker.restore import remove_partial_uploads

    (tmp_path / "checkpoint_5").mkdir()  # no manifest: an upload that has not finished
    fs = pyarrow.fs.LocalFileSystem()
    with RunLock(str(tmp_path), "run 'a'") as lock:
        fence = lock.fence()
        (tmp_path / LOCK_NAME).write_text(json.dumps({**lease_of(live_process), "generation": 2}))  # taken over
        with pytest.raises(LeaseLostError, match=r"stops before removing checkpoint uploads that did not finish "
                                                 rf"\({tmp_path}/checkpoint_5\)"):
            remove_partial_uploads(str(tmp_path), fs, set(), fence)
        assert (tmp_path / "checkpoint_5").is_dir()
        (tmp_path / LOCK_NAME).write_text(json.dumps(lock.lease))  # this driver's lease again
        assert remove_partial_uploads(str(tmp_path), fs, set(), fence) == [f"{tmp_path}/checkpoint_5"]
        assert not (tmp_path / "checkpoint_5").exists()
