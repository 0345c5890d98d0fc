"""One driver per run folder: the lease file (behemoth.storage.runlock), its refusal, takeover and heartbeat, and
train() / sweep refusing before Ray starts."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from behemoth.storage import runlock
from behemoth.storage.lease_stores import LOCK_NAME, LocalLease, read_lease
from behemoth.storage.runlock import RunLock, RunLockedError
from behemoth.errors import LeaseLostError


def pid_space_here() -> dict:
    """This process's boot and pid namespace, read as a test's own oracle (what a lease written here records)."""
    return {"boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pidns": os.readlink("/proc/self/ns/pid")}


def lease_of(pid: int, host: str | None = None, heartbeat_age: float = 0.0, **fields) -> dict:
    """A lease written by another driver; by default one of this host's pid namespace (`fields` replace any)."""
    now = time.time()
    return {"host": host or socket.gethostname(), "pid": pid, "token": "theirs", "command": "behemoth train x",
            "started": now - 100, "heartbeat": now - heartbeat_age, **pid_space_here(), **fields}


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


def test_a_lease_records_the_boot_and_pid_namespace_of_its_holder(tmp_path):
    with RunLock(str(tmp_path), "run 'a'"):
        lease = read_lease(str(tmp_path))
        assert {k: lease[k] for k in ("boot", "pidns")} == pid_space_here()


@pytest.mark.parametrize("elsewhere", [{"pidns": "pid:[1]"}, {"boot": "another-boot"}],
                         ids=["another pid namespace", "another boot"])
def test_a_holder_on_this_host_name_whose_pids_this_process_cannot_see_waits_for_the_expiry(tmp_path, elsewhere,
                                                                                            capsys):
    """A driver in a container sharing the host's name (--network host, hostNetwork) but not its pids, or one
    on another machine of the same name (another boot): its pid is not found here, yet it may be running. Its
    lease is taken over only after the expiry, as another host's."""
    pid = dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps(lease_of(pid, heartbeat_age=1, **elsewhere)))
    with pytest.raises(RunLockedError, match=rf"held by another driver: pid {pid} on {socket.gethostname()}"):
        RunLock(str(tmp_path), "run 'a'").acquire()
    assert read_lease(str(tmp_path))["token"] == "theirs"
    (tmp_path / LOCK_NAME).write_text(json.dumps(lease_of(pid, heartbeat_age=runlock.EXPIRY_S + 5, **elsewhere)))
    with RunLock(str(tmp_path), "run 'a'") as lock:
        assert read_lease(str(tmp_path))["token"] == lock.lease["token"]
    assert "no heartbeat for" in capsys.readouterr().out


def test_a_lease_of_an_older_behemoth_without_its_pid_namespace_waits_for_the_expiry(tmp_path):
    """Written before leases recorded their boot and pid namespace: nothing says its pid is one this process
    can see, so its holder is judged by its heartbeat alone (the safe way: at worst a rerun waits out one
    expiry, instead of two drivers on one folder)."""
    pid = dead_pid()
    old = {k: v for k, v in lease_of(pid, heartbeat_age=1).items() if k not in ("boot", "pidns")}
    (tmp_path / LOCK_NAME).write_text(json.dumps(old))
    with pytest.raises(RunLockedError, match=rf"held by another driver: pid {pid}"):
        RunLock(str(tmp_path), "run 'a'").acquire()


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


def test_the_heartbeat_refreshes_the_lease(tmp_path):
    with RunLock(str(tmp_path), "run 'a'", heartbeat_s=0.05):
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
    from behemoth.driver.sweep.config import load_sweep
    from behemoth.driver.sweep.tuner import run_sweep
    from behemoth.driver.run.trainer import train
    from behemoth.job import config_from_dict

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
        seen = LocalLease(str(tmp_path)).read()
        first.acquire()
        with monkeypatch.context() as m:
            m.setattr(LocalLease, "read", lambda self, seen=seen: seen)  # the second driver's read came first
            with pytest.raises(RunLockedError, match="another driver took it at the same moment"):
                second.acquire()
        assert read_lease(str(tmp_path))["token"] == first.lease["token"]
        first.release()


