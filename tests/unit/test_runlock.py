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
        assert lease["token"] == lock.lease["token"]
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


def test_train_and_sweep_are_refused_before_ray_starts(tmp_path, live_process):
    import ray
    from behemoth.config import config_from_dict
    from behemoth.driver.trainer import train
    from behemoth.driver.tune import load_sweep, run_sweep

    storage = tmp_path / "runs"
    (storage / "taken").mkdir(parents=True)
    (storage / "taken" / LOCK_NAME).write_text(json.dumps(lease_of(live_process)))
    job = {"data": {"kind": "image_folder", "root": str(tmp_path / "no-data")},
           "checkpoint": {"storage_path": str(storage), "run_name": "taken"}}
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
