"""One driver per run folder, and per sweep folder: a lease file, FOLDER/.behemoth.lock.

Two drivers on one run name would each apply retention to the other's checkpoints, and each restore picks up
the other's unregistered checkpoints. So `behemoth train` and `behemoth tune` take the folder's lease before
Ray starts, refresh it every HEARTBEAT_S while they run, and remove it when they end. A second driver is
refused with a message naming the holder. A lease whose holder is gone is taken over, and the takeover is
logged: at once when the holder was a process on this host that no longer exists (a driver killed with
SIGKILL), after EXPIRY_S without a heartbeat otherwise (a holder on another machine cannot be asked).
A sweep's trials run inside the sweep's folder, under the sweep's lease.

Local folders are created exclusively (O_EXCL); an object store (s3://, through pyarrow's filesystem) offers
no conditional write here, so there the lease is written, read back and checked (two drivers starting within
the same second can both pass; one started later is refused).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from behemoth import paths
from behemoth.errors import ConfigError

LOCK_NAME = ".behemoth.lock"
HEARTBEAT_S = 10.0
EXPIRY_S = 60.0


class RunLockedError(ConfigError):
    """Another live driver holds the folder."""


def _fs(folder: str):
    import pyarrow.fs

    if paths.is_uri(folder):
        return pyarrow.fs.FileSystem.from_uri(folder)
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(folder)


def read_lease(folder: str) -> dict | None:
    """The lease in `folder`, or None (none, or one cut short by a crash mid-write: not a holder's)."""
    fs, path = _fs(folder)
    try:
        with fs.open_input_stream(f"{path}/{LOCK_NAME}") as f:
            return json.loads(f.read().decode())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    except OSError as e:  # pyarrow's "not found" on object stores
        if "not found" in str(e).lower() or "does not exist" in str(e).lower():
            return None
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def gone(lease: dict, now: float | None = None) -> str | None:
    """Why the lease's holder is gone, or None while it may still be running."""
    now = time.time() if now is None else now
    if lease.get("host") == socket.gethostname() and not _alive(int(lease.get("pid", -1))):
        return f"its process {lease.get('pid')} on this host no longer exists"
    silent = now - float(lease.get("heartbeat", 0))
    if silent > EXPIRY_S:
        return f"no heartbeat for {silent:.0f} s (more than {EXPIRY_S:.0f})"
    return None


def describe(lease: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(lease.get("started", 0))))
    return (f"pid {lease.get('pid')} on {lease.get('host')} (`{lease.get('command', '?')}`, started {started}, "
            f"last heartbeat {time.time() - float(lease.get('heartbeat', 0)):.0f} s ago)")


class RunLock:
    """`with RunLock(folder, "run 'x'"):` holds the folder's lease for the block (see the module doc)."""

    def __init__(self, folder: str, what: str):
        self.folder, self.what = folder, what
        self.fs, self.path = _fs(folder)
        self.lease = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                      "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:200],
                      "started": time.time(), "heartbeat": time.time()}
        self._created: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="behemoth-run-lock", daemon=True)

    def __enter__(self):
        self.acquire()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.release()

    def acquire(self) -> None:
        if not paths.is_uri(self.folder):  # folders this lock creates, removed again if a refused run leaves them empty
            missing = [self.path, *(str(p) for p in Path(self.path).parents)]
            self._created = [d for d in missing if not os.path.isdir(d)]
        try:
            self.fs.create_dir(self.path, recursive=True)
        except OSError as e:  # a file where a folder should be, no permission, a read-only mount
            raise ConfigError(f"cannot create the run folder {self.folder} ({e}): point checkpoint.storage_path "
                              f"at a folder this driver can write") from None
        held = read_lease(self.folder)
        if held is None and not paths.is_uri(self.folder) and self._create_exclusively():
            return
        held = held or read_lease(self.folder)  # created by another driver between the two reads
        if held is not None:
            why = gone(held)
            if why is None:
                raise RunLockedError(
                    f"{self.what} in {self.folder} is held by another driver: {describe(held)}. Wait for it to "
                    f"end, stop it, or use another name. (A holder that died is taken over: at once on this "
                    f"host, after {EXPIRY_S:.0f} s without a heartbeat from another one.)")
            print(f"[behemoth] taking over {self.what} in {self.folder} from {describe(held)}: {why}", flush=True)
        self._write()
        if (read_lease(self.folder) or {}).get("token") != self.lease["token"]:
            raise RunLockedError(f"{self.what} in {self.folder}: another driver took it at the same moment; "
                                 f"now held by {describe(read_lease(self.folder) or {})}")

    def release(self) -> None:
        if (read_lease(self.folder) or {}).get("token") == self.lease["token"]:
            self.fs.delete_file(f"{self.path}/{LOCK_NAME}")
        for folder in self._created:  # deepest first; a folder the run wrote into is not empty and stays
            try:
                os.rmdir(folder)
            except OSError:
                break

    def _create_exclusively(self) -> bool:
        try:
            fd = os.open(os.path.join(self.path, LOCK_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.lease, f)
        return True

    def _write(self) -> None:
        data = json.dumps(self.lease).encode()
        if paths.is_uri(self.folder):
            with self.fs.open_output_stream(f"{self.path}/{LOCK_NAME}") as f:
                f.write(data)
            return
        tmp = os.path.join(self.path, f"{LOCK_NAME}.{self.lease['token']}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.path, LOCK_NAME))  # never a half-written lease

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (read_lease(self.folder) or {}).get("token") != self.lease["token"]:
                    if not warned:
                        print(f"[behemoth] WARNING: {self.what} in {self.folder} was taken over by another "
                              f"driver; this one's checkpoints may be deleted by it", flush=True)
                        warned = True
                    continue
                self.lease["heartbeat"] = time.time()
                self._write()
            except OSError as e:  # storage briefly unreachable: the next beat tries again
                print(f"[behemoth] WARNING: could not refresh the lease of {self.what}: {e}", flush=True)
