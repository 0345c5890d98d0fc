"""Where a run lives: the storage root and run folder of a job, locally or under a URI (s3://, gs://, ...).

Every place that needs a run's paths asks here, so "is it a URI" is decided once.
"""

from __future__ import annotations

import os
import re

from behemoth.errors import ConfigError


def is_uri(path: str) -> bool:
    return "://" in str(path)


def storage_root(path: str) -> str:
    """A storage path as Ray needs it: a URI unchanged, a local path absolute (~ expanded)."""
    return path if is_uri(path) else os.path.abspath(os.path.expanduser(path))


def join(root: str, *parts: str) -> str:
    """`root`/`parts`, with '/' for a URI (never the OS separator)."""
    if is_uri(root):
        return "/".join([root.rstrip("/"), *parts])
    return os.path.join(root, *parts)


def as_uri_of(root: str, fs_path: str | None) -> str | None:
    """A path on a storage's pyarrow filesystem as the user names it: under a URI root (s3://bucket/...) the
    filesystem's path is "bucket/..." and gets the root's scheme back; a local path is returned as it is."""
    if fs_path is None or not is_uri(root) or is_uri(fs_path):
        return fs_path
    return f"{root.split('://')[0]}://{fs_path.lstrip('/')}"


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


def run_dir(storage_path: str, run_name: str) -> str:
    """The folder of run `run_name` under `storage_path` (local: absolute)."""
    check_name("checkpoint.run_name", run_name)  # also for a config the Python API never validated
    return join(storage_root(storage_path), run_name)


def split_run_dir(path: str) -> tuple[str, str]:
    """(storage_path, run_name) of a run folder: run_dir's inverse."""
    path = str(path).rstrip("/")
    if is_uri(path):
        head, _, name = path.rpartition("/")
        return head, name
    return os.path.dirname(path), os.path.basename(path)
