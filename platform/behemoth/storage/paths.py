"""Where a run lives: the storage root and run folder of a job, locally or under a URI (s3://, gs://, ...).

Every place that needs a run's paths asks here (and storage/filesystem.py whether a path is a URI).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from behemoth.errors import ConfigError
from behemoth.storage.filesystem import is_uri  # (the run paths' own question too)


def storage_root(path: str) -> str:
    """A storage path as Ray needs it: a URI unchanged, a local path absolute (~ expanded). A URI with a query
    or fragment is refused: run and checkpoint paths are joined onto its end, where options would not follow."""
    if is_uri(path) and ("?" in path or "#" in path):
        raise ConfigError(f"storage path {path}: a query string or fragment cannot stay with the run and "
                          f"checkpoint paths joined onto it. Give the filesystem's options as environment variables "
                          f"on every node (S3: AWS_ENDPOINT_URL, AWS_REGION, ...), not in the URI")
    return path if is_uri(path) else os.path.abspath(os.path.expanduser(path))


# A URI's userinfo password (s3://KEY:SECRET@bucket, postgresql://user:PASSWORD@host/db, the form pyarrow and
# MLflow take): what trackers, reports and warnings show carries *** in its place
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)[^@\s]*@")


def relative_local(value: str) -> tuple[str, str] | None:
    """(its scheme, the path) where `value` names a relative path on this machine: a plain relative path, or
    MLflow's sqlite:///RELATIVE.db (sqlite:////ABSOLUTE.db is absolute); None for an absolute path or a URI."""
    scheme = "sqlite:///" if value.startswith("sqlite:///") else ""
    path = value[len(scheme):]
    if not path or (not scheme and is_uri(value)) or os.path.isabs(os.path.expanduser(path)):
        return None
    return scheme, path


def redacted(value):
    """`value` (a string, or a config's dicts and lists of them) with every URI's userinfo password as ***."""
    if isinstance(value, str):
        return _USERINFO.sub(lambda m: f"{m['head']}***@", value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value)
    return value


def join(root: str, *parts: str) -> str:
    """`root`/`parts`, with '/' for a URI (never the OS separator)."""
    if is_uri(root):
        scheme, sep, rest = root.partition("://")
        return "/".join([scheme + sep + rest.rstrip("/"), *parts])  # (file:/// + e: file:///e, not file:/e)
    return os.path.join(root, *parts)


def entry_uri(folder: str, fs_path: str | None) -> str | None:
    """An entry directly inside `folder` (a checkpoint in a run folder), given as a path on the storage's
    pyarrow filesystem (what Ray and pyarrow's listings give), named as the user names `folder`: under a URI,
    the folder's URI and the entry's name. The filesystem's path cannot be turned back into a URI by itself: it
    drops what only the URI holds (an Azure account, an HDFS namenode) and decodes or normalises what it keeps.
    A local path is returned as it is."""
    if fs_path is None or not is_uri(folder) or is_uri(fs_path):
        return fs_path
    return join(folder, fs_path.rstrip("/").rpartition("/")[2])


# A run or sweep name: letters, digits, '.', '_', '-'. Anything else means something else to some storage:
# pyarrow reads '#' in s3://.../runs/exp#1 as a fragment and '?' as filesystem options, '%2F' may decode to
# '/', spaces and long names break shells and object-store keys. Not starting with '.' (hidden, '..') or '-'
# (a command-line flag).
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
NAME_MAX = 128


def check_name(key: str, name: str, max_len: int = NAME_MAX) -> None:
    """A run or sweep name becomes one folder under the storage path, local or on an object store: checked
    before any path is built from it, so no storage reads it as anything but one plain folder."""
    if not (isinstance(name, str) and NAME_PATTERN.fullmatch(name) and len(name) <= max_len):
        raise ConfigError(f"{key} {name!r} must be a plain folder name: 1-{max_len} characters of A-Z a-z 0-9 "
                          f"'.' '_' '-', not starting with '.' or '-'")


