"""One driver per run folder, and per sweep folder: a lease file, FOLDER/.behemoth.lock.

Two drivers on one run name would each apply retention to the other's checkpoints, and each restore picks up
the other's unregistered checkpoints. So `behemoth train` and `behemoth tune` take the folder's lease before
Ray starts, refresh it every HEARTBEAT_S while they run, and remove it when they end. A second driver is
refused with a message naming the holder. A lease whose holder is gone is taken over, and the takeover is
logged: at once when the holder was a process on this host that no longer exists (a driver killed with
SIGKILL), after EXPIRY_S without a heartbeat otherwise (a holder on another machine cannot be asked). "This
host" is the host name, this boot and this pid namespace, all three recorded in the lease: a container that
shares the host's name (--network host, hostNetwork) sees neither the host's pids nor another container's, so
a pid not found there says nothing of a holder in another namespace (nor of one on another machine of the
same name). A lease written before it recorded them is judged by its heartbeat alone.
A sweep's trials run inside the sweep's folder, under the sweep's lease.

The lease fences: each acquire writes a new generation (one more than the lease it replaces) and a token, and
a driver checks that the lease still carries both (`Fence.check`) before each step that registers or deletes
checkpoints or writes the run's results: a driver paused past the expiry (SIGSTOP, a VM pause, a long GC)
whose folder another driver took over stops there with LeaseLostError instead of deleting the new holder's
checkpoints. Its Ray Train workers check too, before and after each checkpoint upload, which is what Ray
Train registers and applies retention to next (hosts/lease_fence.py): they keep training while the driver's
own process is stopped.

Every change to the lease is conditional, so two drivers starting (or taking over) at the same moment cannot
both win (storage/lease_stores.py: link() and flock() on a local folder, S3's conditional writes on s3://, a
write read back and checked on other URIs).

A renewal that fails (S3's 503 SlowDown or ExpiredToken, a dropped connection, a storage call that never answers:
any exception) is retried with backoff while the lease is still valid by a margin (RunLock.margin_s, a quarter of
the expiry). A lease that cannot be renewed by then is given up by its holder before anyone else may take it:
the block holding it is ended as Ctrl-C would end it (Ray Train aborts its run) and leaves with one
LeaseLostError, and the driver's own fence refuses from then on. The timings are the lock's parameters.
"""

from __future__ import annotations

import _thread
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from behemoth.storage.filesystem import filesystem, is_uri
from behemoth.storage.lease_stores import lease_store, read_lease, within
from behemoth.errors import ConfigError, LeaseLostError

HEARTBEAT_S = 10.0
EXPIRY_S = 60.0


# Leases this process's drivers gave up (token: the LeaseLostError's message): their own fenced steps refuse
# even where the storage still shows the lease as theirs.
_GIVEN_UP: dict[str, str] = {}


class RunLockedError(ConfigError):
    """Another live driver holds the folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


@functools.cache
def pid_space() -> dict:
    """Where this process's pids mean something: its boot (a process of an earlier boot is gone) and its pid
    namespace (a container's pids are not the host's). None where unknown (no /proc: not Linux)."""
    def read(how):
        try:
            return how()
        except OSError:
            return None

    return {"boot": read(lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
            "pidns": read(lambda: os.readlink("/proc/self/ns/pid"))}


def _pids_visible(lease: dict) -> bool:
    """Whether the lease's holder is a process this one can look up by pid: same host name, boot and pid
    namespace. A lease without the latter two (an older behemoth's) is not: its holder might be in a
    container of this host name, and a pid not found would take a live driver's lease."""
    return lease.get("host") == socket.gethostname() and all(
        key in lease and lease[key] == value for key, value in pid_space().items())


def gone(lease: dict, now: float | None = None, expiry_s: float = EXPIRY_S) -> str | None:
    """Why the lease's holder is gone, or None while it may still be running."""
    now = time.time() if now is None else now
    if _pids_visible(lease) and not _alive(int(lease.get("pid", -1))):
        return f"its process {lease.get('pid')} on this host no longer exists"
    silent = now - float(lease.get("heartbeat", 0))
    if silent > expiry_s:
        return f"no heartbeat for {silent:.0f} s (more than {expiry_s:.0f})"
    return None


def describe(lease: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(lease.get("started", 0))))
    return (f"pid {lease.get('pid')} on {lease.get('host')} (`{lease.get('command', '?')}`, generation "
            f"{lease.get('generation', '?')}, started {started}, last heartbeat "
            f"{time.time() - float(lease.get('heartbeat', 0)):.0f} s ago)")


