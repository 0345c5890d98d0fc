"""Where a run lock's lease lies and how it is changed (storage/runlock.py holds the lock itself): every change
conditional, so two drivers starting (or taking over) at the same moment cannot both win.

- a local folder (or a shared mount): created with link() (fails if it exists), replaced and removed under
  flock() of the folder after comparing its bytes;
- s3://: through boto3 with S3's conditional writes (PutObject If-None-Match: * to create, If-Match: ETag to
  replace and delete; pyarrow's S3 filesystem offers none);
- other URIs (gs://, ...): no conditional write here: the lease is written, read back and checked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import threading
import uuid
from pathlib import Path

from behemoth.errors import ConfigError
from behemoth.storage.filesystem import filesystem, is_local, is_uri

LOCK_NAME = ".behemoth.lock"


def parse_lease(raw: bytes) -> dict | None:
    try:
        lease = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return lease if isinstance(lease, dict) else None


def read_bytes(fs, path: str) -> bytes | None:
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:  # pyarrow's "not found" on object stores
        if "not found" in str(e).lower() or "does not exist" in str(e).lower():
            return None
        raise


def read_lease(folder: str) -> dict | None:
    """The lease in `folder`, or None (none, or one cut short by a crash mid-write: not a holder's)."""
    fs, path = filesystem(folder)
    # An object store's reader (pyarrow's) asks for the object's size, then reads that many bytes: a lease its
    # holder replaced in between (a heartbeat) reads short. An object is never written in part: read it again.
    for _ in range(5 if is_uri(folder) else 1):
        raw = read_bytes(fs, f"{path}/{LOCK_NAME}")
        lease = None if raw is None else parse_lease(raw)
        if raw is None or lease is not None:
            return lease
    return None


class LeaseStore:
    """What every lease store does the same way (its subclasses: where the lease lies and how it changes)."""

    def renew(self, data: bytes, expected):
        """A heartbeat's replace (the lock retries it itself, knowing when the lease expires)."""
        return self.replace(data, expected)


class LocalLease(LeaseStore):
    """The lease file of a local folder (or a shared mount): created with link(), which fails when the lease
    exists and never shows a half-written one; replaced and removed under flock() of the folder, after
    comparing the bytes there with what the caller read (a compare-and-swap among this host's drivers)."""

    def __init__(self, path: str):
        self.path, self.file = path, os.path.join(path, LOCK_NAME)

    def read(self) -> tuple[dict | None, bytes | None]:
        raw = self._raw()
        return (None if raw is None else parse_lease(raw)), raw

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


class S3Lease:
    """The lease object under s3://, changed only by S3's conditional writes (through boto3, which reads the
    same AWS_* variables, AWS_ENDPOINT_URL included, as pyarrow's filesystem)."""

    def __init__(self, folder: str, path: str, renewal_timeout_s: float):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError(f"{folder}: the run lock on s3:// needs boto3 for S3's conditional writes (two "
                              f"drivers starting at once must not both win): pip install 'behemoth[s3]'") from None
        self.bucket, _, prefix = path.partition("/")
        self.key = f"{prefix.rstrip('/')}/{LOCK_NAME}" if prefix else LOCK_NAME
        self.client = boto3.client("s3")
        # A renewal gets one try per call: the lock retries it knowing when the lease expires; botocore's own
        # retries (seconds of backoff) and its 60 s timeouts would spend that time inside one call.
        self.renewer = boto3.client("s3", config=Config(retries={"total_max_attempts": 1},
                                                        connect_timeout=renewal_timeout_s,
                                                        read_timeout=renewal_timeout_s))

    def read(self) -> tuple[dict | None, str | None]:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None
        return parse_lease(got["Body"].read()), got["ETag"]

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, expected: str) -> str | None:
        return self._put(data, IfMatch=expected)

    def renew(self, data: bytes, expected: str) -> str | None:
        return self._put(data, client=self.renewer, IfMatch=expected)

    def delete(self, expected: str) -> bool:
        return self._conditional(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key,
                                                                   IfMatch=expected)) is not None

    def _put(self, data: bytes, client=None, **condition) -> str | None:
        client = client or self.client
        put = self._conditional(lambda: client.put_object(Bucket=self.bucket, Key=self.key, Body=data, **condition))
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


class UnconditionalLease(LeaseStore):
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


def within(seconds: float, call):
    """call()'s answer, or TimeoutError once `seconds` pass without one. A storage call that hangs (a hung mount)
    cannot be cancelled, only left: it runs in a daemon thread of its own."""
    done = concurrent.futures.Future()

    def run():
        try:
            done.set_result(call())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)

    threading.Thread(target=run, name="behemoth-lease-renewal", daemon=True).start()
    try:
        return done.result(timeout=seconds)
    except TimeoutError:
        if done.done():  # the call's own
            raise
        raise TimeoutError(f"the storage did not answer in {seconds:.1f} s") from None


def lease_store(folder: str, fs, path: str, renewal_timeout_s: float):
    import pyarrow.fs

    if is_local(fs):  # a local path, or file://
        return LocalLease(path)
    if isinstance(fs, pyarrow.fs.S3FileSystem):
        return S3Lease(folder, path, renewal_timeout_s)
    return UnconditionalLease(folder, fs, path)