DRIVER_A = """
import json, sys, time
from pathlib import Path
from types import SimpleNamespace
from behemoth.storage import checkpoint
from behemoth.job import config_from_dict
from behemoth.storage import runlock
from behemoth.hosts.lease_fence import LeaseFenceCallback
from behemoth.checkpoints.retention import retire_unregistered
from behemoth.driver.run.resume import run_place

storage, go = sys.argv[1], Path(sys.argv[2])
folder = f"{storage}/r"
cfg = config_from_dict({"data": {"root": "x"}, "checkpoint": {"storage_path": storage, "run_name": "r", "keep": 1}})
with runlock.RunLock(folder, "run 'r'", heartbeat_s=0.1) as lock:
    transfer = LeaseFenceCallback(lock.fence())  # what Ray Train's workers run around a checkpoint's upload
    for step in (10, 20):
        while not go.exists():
            time.sleep(0.02)
        go.unlink()
        with transfer.on_checkpoint_transfer():
            checkpoint.write(f"{folder}/checkpoint_{step}",
                             checkpoint.Snapshot({}, {"train_state.json": json.dumps({"step": step})}, step))
        retire_unregistered(run_place(cfg), [(SimpleNamespace(path=f"{folder}/checkpoint_{step}"), {})], lock.fence())
        print("round", step, flush=True)
"""


