"""A model's or a tokenizer's folder in an object store (model.pretrained, data.tokenizer: s3://..., gs://...) as
a folder on this node, copied once per node and reused: what a node the autoscaler just launched (a spot
replacement) needs, with nothing copied onto it by hand.

The copy is named by the URI and the store's listing of it (every file's path, size and modification time): a
changed folder in the store is a new copy (this URI's older copies on the node are removed then). Files arrive a few at once, each checked against the listed size (a stream cut short is
fetched again, then it is the store's failure), then a marker is written last: a copy without it (a download cut
short, a process killed) is made again. One download per node at a time (a flock on the node's copies folder),
so the node's workers share one copy. Copies stay for later runs; they live in the node's temp folder
(`behemoth-models-UID`), or a temporary folder of the process where that is not this user's alone.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from behemoth.errors import ConfigError
from behemoth.storage.filesystem import filesystem, is_uri
from behemoth.storage.node_copy import _copy, _locked, own_temp_folder

COMPLETE = ".behemoth-copy.json"


def listing(uri: str, key: str) -> dict[str, list]:
    """{path under the folder: [size, modification time in ns or None]} of every file in the store's folder at
    `uri` (the config's `key`)."""
    import pyarrow.fs

    try:
        fs, where = filesystem(uri)
        infos = fs.get_file_info(pyarrow.fs.FileSelector(where, recursive=True, allow_not_found=True))
    except OSError as e:
        raise ConfigError(f"{key} {uri}: the store cannot be listed ({' '.join(str(e).split())}): check the URI, "
                          f"the credentials (AWS_* variables or the instance's role) and AWS_ENDPOINT_URL for an "
                          f"S3-compatible store") from None
    return {info.path[len(where):].lstrip("/"): [info.size, info.mtime_ns] for info in infos
            if info.type == pyarrow.fs.FileType.File}


def local_source(value: str, key: str) -> str:
    """`value` as from_pretrained reads it: a URI's folder copied to this node (once), anything else as it is."""
    if not is_uri(value):
        return value
    files = listing(value, key)
    if not files:
        raise ConfigError(f"{key} {value}: no files there: upload the folder (e.g. `aws s3 sync DIR {value}`)")
    name = hashlib.sha256(json.dumps([value, sorted(files.items())]).encode()).hexdigest()[:32]
    parent = own_temp_folder("behemoth-models")
    if parent is None:  # (not this user's alone: a copy of this process's own)
        parent = Path(tempfile.mkdtemp(prefix="behemoth-models-"))
    folder = parent / name
    with _locked(parent):
        if not (folder / COMPLETE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            _download(value, files, folder, key)
            for other in parent.iterdir():  # this URI's older copies (the folder changed in the store since)
                if other != folder and _copied_from(other) == value:
                    shutil.rmtree(other, ignore_errors=True)
    return str(folder)


def _copied_from(folder: Path) -> str | None:
    try:
        return json.loads((folder / COMPLETE).read_text())["uri"]
    except (OSError, ValueError, KeyError):
        return None


def _download(uri: str, files: dict[str, list], folder: Path, key: str) -> None:
    fs, where = filesystem(uri)

    def fetch(name: str) -> None:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            got, _ = _copy(fs, f"{where}/{name}", target, f"{key} {uri}", name)
            if got == files[name][0]:
                return
        raise OSError(f"{key} {uri}: {name}: {got} of its {files[name][0]} bytes came back, twice (a download cut "
                      f"short)")

    folder.mkdir(parents=True)
    with ThreadPoolExecutor(max_workers=4) as pool:
        for done in [pool.submit(fetch, name) for name in files]:
            done.result()
    (folder / COMPLETE).write_text(json.dumps({"uri": uri, "files": files}))
