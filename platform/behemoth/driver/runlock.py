"""One driver per run folder, and per sweep folder: a lease file, FOLDER/.behemoth.lock.

Two drivers on one run name would each apply retention to the other's checkpoints, and each restore picks up
the other's unregistered checkpoints. So `behemoth train` and `behemoth tune` take the folder's lease before
Ray starts, refresh it every HEARTBEAT_S while they run, and remove it when they end. A second driver is
refused with a message naming the holder. A lease whose holder is gone is taken over, and the takeover is
logged: at once when the holder was a process on this host that no longer exists (a driver killed with
SIGKILL), after EXPIRY_S without a heartbeat otherwise (a holder on another machine cannot be asked).
A sweep's trials run inside the sweep's folder, under the sweep's lease.

The lease fences: each acquire writes a new generation (one more than the lease it replaces) and a token, and
a driver checks that the lease still carries both (`Fence.check`) before each step that registers or deletes
checkpoints or writes the run's results: a driver paused past the expiry (SIGSTOP, a VM pause, a long GC)
whose folder another driver took over stops there with LeaseLostError instead of deleting the new holder's
checkpoints. Its Ray Train workers check too, before and after each checkpoint upload, which is what Ray
Train registers and applies retention to next (driver/lease_fence.py): they keep training while the driver's
own process is stopped.

Every change to the lease is conditional, so two drivers starting (or taking over) at the same moment cannot
both win: on a local folder the lease is created with link() (fails if it exists) and replaced or removed
under flock() of the folder after comparing its bytes; on s3:// through boto3 with S3's conditional writes
(PutObject If-None-Match: * to create, If-Match: ETag to replace and delete; pyarrow's S3 filesystem offers
none). Other URIs (gs://, ...) have no conditional write here: the lease is written, read back and checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from behemoth import paths
from behemoth.errors import ConfigError, LeaseLostError

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


def _parse(raw: bytes) -> dict | None:
    try:
        lease = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return lease if isinstance(lease, dict) else None


def read_lease(folder: str) -> dict | None:
    """The lease in `folder`, or None (none, or one cut short by a crash mid-write: not a holder's)."""
    fs, path = _fs(folder)
    try:
        with fs.open_input_stream(f"{path}/{LOCK_NAME}") as f:
            return _parse(f.read())
    except FileNotFoundError:
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
    return (f"pid {lease.get('pid')} on {lease.get('host')} (`{lease.get('command', '?')}`, generation "
            f"{lease.get('generation', '?')}, started {started}, last heartbeat "
            f"{time.time() - float(lease.get('heartbeat', 0)):.0f} s ago)")


@dataclass(frozen=True)
class Fence:
    """What a step needs to know that this driver still holds the folder: small and picklable, so Ray Train's
    workers (driver/lease_fence.py) and a sweep's trials carry it."""

    folder: str
    what: str
    token: str
    generation: int

    def check(self, before: str) -> None:
        """Raise LeaseLostError unless the folder's lease is still this driver's. `before`: the step not taken."""
        held = read_lease(self.folder)
        if held is not None and held.get("token") == self.token and held.get("generation") == self.generation:
            return
        now = f"it is now held by {describe(held)}" if held is not None else "no driver holds it now"
        raise LeaseLostError(
            f"{self.what} in {self.folder}: this driver no longer holds the folder's lease (generation "
            f"{self.generation}): {now}. Another driver took the folder over while this one was stopped or cut "
            f"off for more than {EXPIRY_S:.0f} s without a heartbeat, so this one stops before {before}; the "
            f"checkpoints there are the new holder's. Nothing to do for the run: its holder goes on with it")


class _LocalLease:
    """The lease file of a local folder (or a shared mount): created with link(), which fails when the lease
    exists and never shows a half-written one; replaced and removed under flock() of the folder, after
    comparing the bytes there with what the caller read (a compare-and-swap among this host's drivers)."""

    def __init__(self, path: str):
        self.path, self.file = path, os.path.join(path, LOCK_NAME)

    def read(self) -> tuple[dict | None, bytes | None]:
        raw = self._raw()
        return (None if raw is None else _parse(raw)), raw

    def _raw(self) -> bytes | None:
        try:
            return Path(self.file).read_bytes()
        except FileNotFoundError:
            return None

    def create(self, data: bytes) -> bytes | None:
        tmp = self._staged(data)
        try:
            os.link(tmp, self.file)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        return data

    def replace(self, data: bytes, expected: bytes) -> bytes | None:
        with self._locked():
            if self._raw() != expected:
                return None
            os.replace(self._staged(data), self.file)  # never a half-written lease
        return data

    def delete(self, expected: bytes) -> bool:
        with self._locked():
            if self._raw() != expected:
                return False
            os.unlink(self.file)
        return True

    def _staged(self, data: bytes) -> str:
        tmp = f"{self.file}.{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp

    @contextlib.contextmanager
    def _locked(self):
        import fcntl

        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


class _S3Lease:
    """The lease object under s3://, changed only by S3's conditional writes (through boto3, which reads the
    same AWS_* variables, AWS_ENDPOINT_URL included, as pyarrow's filesystem)."""

    def __init__(self, folder: str, path: str):
        try:
            import boto3
        except ImportError:
            raise ConfigError(f"{folder}: the run lock on s3:// needs boto3 for S3's conditional writes (two "
                              f"drivers starting at once must not both win): pip install 'behemoth[s3]'") from None
        self.bucket, _, prefix = path.partition("/")
        self.key = f"{prefix.rstrip('/')}/{LOCK_NAME}" if prefix else LOCK_NAME
        self.client = boto3.client("s3")

    def read(self) -> tuple[dict | None, str | None]:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None
        return _parse(got["Body"].read()), got["ETag"]

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, expected: str) -> str | None:
        return self._put(data, IfMatch=expected)

    def delete(self, expected: str) -> bool:
        return self._conditional(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key,
                                                                   IfMatch=expected)) is not None

    def _put(self, data: bytes, **condition) -> str | None:
        put = self._conditional(lambda: self.client.put_object(Bucket=self.bucket, Key=self.key, Body=data,
                                                               **condition))
        return put and put["ETag"]

    @staticmethod
    def _conditional(call):
        """The call's answer, or None when its condition failed (412; 409: a concurrent conditional write)."""
        from botocore.exceptions import ClientError

        try:
            return call()
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                return None
            raise