@dataclass(frozen=True)
class RunPlace:
    """Where one run or sweep lives: `storage` (a URI, or an absolute local path: what Ray takes as its
    storage_path) and `name` (a checked plain folder name: Ray's run or experiment name). Built once from a
    config (`of`) and handed along; every path of the run is joined here: `folder`, `join(...)`, a sweep trial's
    place (`child`), a checkpoint Ray names on the storage's filesystem as the user names it (`as_uri`)."""

    storage: str
    name: str

    @classmethod
    def of(cls, storage_path: str, name: str, key: str = "checkpoint.run_name") -> RunPlace:
        check_name(key, name)  # also for a config the Python API never validated
        return cls(storage_root(storage_path), name)

    @property
    def folder(self) -> str:
        """The run's folder (local: absolute; or a URI)."""
        return join(self.storage, self.name)

    def join(self, *parts: str) -> str:
        """A path inside the run's folder."""
        return join(self.folder, *parts)

    def child(self, *parts: str) -> RunPlace:
        """The place of a run inside this one's folder: parts[:-1] the folders on the way, parts[-1] its name
        (a sweep's trial: child("runs", TRIAL_ID))."""
        check_name("a run folder's name", parts[-1])
        return RunPlace(self.join(*parts[:-1]), parts[-1])

    def as_uri(self, fs_path: str | None) -> str | None:
        """A checkpoint's path as Ray gives it (on the storage's pyarrow filesystem, directly in the run's
        folder), as the user names it (entry_uri)."""
        return entry_uri(self.folder, fs_path)


# A name that comes from data (a bucket's key below a folder, a checkpoint manifest's file, a cache's shard) is
# written or read under one local folder only as a relative POSIX path of plain parts: an object store resolves
# '..' when the key is read (S3 reads 'P/../X' as 'X'), and joined onto a folder '..', '/' or '\\' lands outside it.
PART_MAX = 255  # bytes in one file or folder name (Linux's NAME_MAX): a longer part cannot be written


def is_inside(name: object) -> bool:
    """Whether `name` joined onto any folder names a file inside it: a relative POSIX path whose every part is
    a plain name (not empty, '.' or '..'; no backslash or NUL; at most PART_MAX bytes of UTF-8)."""
    if not isinstance(name, str) or "\\" in name or "\0" in name:
        return False
    try:
        return all(part not in ("", ".", "..") and len(part.encode()) <= PART_MAX for part in name.split("/"))
    except UnicodeEncodeError:  # a lone surrogate (a JSON manifest can hold one): no file has that name
        return False


def listing_problem(names: Iterable[str]) -> str | None:
    """Why the files `names` (a folder's listing: an object store's keys below a prefix) cannot each be written
    under one local folder as named, in words that name the key(s); None where they can: every name is_inside,
    and no file's name is another's folder (keys `x` and `x/y`: a local folder holds a file x or a folder x)."""
    names = list(names)
    for name in names:
        if not is_inside(name):
            return (f"the object {name!r} is not a plain relative path (it is absolute, or has an empty, '.' or '..' "
                    f"part, a backslash, a NUL or a part over {PART_MAX} bytes): copied as named it would not be one "
                    f"file inside the copy's folder")
    files = set(names)
    for name in names:
        parts = name.split("/")
        for end in range(1, len(parts)):
            folder = "/".join(parts[:end])
            if folder in files:
                return (f"the objects {folder!r} and {name!r} make {folder!r} both a file and a folder, which a "
                        f"local copy cannot hold")
    return None


def local_out_folder(out: str | os.PathLike, flag: str = "--out", empty: str | None = None) -> Path:
    """`out` as a local folder a command writes into (made later, by the writer): a file there, or on the path
    to it, is one ConfigError naming it (mkdir's NotADirectoryError or FileExistsError otherwise; a tokenizer's
    save_pretrained only warned, and wrote nothing). `empty` (what is written, as the refusal names it): the
    folder must be new or empty (what is in it would be written over, or mixed with what is written)."""
    path = Path(out).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), path)  # out, or the folder it is made in
    if existing.exists() and not existing.is_dir():
        raise ConfigError(f"{flag} {out}: {existing} is a file, not a folder: give a folder")
    if empty and path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{flag} {out} is not empty: write {empty} into a new folder (nothing is overwritten)")
    return path