def test_a_driver_stopped_past_the_expiry_stops_before_touching_the_new_holders_checkpoints(tmp_path):
    """Real processes: driver A holds run 'r', writes checkpoint 10 (through the workers' fence) and applies
    retention (the driver's deleting step), then is SIGSTOPped past the expiry. This process, driver B, takes
    the folder over and writes checkpoints 13 and 16. A gets SIGCONT and goes on to its next round, which would
    write checkpoint 20 and remove every unregistered checkpoint older than it: it stops with LeaseLostError
    before either, and B's checkpoints are all there."""
    import fcntl
    import signal

    from behemoth.storage import checkpoint

    expiry_s = 1.0  # B's: how long A's silence lasts before B takes the folder over
    folder, go = tmp_path / "r", tmp_path / "go"
    a = subprocess.Popen([sys.executable, "-c", DRIVER_A, str(tmp_path), str(go)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        go.touch()
        assert a.stdout.readline() == "round 10\n", a.stderr.read() if a.poll() is not None else ""
        # A's heartbeat replaces its lease under flock() of the folder: stopped inside it, A would hold the flock
        # and B would wait on it for ever (seen once in the full tier). While this process holds it, A is at most
        # waiting for it, never inside: stop A then, and let go.
        held = os.open(folder, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
        os.kill(a.pid, signal.SIGSTOP)
        os.close(held)
        time.sleep(expiry_s + 0.5)
        with RunLock(str(folder), "run 'r'", expiry_s=expiry_s) as b:
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
    from behemoth.checkpoints.restore import remove_partial_uploads
    from behemoth.storage.run_store import RunStore

    (tmp_path / "checkpoint_5").mkdir()  # no manifest: an upload that has not finished
    run = RunStore(pyarrow.fs.LocalFileSystem(), str(tmp_path))
    with RunLock(str(tmp_path), "run 'a'") as lock:
        fence = lock.fence()
        (tmp_path / LOCK_NAME).write_text(json.dumps({**lease_of(live_process), "generation": 2}))  # taken over
        with pytest.raises(LeaseLostError, match=r"stops before removing checkpoint uploads that did not finish "
                                                 rf"\({tmp_path}/checkpoint_5\)"):
            remove_partial_uploads(run, set(), fence)
        assert (tmp_path / "checkpoint_5").is_dir()
        (tmp_path / LOCK_NAME).write_text(json.dumps(lock.lease))  # this driver's lease again
        assert remove_partial_uploads(run, set(), fence) == [f"{tmp_path}/checkpoint_5"]
        assert not (tmp_path / "checkpoint_5").exists()


# The heartbeat under storage faults, renewed every 0.25 s. A lease whose renewals fail for good: 5 s long,
# given up 2 s before its expiry (margin_s), 3 s after its last renewal: the 2 s are the slack for the lock's
# thread and the block's end (about 0.1 s) on a loaded machine. A lease that survives a run of faults: 30 s
# long, so that a loaded machine's slow calls never use up its 22 s of retries; the faults take about 2 s.
FAST = {"heartbeat_s": 0.25, "expiry_s": 5.0, "margin_s": 2.0}
PATIENT = {"heartbeat_s": 0.25, "expiry_s": 30.0}


def renewed_after(folder: str, since: float, deadline_s: float = 30.0) -> dict:
    """The lease once a heartbeat later than `since` is written (or the test fails after `deadline_s`)."""
    deadline = time.time() + deadline_s
    while (lease := read_lease(folder))["heartbeat"] <= since:
        assert time.time() < deadline, f"no heartbeat since the faults: {lease}"
        time.sleep(0.05)
    return lease


def test_a_renewal_failing_with_any_error_on_local_storage_is_retried(tmp_path, monkeypatch):
    """Not only OSError: a renewal that raises anything (here ValueError, three times in a row) is retried, and
    the lease stays this driver's: another driver is still refused."""
    failures = []
    real = LocalLease.replace

    def flaky(self, data, expected):
        if len(failures) < 3:
            failures.append(time.time())
            raise ValueError("injected: not an OSError")
        return real(self, data, expected)

    with RunLock(str(tmp_path), "run 'a'", **PATIENT) as lock:
        monkeypatch.setattr(LocalLease, "replace", flaky)
        started = time.time()
        lease = renewed_after(str(tmp_path), started)
        assert len(failures) == 3 and lease["token"] == lock.lease["token"]
        with pytest.raises(RunLockedError, match="held by another driver"):
            RunLock(str(tmp_path), "run 'a'", **PATIENT).acquire()
        lock.fence().check("registering a checkpoint")  # still held
    assert read_lease(str(tmp_path)) is None  # released as usual


def test_a_renewal_that_never_answers_ends_the_run_before_the_lease_expires(tmp_path, monkeypatch, capsys):
    """A renewal call that hangs (a hung NFS mount): the lock does not wait for it past its margin; the block
    ends with one LeaseLostError while the lease on disk is still valid, so no other driver could have taken
    the folder yet, and the lease is left to expire (not removed: nothing can be written there)."""
    hung = threading.Event()

    def hang(self, data, expected):
        hung.wait(30)

    with pytest.raises(LeaseLostError) as lost, RunLock(str(tmp_path), "run 'a'", **FAST) as lock:
        monkeypatch.setattr(LocalLease, "replace", hang)
        deadline = time.time() + 30  # the driver's work, ended from the lock's thread (in ~3 s)
        while time.time() < deadline:
            time.sleep(0.05)
    ended = time.time()
    hung.set()
    lease = read_lease(str(tmp_path))
    assert lease["token"] == lock.lease["token"]
    assert runlock.gone(lease, now=ended, expiry_s=FAST["expiry_s"]) is None  # no driver could take it yet
    assert ended - lease["heartbeat"] >= FAST["expiry_s"] - FAST["margin_s"] - 0.01  # not given up early
    assert re.fullmatch(rf"run 'a' in {tmp_path}: this driver could not renew the folder's lease for \d+ s \("
                        r"TimeoutError: .*\); it gives the folder up \d+ s before another driver may take it over "
                        r"and the run stops here\. .*rerun the same command.*", str(lost.value)), str(lost.value)
    assert "\n" not in str(lost.value) and capsys.readouterr().out == ""  # the error's one line, nothing else
    with pytest.raises(LeaseLostError, match="could not renew"):
        lock.fence().check("registering a checkpoint")  # the driver's own fenced steps refuse too


@pytest.mark.parametrize("ignored", [True, False], ids=["ctrl-c-ignored", "ctrl-c-default"])
def test_a_driver_whose_ctrl_c_is_ignored_or_default_is_ended_by_the_give_up(tmp_path, monkeypatch, ignored):
    """A driver started in the background by a script (`behemoth train ... &`, nohup, a CI runner) has SIGINT
    ignored, or set to the default action, from its start: the give-up's interrupt, sent as a SIGINT, would
    reach nothing. The lock handles SIGINT for its block: the give-up ends it; a SIGINT from outside is still
    ignored where it was (the default action is kept too, not sent here: it would end the test's process); the
    process's setting is put back when the block ends."""
    import signal

    setting = signal.SIG_IGN if ignored else signal.SIG_DFL
    signal.signal(signal.SIGINT, setting)  # (conftest puts the suite's handler back after the test)
    hung = threading.Event()
    with pytest.raises(LeaseLostError, match="could not renew"), RunLock(str(tmp_path), "run 'a'", **FAST):
        if ignored:  # a Ctrl-C from outside, before the give-up, is still ignored
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        monkeypatch.setattr(LocalLease, "replace", lambda self, data, expected: hung.wait(30))
        deadline = time.time() + 30  # the driver's work, ended from the lock's thread (in ~3 s)
        while time.time() < deadline:
            time.sleep(0.05)
    hung.set()
    assert signal.getsignal(signal.SIGINT) == setting


# ---- on S3: moto's server, its answers replaced by S3's fault answers for some calls (botocore's before-send)

BUCKET = "behemoth-test"
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
             b'request rate.</Message><RequestId>X</RequestId></Error>')


@pytest.fixture(scope="module")
def s3():
    from s3_server import moto_s3

    with moto_s3(BUCKET) as endpoint:
        yield endpoint


class S3Faults:
    """What the next PutObject calls of the lease get, one entry each: "503" (S3's SlowDown), "connection"
    (the endpoint cannot be reached), "lost answer" (the write is done but its answer never arrives);
    `always`: the answer to every call once the plan is used up (None: the server's own)."""

    def __init__(self):
        self.plan, self.always, self.seen = [], None, 0

    def __call__(self, request, **_):
        from botocore.awsrequest import AWSResponse
        from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

        if not request.url.split("?")[0].endswith(LOCK_NAME):
            return None
        fault = self.plan.pop(0) if self.plan else self.always
        self.seen += fault is not None
        if fault == "503":
            return AWSResponse(request.url, 503, {}, _Body(SLOW_DOWN))
        if fault == "connection":
            raise EndpointConnectionError(endpoint_url=request.url)
        if fault == "lost answer":
            import urllib3

            urllib3.request("PUT", request.url, body=request.body, headers=dict(request.headers))
            raise ReadTimeoutError(endpoint_url=request.url)
        return None


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


@pytest.fixture
def s3_faults(s3, monkeypatch):
    """Faults for every S3 client this process makes from here on (boto3's default session's events)."""
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    boto3.setup_default_session()
    faults = S3Faults()
    boto3.DEFAULT_SESSION.events.register("before-send.s3.PutObject", faults)
    return faults


def test_a_lease_on_s3_survives_slow_downs_lost_connections_and_lost_answers(s3_faults):
    """A run of S3 faults on the lease's renewals (503 SlowDown, an unreachable endpoint, a write whose answer
    was lost: its retry finds the lease already renewed by itself) costs nothing: renewals go on, the lease is
    this driver's, another driver is refused, and the end removes the lease."""
    folder = f"s3://{BUCKET}/lease-{uuid.uuid4().hex}"
    with RunLock(folder, "run 'a'", **PATIENT) as lock:
        s3_faults.plan += ["503", "503", "503", "connection", "connection", "503", "lost answer"]
        deadline = time.time() + 30
        while s3_faults.plan:
            assert time.time() < deadline, f"renewals stopped before these faults: {s3_faults.plan}"
            time.sleep(0.05)
        lease = renewed_after(folder, time.time())
        assert lease["token"] == lock.lease["token"] and lease["generation"] == 1
        renewed_after(folder, lease["heartbeat"])  # and on after that
        with pytest.raises(RunLockedError, match="held by another driver"):
            RunLock(folder, "run 'a'", **PATIENT).acquire()
        lock.fence().check("registering a checkpoint")
    assert read_lease(folder) is None


def test_a_lease_on_s3_that_cannot_be_renewed_ends_the_run_before_it_expires(s3_faults, capsys):
    """Every renewal answered 503: the block ends with one LeaseLostError naming S3's answer while the lease is
    still valid (no other driver could have taken it), not after another driver took the folder over."""
    folder = f"s3://{BUCKET}/lease-{uuid.uuid4().hex}"
    with pytest.raises(LeaseLostError) as lost, RunLock(folder, "run 'a'", **FAST) as lock:
        s3_faults.always = "503"
        deadline = time.time() + 30
        while time.time() < deadline:
            time.sleep(0.05)
    ended = time.time()
    lease = read_lease(folder)
    assert lease["token"] == lock.lease["token"] and s3_faults.seen >= 2
    assert runlock.gone(lease, now=ended, expiry_s=FAST["expiry_s"]) is None
    assert ended - lease["heartbeat"] >= FAST["expiry_s"] - FAST["margin_s"] - 0.01
    assert re.match(rf"run 'a' in {folder}: this driver could not renew the folder's lease for \d+ s \(ClientError: "
                    r"An error occurred \(SlowDown\)", str(lost.value)), str(lost.value)
    assert "\n" not in str(lost.value) and capsys.readouterr().out == ""


def test_a_lease_on_s3_read_while_its_holder_renews_it_is_read_whole(s3):
    """pyarrow's S3 reader asks for an object's size, then reads that many bytes: a lease replaced in between
    (a heartbeat whose time is a digit longer) read short, unparsable, and the fence took it for 'no driver
    holds it now' - a run ended by its own heartbeat. Renewed every 10 ms here (about 1 read in 20 raced)."""
    folder = f"s3://{BUCKET}/lease-{uuid.uuid4().hex}"
    with RunLock(folder, "run 'a'", heartbeat_s=0.01, expiry_s=30.0) as lock:
        for _ in range(300):
            lease = read_lease(folder)
            assert lease is not None and lease["token"] == lock.lease["token"]
        lock.fence().check("registering a checkpoint")
