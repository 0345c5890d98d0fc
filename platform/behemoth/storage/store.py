"""Store: a place for bytes (a file or a folder), decided local-or-URI once, with the verbs the rooms need.

Tracking's records and event files, the token store's cache and the checkpoint saver each write to a place that
is a local path or a URI (s3://, gs://, ...). The choice is made here, when the handle is made: the call sites
read, write, list and copy through its verbs and never ask which kind of place it is. Where a feature needs a
file system (a folder memory-mapped or locked, a log appended to, a folder a tool writes into) `is_local` says
whether the place is a path; tests/unit/test_platform.py's ASKS_WHETHER_A_PATH lists those sites and why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from behemoth.storage import filesystem


class Store:
    """A local path or a URI (or, with `fs`, a path on that pyarrow filesystem: a host's run storage)."""

    def __init__(self, path: str | Path, fs=None):
        self.path = str(path)
        self._fs = fs
        self._pair = None  # (pyarrow filesystem, path on it), made once on first use (a URI's resolves its bucket)
        self.is_local = filesystem.is_local(fs) if fs is not None else not filesystem.is_uri(path)

    def pyarrow(self):
        """(pyarrow filesystem, path on it)."""
        if self._pair is None:
            self._pair = filesystem.filesystem(self.path, self._fs)
        return self._pair

    def exists(self) -> bool:
        fs, where = self.pyarrow()
        return filesystem.exists(where, fs)

    def is_file(self) -> bool:
        import pyarrow.fs

        fs, where = self.pyarrow()
        return fs.get_file_info(where).type == pyarrow.fs.FileType.File

    def is_dir(self) -> bool:
        import pyarrow.fs

        fs, where = self.pyarrow()
        return fs.get_file_info(where).type == pyarrow.fs.FileType.Directory

    def file_stamps(self) -> list[tuple[str, int, int]] | None:
        """(name, size, modification time in ns) of each file in this folder, sorted; None where it is no folder."""
        import pyarrow.fs

        if not self.is_dir():
            return None
        fs, where = self.pyarrow()
        return sorted((f.base_name, f.size, f.mtime_ns or 0) for f in fs.get_file_info(pyarrow.fs.FileSelector(where))
                      if f.type == pyarrow.fs.FileType.File)

    def read_bytes(self) -> bytes:
        """A file's bytes (FileNotFoundError, or the object store's error, where there is none)."""
        if self.is_local and self._fs is None:
            return Path(self.path).read_bytes()
        fs, where = self.pyarrow()
        return filesystem.read_file(where, fs)

    def read_text(self) -> str | None:
        """A file's text; None if there is none."""
        if self.is_local and self._fs is None:
            if not os.path.isfile(self.path):
                return None
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        if not self.exists():
            return None
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes, make_folder: bool = True) -> None:
        """Write (replace) the file, creating its folder (unless known to be there)."""
        if self.is_local and self._fs is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(data)
            return
        fs, where = self.pyarrow()
        if make_folder:
            fs.create_dir(where.rpartition("/")[0], recursive=True)
        with fs.open_output_stream(where) as f:
            f.write(data)

    def append_text(self, text: str) -> None:
        """Append to a local file (an object store's objects are written whole), creating its folder."""
        assert self.is_local, f"{self.path}: an object store's file cannot be appended to"
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def list_files(self, suffix: str = "") -> list[str]:
        """The names of the files in this folder ending in `suffix`, sorted ([] where there is no folder)."""
        import pyarrow.fs

        fs, where = self.pyarrow()
        found = fs.get_file_info(pyarrow.fs.FileSelector(where, allow_not_found=True))
        return sorted(f.base_name for f in found if f.type == pyarrow.fs.FileType.File and f.base_name.endswith(suffix))

    def put_file(self, local_file: str | Path) -> None:
        """Copy a local file to this path."""
        import pyarrow.fs

        fs, where = self.pyarrow()
        pyarrow.fs.copy_files(str(local_file), where, source_filesystem=filesystem.local(), destination_filesystem=fs)

    def put_folder(self, local_folder: str | Path) -> None:
        """Copy a local folder's files into this folder (made if missing)."""
        import pyarrow.fs

        fs, where = self.pyarrow()
        fs.create_dir(where, recursive=True)
        pyarrow.fs.copy_files(str(local_folder), where, source_filesystem=filesystem.local(), destination_filesystem=fs)

    def put_files_in_order(self, local_folder: Path, last: str) -> None:
        """A local folder's files streamed into this folder, sorted by name, `last` after the others (its
        presence then means the folder is complete)."""
        fs, root = self.pyarrow()
        names = sorted(p.name for p in local_folder.iterdir() if p.name != last) + [last]
        for name in names:
            with open(local_folder / name, "rb") as src, fs.open_output_stream(f"{root}/{name}") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)

    def local_copy(self, folder: str) -> str:
        """A local path holding this file or folder: the path itself where it is local, else a copy downloaded
        into `folder` under the same base name, every name in the folder's listing checked first (DataError
        naming the key: pyarrow's copy_files writes a key's '..' parts as named, outside `folder`)."""
        if self.is_local:
            return self.path
        from behemoth.errors import DataError
        from behemoth.storage.model_copy import checked_listing, download

        fs, where = self.pyarrow()
        target = os.path.join(folder, self.path.rstrip("/").rpartition("/")[2])
        if self.is_dir():
            download(fs, where, checked_listing(fs, where, self.path, DataError), Path(target), self.path)
        else:
            Path(target).write_bytes(self.read_bytes())
        return target

    def working_folder(self, prefix: str) -> str:
        """Where to write files bound for this folder: the folder itself where it is local, else a new temporary
        folder of this machine (copied up with put_folder, removed by the caller)."""
        return self.path if self.is_local else tempfile.mkdtemp(prefix=prefix)

    @contextlib.contextmanager
    def built_here(self, prefix: str, last: str) -> Iterator[Path]:
        """A local folder to build this folder in: the place itself where it is local; else a temporary one whose
        files are uploaded (`last` after the others) once the block succeeds, and removed."""
        if self.is_local:
            yield Path(self.path)
            return
        with tempfile.TemporaryDirectory(prefix=prefix) as local:
            yield Path(local) / "built"
            self.put_files_in_order(Path(local) / "built", last)

    def absolute(self) -> str:
        """The path made absolute where it is local; a URI as it is."""
        return os.path.abspath(self.path) if self.is_local else self.path

    def expanded(self) -> str:
        """The path with a local `~` expanded; a URI as it is (Path would fold its //)."""
        return str(Path(self.path).expanduser()) if self.is_local else self.path