@dataclass(frozen=True)
class Fence:
    """What a step needs to know that this driver still holds the folder: small and picklable, so Ray Train's
    workers (hosts/lease_fence.py) and a sweep's trials carry it."""

    folder: str
    what: str
    token: str
    generation: int

    def holds(self, lease: dict | None) -> bool:
        """Whether `lease` (as read from the folder) is the one this fence's driver holds."""
        return lease is not None and lease.get("token") == self.token and lease.get("generation") == self.generation

    def check(self, before: str) -> None:
        """Raise LeaseLostError unless the folder's lease is still this driver's. `before`: the step not taken."""
        if self.token in _GIVEN_UP:
            raise LeaseLostError(_GIVEN_UP[self.token])
        held = read_lease(self.folder)
        if self.holds(held):
            return
        now = f"it is now held by {describe(held)}" if held is not None else "no driver holds it now"
        raise LeaseLostError(
            f"{self.what} in {self.folder}: this driver no longer holds the folder's lease (generation "
            f"{self.generation}): {now}. Another driver took the folder over while this one was stopped or cut "
            f"off for more than {EXPIRY_S:.0f} s without a heartbeat, so this one stops before {before}; the "
            f"checkpoints there are the new holder's. Nothing to do for the run: its holder goes on with it")


class RunLock:
    """`with RunLock(folder, "run 'x'") as lock:` holds the folder's lease for the block; `lock.fence()` is
    what the block's registering and deleting steps check (see the module doc). `heartbeat_s`: between renewals;
    `expiry_s`: the silence after which another driver takes a lease over; `margin_s` (default a quarter of
    the expiry): how long before that this one gives up a lease it cannot renew."""

    def __init__(self, folder: str, what: str, heartbeat_s: float = HEARTBEAT_S, expiry_s: float = EXPIRY_S,
                 margin_s: float | None = None):
        self.folder, self.what = folder, what
        self.heartbeat_s, self.expiry_s = heartbeat_s, expiry_s
        self.margin_s = expiry_s / 4 if margin_s is None else margin_s
        self.fs, self.path = filesystem(folder)
        self.lease = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                      "generation": 0,
                      "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:200],
                      "started": time.time(), "heartbeat": time.time(), **pid_space()}
        self.version = None  # the lease as this driver last wrote it (bytes, or an S3 ETag)
        self.renewed = self.lease["heartbeat"]  # the heartbeat in it: it is valid until this + expiry_s
        self.lost: str | None = None  # why the lease was given up (LeaseLostError's message)
        self.store = None
        self._mutex = threading.Lock()  # the block's end against the lock's thread ending it
        self._owner: threading.Thread | None = None  # the thread running the block, while it runs
        self._interrupted = False
        self._sigint_setting = None  # SIGINT before the block, where the lock handles it (ignored, default)
        self._created: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="behemoth-run-lock", daemon=True)

    def __enter__(self):
        self.acquire()
        self._owner = threading.current_thread()
        self._handle_sigint()
        self._thread.start()
        return self

    def _handle_sigint(self) -> None:
        """The give-up reaches the block as a SIGINT (_give_up). A driver started in the background by a script
        (`behemoth train ... &`, nohup, a CI runner) has SIGINT ignored from its start, or set to the default
        action: then nothing would handle it. For the block, this lock handles it: the give-up's interrupt
        raises; a SIGINT from outside keeps its meaning (ignored, or the default action)."""
        if self._owner is not threading.main_thread():
            return  # (only the main thread sets handlers; the block ends at its next fenced step)
        setting = signal.getsignal(signal.SIGINT)
        if callable(setting) or setting is None:  # (None: a handler set outside Python, which it cannot restore)
            return

        def while_held(signum, frame):
            if self._interrupted:
                raise KeyboardInterrupt
            if setting == signal.SIG_DFL:  # the default action, as without the lock
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)

        self._sigint_setting = setting
        signal.signal(signal.SIGINT, while_held)

    def _sigint_put_back(self) -> None:
        if self._sigint_setting is not None:
            signal.signal(signal.SIGINT, self._sigint_setting)
            self._sigint_setting = None

    def __exit__(self, exc_type, exc, tb):
        try:
            with self._mutex:
                self._owner = None  # the lock's thread interrupts nothing from here on
            self._stop.set()
            self._thread.join()
            if self.lost is None:
                self.release()  # (a lease given up is left to expire: the storage did not answer)
        except KeyboardInterrupt:  # the give-up's interrupt, sent as the block was ending
            if self.lost is None:
                raise
        finally:
            self._sigint_put_back()
        if self._interrupted and not isinstance(exc, LeaseLostError):
            raise LeaseLostError(self.lost) from exc

    def fence(self) -> Fence:
        return Fence(self.folder, self.what, self.lease["token"], self.lease["generation"])

    def acquire(self) -> None:
        self._make_folder()
        # a call that hangs is left after a heartbeat (at least a second: a loaded machine's connection)
        self.store = lease_store(self.folder, self.fs, self.path, max(self.heartbeat_s, 1.0))
        held, version = self.store.read()
        if version is None:
            self.lease["generation"] = 1
            self.version = self.store.create(self._data())
        else:
            why = (gone(held, expiry_s=self.expiry_s) if held is not None
                   else "its lease file is unreadable (cut short by a crash)")
            if why is None:
                raise RunLockedError(
                    f"{self.what} in {self.folder} is held by another driver: {describe(held)}. Wait for it to "
                    f"end, stop it, or use another name. (A holder that died is taken over: at once when it ran "
                    f"on this host in this pid namespace, after {self.expiry_s:.0f} s without a heartbeat "
                    f"otherwise.)")
            print(f"[behemoth] taking over {self.what} in {self.folder} from "
                  f"{describe(held) if held is not None else 'a driver'}: {why}", flush=True)
            self.lease["generation"] = int((held or {}).get("generation", 0)) + 1
            self.version = self.store.replace(self._data(), version)
        # a store that ignored the condition (an S3-compatible server without conditional writes) shows here
        if self.version is None or (read_lease(self.folder) or {}).get("token") != self.lease["token"]:
            raise RunLockedError(f"{self.what} in {self.folder}: another driver took it at the same moment; "
                                 f"now held by {describe(read_lease(self.folder) or {})}")
        self.renewed = self.lease["heartbeat"]

    def release(self) -> None:
        try:
            if self.version is not None:
                self.store.delete(self.version)  # only the lease as this driver last wrote it
        except Exception as e:  # noqa: BLE001 - at exit, never in place of the run's own error; it expires
            print(f"[behemoth] WARNING: could not remove the lease of {self.what}: {type(e).__name__}: {e}",
                  flush=True)
        for folder in self._created:  # deepest first; a folder the run wrote into is not empty and stays
            try:
                os.rmdir(folder)
            except OSError:
                break

    def _make_folder(self) -> None:
        if not is_uri(self.folder):  # folders this lock creates, removed again if a refused run leaves them empty
            missing = [self.path, *(str(p) for p in Path(self.path).parents)]
            self._created = [d for d in missing if not os.path.isdir(d)]
        try:
            self.fs.create_dir(self.path, recursive=True)
        except OSError as e:  # a file where a folder should be, no permission, a read-only mount
            raise ConfigError(f"cannot create the run folder {self.folder} ({e}): point checkpoint.storage_path "
                              f"at a folder this driver can write") from None

    def _data(self) -> bytes:
        return json.dumps(self.lease).encode()

    def heartbeat(self) -> bool:
        """Refresh the lease, only if it is still the one this driver wrote; False once it is not."""
        self.lease["heartbeat"] = time.time()
        version = self.store.renew(self._data(), self.version)
        if version is None:  # not as last written: another driver's, or renewed by this driver's own earlier try
            held, current = self.store.read()  # whose answer was lost (it timed out after the write landed)
            if not self.fence().holds(held):
                return False
            version = self.store.renew(self._data(), current)
            if version is None:
                return False
        self.version, self.renewed = version, self.lease["heartbeat"]
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s) and self._renew():
            pass

    def _renew(self) -> bool:
        """One heartbeat; one that fails is retried, with backoff, while the lease is still valid by margin_s.
        False: no more heartbeats (the lease was taken over, or is given up, or the block ended)."""
        deadline = self.renewed + self.expiry_s - self.margin_s
        pause, error = self.heartbeat_s / 8, None
        while True:
            left = deadline - time.time()
            if left <= 0 and error is not None:
                self._give_up(error)
                return False
            try:  # (a driver resumed past its deadline, SIGSTOP, still tries once: nobody may have taken it)
                mine = within(left if left > 0 else self.heartbeat_s, self.heartbeat)
            except Exception as e:  # noqa: BLE001 - any failure may pass: S3's 503 SlowDown or ExpiredToken
                error = e  # (botocore's ClientError), an unreachable endpoint, a hung mount
            else:
                if not mine:
                    self._taken_over()
                return mine
            pause = min(pause * 2, self.heartbeat_s, max(deadline - time.time(), 0))
            if self._stop.wait(pause):
                return False

    def _taken_over(self) -> None:
        print(f"[behemoth] WARNING: {self.what} in {self.folder} was taken over by another driver "
              f"({describe(read_lease(self.folder) or {})}); this one stops before its next checkpoint "
              f"registration or deletion", flush=True)
        self.version = None  # not this driver's to remove at the end

    def _give_up(self, error: Exception) -> None:
        """Stop holding a lease that could not be renewed, before another driver may take it over."""
        now, reason = time.time(), " ".join(f"{type(error).__name__}: {error}".split())
        self.lost = (f"{self.what} in {self.folder}: this driver could not renew the folder's lease for "
                     f"{now - self.renewed:.0f} s ({reason}); it gives the folder up "
                     f"{max(self.renewed + self.expiry_s - now, 0):.0f} s before another driver may take it over "
                     f"and the run stops here. Its checkpoints are kept: rerun the same command to resume once the "
                     f"storage answers again")
        _GIVEN_UP[self.lease["token"]] = self.lost
        with self._mutex:
            if self._owner is None:  # the block has ended
                return
            # Ctrl-C's way into the block (Ray Train's handler aborts its run; elsewhere KeyboardInterrupt),
            # which __exit__ turns into the LeaseLostError
            if self._owner is threading.main_thread() and callable(signal.getsignal(signal.SIGINT)):
                self._interrupted = True
                _thread.interrupt_main()
                return
        print(f"[behemoth] WARNING: {self.lost}", flush=True)  # a block it cannot interrupt: the fence stops it
