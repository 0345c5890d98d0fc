"""The one answer to "where do these bytes live": a local path or a URI (s3://, gs://, ...) and the pyarrow
filesystem that reads it. Nothing else calls `FileSystem.from_uri` or decides what a URI is, so local and object
storage take the same code paths with one switch; rooms outside storage/ hold a `store.Store` made from the path
and use its verbs (tests/unit/test_platform.py fails on the question asked anywhere else).
"""

from __future__ import annotations

import os
from pathlib import Path


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


def filesystem(path: str | Path, fs=None):
    """(pyarrow filesystem, path on it) for a local path (made absolute) or a URI; `fs` given: (fs, path)."""
    import pyarrow.fs

    if fs is not None:
        return fs, str(path)
    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(str(path))
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(path)


def local():
    """The local disk's pyarrow filesystem (a copy's source or target beside a run's storage)."""
    import pyarrow.fs

    return pyarrow.fs.LocalFileSystem()


def is_local(fs) -> bool:
    """Whether a pyarrow filesystem is the local disk (a local path, or file://)."""
    import pyarrow.fs

    return isinstance(fs, pyarrow.fs.LocalFileSystem)


def exists(path: str | Path, fs=None) -> bool:
    import pyarrow.fs

    fs, where = filesystem(path, fs)
    return fs.get_file_info(where).type != pyarrow.fs.FileType.NotFound


def read_file(path: str | Path, fs=None) -> bytes:
    """A file's bytes: a local path, a URI, or a path on the pyarrow filesystem `fs`."""
    fs, where = filesystem(path, fs)
    with fs.open_input_stream(where) as f:
        return f.read()
