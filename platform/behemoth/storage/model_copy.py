"""A model's or a tokenizer's folder in an object store (model.pretrained, data.tokenizer: s3://..., gs://...) as
a folder on this node, copied once per node and reused: what a node the autoscaler just launched (a spot
replacement) needs, with nothing copied onto it by hand.

Every name the store's listing gives is checked before anything is written (paths.listing_problem): a key with a
'..' part is read by the store as another object (S3 reads 'P/../../X' as 'X') and written as named it would land
outside the copy's folder. The same listing and download copy any store's folder here (`checked_listing`,
`download`: a Hugging Face folder's weights, a run's report for MLflow).

The copy is named by the URI and the store's listing of what it holds (every file's path, size, modification
time and, where the store gives one, ETag: S3's times have whole seconds, so an object rewritten with the same size
within a second keeps its size and time, not its ETag): a changed folder in the store is a new copy (this URI's
older copies of the same kind on the node are removed then). A copy to read the config or the tokenizer
(`weights=False`: `behemoth check`, a tokenizer's load) holds the folder's top-level files but the weights; the
model's builder copies everything. Files arrive a few at once, each checked against the listed size (a stream cut
short is fetched again, then it is the store's failure), then a marker is written last: a copy without it (a
download cut short, a process killed) is made again. One download per node at a time (a flock on the node's
copies folder), so the node's workers share one copy. Copies stay for later runs; they live in the node's temp
folder (`behemoth-models-UID`), or a temporary folder of the process where that is not this user's alone.
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
from behemoth.storage.paths import listing_problem

COMPLETE = ".behemoth-copy.json"
# What from_pretrained reads as weights (safetensors, torch, TF, Flax, GGUF, ONNX files): left out of a copy made to
# read a folder's config or tokenizer, which are top-level JSON, text and sentencepiece files
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def checked_listing(fs, where: str, what: str, error: type[Exception] = ConfigError) -> dict[str, list]:
    """{path under the folder: [size, modification time in ns or None]} of every file below `where` on the
    pyarrow filesystem `fs`, every name one that can be copied as named (else `error`, one line naming `what` and
    the key). (pyarrow's own copy_files writes a key's '..' parts as they are.)"""
    import pyarrow.fs

    infos = fs.get_file_info(pyarrow.fs.FileSelector(where, recursive=True, allow_not_found=True))
    # (one '/' after the folder taken off, not all: a key's leading '/' is an empty part, read as another object)
    files = {info.path[len(where.rstrip("/")) + 1:]: [info.size, info.mtime_ns] for info in infos
             if info.type == pyarrow.fs.FileType.File}
    problem = listing_problem(files)
    if problem:
        raise error(f"{what}: {problem}: rename or remove it in the store (nothing was copied)")
    return files


def listing(uri: str, key: str) -> dict[str, list]:
    """checked_listing of the store's folder at `uri` (the config's `key`); a store that cannot be listed is one
    ConfigError too."""
    try:
        fs, where = filesystem(uri)
        return checked_listing(fs, where, f"{key} {uri}")
    except OSError as e:
        raise ConfigError(f"{key} {uri}: the store cannot be listed ({' '.join(str(e).split())}): check the URI, "
                          f"the credentials (AWS_* variables or the instance's role) and AWS_ENDPOINT_URL for an "
                          f"S3-compatible store") from None


def stored_listing(value: str, key: str) -> dict[str, list] | None:
    """`listing` of an object store's folder; None where `value` names none (a local path or a Hub name, which
    from_pretrained reads as they are)."""
    return listing(value, key) if is_uri(value) else None


def local_source(value: str, key: str, weights: bool = True) -> str:
    """`value` as from_pretrained reads it: a URI's folder copied to this node (once), anything else as it is.
    `weights` False: a copy without the weight files, for reading the config or the tokenizer."""
    if not is_uri(value):
        return value
    files = listing(value, key)
    if not files:
        raise ConfigError(f"{key} {value}: no files there: upload the folder (e.g. `aws s3 sync DIR {value}`)")
    if not weights:
        files = {name: entry for name, entry in files.items() if "/" not in name and not name.endswith(WEIGHT_SUFFIXES)}
    fs, where = filesystem(value)
    files = _with_etags(fs, where, files)
    name = hashlib.sha256(json.dumps([value, weights, sorted(files.items())]).encode()).hexdigest()[:32]
    parent = own_temp_folder("behemoth-models")
    if parent is None:  # (not this user's alone: a copy of this process's own)
        parent = Path(tempfile.mkdtemp(prefix="behemoth-models-"))
    folder = parent / name
    with _locked(parent):
        if not (folder / COMPLETE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            download(fs, where, files, folder, f"{key} {value}")
            (folder / COMPLETE).write_text(json.dumps({"uri": value, "weights": weights, "files": files}))
            for other in parent.iterdir():  # this URI's older copies of this kind (the folder changed since)
                if other != folder and _copied_from(other) == (value, weights):
                    shutil.rmtree(other, ignore_errors=True)
    return str(folder)


def _with_etags(fs, where: str, files: dict[str, list]) -> dict[str, list]:
    """Each file's entry with the store's ETag appended (None where it gives none: a local file://), asked a
    few files at once (S3: one HEAD each). pyarrow's listing drops the ETag that S3's own listing holds."""

    def etag(name: str) -> str | None:
        with fs.open_input_file(f"{where}/{name}") as f:
            found = {k.lower(): v for k, v in (f.metadata() or {}).items()}.get("etag")
        return found.decode(errors="replace") if isinstance(found, bytes) else found

    with ThreadPoolExecutor(max_workers=8) as pool:
        tags = dict(zip(files, pool.map(etag, files)))
    return {name: [*entry, tags[name]] for name, entry in files.items()}


def _copied_from(folder: Path) -> tuple[str, bool] | None:
    """(URI, with weights) of a complete copy (a copy made before copies without weights: with them)."""
    try:
        marker = json.loads((folder / COMPLETE).read_text())
        return marker["uri"], marker.get("weights", True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def download(fs, where: str, files: dict[str, list], folder: Path, what: str) -> None:
    """Every file of `files` (checked_listing's: name -> [size, ...]) below `where` on `fs` into `folder` (made if
    missing), a few at once, each checked against its listed size: a stream cut short is fetched once more, then it
    is the store's failure (OSError naming `what` and the file)."""

    def fetch(name: str) -> None:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            got, _ = _copy(fs, f"{where}/{name}", target, what, name)
            if got == files[name][0]:
                return
        raise OSError(f"{what}: {name}: {got} of its {files[name][0]} bytes came back, twice (a download cut "
                      f"short)")

    folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=4) as pool:
        for done in [pool.submit(fetch, name) for name in files]:
            done.result()