class _UnconditionalLease:
    """Another URI scheme: its pyarrow filesystem offers no conditional write, so each change is a read, a
    compare and a write (the read-back after acquire catches most races, not all)."""

    def __init__(self, folder: str, fs, path: str):
        self.folder, self.fs, self.file = folder, fs, f"{path}/{LOCK_NAME}"

    def read(self) -> tuple[dict | None, bytes | None]:
        lease = read_lease(self.folder)
        return lease, None if lease is None else json.dumps(lease, sort_keys=True).encode()

    def create(self, data: bytes) -> bytes | None:
        return None if self.read()[1] is not None else self._write(data)

    def replace(self, data: bytes, expected: bytes) -> bytes | None:
        return self._write(data) if self.read()[1] == expected else None

    def delete(self, expected: bytes) -> bool:
        if self.read()[1] != expected:
            return False
        self.fs.delete_file(self.file)
        return True

    def _write(self, data: bytes) -> bytes:
        with self.fs.open_output_stream(self.file) as f:
            f.write(data)
        return json.dumps(json.loads(data), sort_keys=True).encode()


def _lease_store(folder: str, fs, path: str):
    import pyarrow.fs

    if isinstance(fs, pyarrow.fs.LocalFileSystem):  # a local path, or file://
        return _LocalLease(path)
    if isinstance(fs, pyarrow.fs.S3FileSystem):
        return _S3Lease(folder, path)
    return _UnconditionalLease(folder, fs, path)


class RunLock:
    """`with RunLock(folder, "run 'x'") as lock:` holds the folder's lease for the block; `lock.fence()` is
    what the block's registering and deleting steps check (see the module doc)."""

    def __init__(self, folder: str, what: str):
        self.folder, self.what = folder, what
        self.fs, self.path = _fs(folder)
        self.lease = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                      "generation": 0,
                      "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:200],
                      "started": time.time(), "heartbeat": time.time()}
        self.version = None  # the lease as this driver last wrote it (bytes, or an S3 ETag)
        self.store = None
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

    def fence(self) -> Fence:
        return Fence(self.folder, self.what, self.lease["token"], self.lease["generation"])

    def acquire(self) -> None:
        self._make_folder()
        self.store = _lease_store(self.folder, self.fs, self.path)
        held, version = self.store.read()
        if version is None:
            self.lease["generation"] = 1
            self.version = self.store.create(self._data())
        else:
            why = gone(held) if held is not None else "its lease file is unreadable (cut short by a crash)"
            if why is None:
                raise RunLockedError(
                    f"{self.what} in {self.folder} is held by another driver: {describe(held)}. Wait for it to "
                    f"end, stop it, or use another name. (A holder that died is taken over: at once on this "
                    f"host, after {EXPIRY_S:.0f} s without a heartbeat from another one.)")
            print(f"[behemoth] taking over {self.what} in {self.folder} from "
                  f"{describe(held) if held is not None else 'a driver'}: {why}", flush=True)
            self.lease["generation"] = int((held or {}).get("generation", 0)) + 1
            self.version = self.store.replace(self._data(), version)
        # a store that ignored the condition (an S3-compatible server without conditional writes) shows here
        if self.version is None or (read_lease(self.folder) or {}).get("token") != self.lease["token"]:
            raise RunLockedError(f"{self.what} in {self.folder}: another driver took it at the same moment; "
                                 f"now held by {describe(read_lease(self.folder) or {})}")

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
        if not paths.is_uri(self.folder):  # folders this lock creates, removed again if a refused run leaves them empty
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
        version = self.store.replace(self._data(), self.version)
        if version is None:
            return False
        self.version = version
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.heartbeat():
                    print(f"[behemoth] WARNING: {self.what} in {self.folder} was taken over by another driver "
                          f"({describe(read_lease(self.folder) or {})}); this one stops before its next "
                          f"checkpoint registration or deletion", flush=True)
                    self.version = None  # not this driver's to remove at the end
                    return
            except OSError as e:  # storage briefly unreachable: the next beat tries again
                print(f"[behemoth] WARNING: could not refresh the lease of {self.what}: {e}", flush=True)
