"""Packed token blocks on disk, in shards: written once as the packer fills them, read by global block index.

A split's blocks ([n, seq_len] tokens) are `.npy` files of about SHARD_BYTES of tokens each (`train-00000.npy`,
...), listed with their block counts, byte sizes and sha256 in the cache's meta.json (written last: its presence
means complete); a worker checks a shard against them the first time its node reads it (verify_once). The
packer streams full blocks into a ShardWriter, so building a corpus holds one shard in memory, not the corpus.
Each row is a record of the block's global index (`id`, written by the packer) and its tokens:
a gather returns both from the same rows, so the ids a batch reports (the sample ledger's) are those of the
tokens the model receives, read back with them; a gather that fetched the wrong rows reports the wrong ids.

Two ways the workers read them (data.token_store):
- `memory`: the driver loads every shard into one array, which reaches the workers through Ray's object store
  (the corpus must fit in it; no shared filesystem needed).
- `files`: the workers get only a TokenShards (the folder and the shard table, a few hundred bytes) and read
  the shards themselves, a batch being a gather by global block index. A local or shared-filesystem folder is
  memory-mapped, the next batch's pages asked of the kernel ahead (`prefetch`, madvise WILLNEED); the OS page
  cache is the per-worker cache. A URI folder (s3://...) is read with ranged requests (a batch's nearby blocks
  in one), the next batch's fetched ahead by a few threads, the last REMOTE_CACHE_BLOCKS blocks kept. The
  corpus need not fit in memory or the object store; the folder must be one every node reads (one machine, a
  shared filesystem, or the object store the URI names).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from behemoth.storage.checkpoint import stream_sha256
from behemoth.storage.store import Store
from behemoth.errors import DataError
from behemoth.storage.node_copy import own_temp_folder

SHARD_BYTES = 64 << 20
REMOTE_CACHE_BLOCKS = 4096  # per worker and split: blocks read from a URI kept for reuse
REMOTE_READERS = 8  # requests in flight to a URI, ahead of the step
REMOTE_HOLE_BYTES = 64 << 10  # blocks of a URI's shard closer than this are read by one request, gap included
REMOTE_RANGE_BYTES = 8 << 20  # and one request reads at most this much


def block_records(seq_len: int, dtype) -> np.dtype:
    """One stored block: its global index in the split, then its tokens."""
    return np.dtype([("id", "<i8"), ("tokens", np.dtype(dtype), (seq_len,))])


def as_records(blocks: np.ndarray, first_id: int) -> np.ndarray:
    """[n, seq_len] tokens as records numbered first_id, first_id + 1, ..."""
    out = np.empty(len(blocks), block_records(blocks.shape[1], blocks.dtype))
    out["id"] = np.arange(first_id, first_id + len(blocks))
    out["tokens"] = blocks
    return out


class ShardWriter:
    """Appends blocks of one split, numbering them in order; each SHARD_BYTES of tokens become one `.npy` file
    of block records in `folder`."""

    def __init__(self, folder: Path, split: str, seq_len: int, dtype, shard_bytes: int = SHARD_BYTES):
        self.folder, self.split, self.seq_len, self.dtype = Path(folder), split, seq_len, np.dtype(dtype)
        self.shard_blocks = max(1, shard_bytes // (seq_len * self.dtype.itemsize))
        self.pending: list[np.ndarray] = []
        self.pending_blocks = 0
        self.written = 0  # blocks in the shards written so far: the id of the next shard's first block
        self.shards: list[dict] = []

    def add(self, blocks: np.ndarray) -> None:
        self.pending.append(blocks)
        self.pending_blocks += len(blocks)
        while self.pending_blocks >= self.shard_blocks:
            stacked = np.concatenate(self.pending)
            self._write(stacked[:self.shard_blocks])
            rest = stacked[self.shard_blocks:]
            self.pending, self.pending_blocks = [rest], len(rest)

    def finish(self) -> list[dict]:
        """The shard table: [{"file", "blocks", "bytes", "sha256"}] in block order."""
        if self.pending_blocks:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_blocks = [], 0
        return self.shards

    def _write(self, blocks: np.ndarray) -> None:
        name = f"{self.split}-{len(self.shards):05d}.npy"
        path = self.folder / name
        np.save(path, as_records(blocks.astype(self.dtype, copy=False), self.written))
        self.written += len(blocks)
        with open(path, "rb") as f:  # (just written: read from the page cache)
            digest = stream_sha256(f)
        self.shards.append({"file": name, "blocks": len(blocks), "bytes": path.stat().st_size, "sha256": digest})


class TokenBlocks:
    """A split's block records in memory (data.token_store: memory): `len(blocks)`, `blocks.shape` and
    `blocks[ids]` (the tokens, [len(ids), seq_len]) as for an array of tokens, and `blocks.gather(ids)`, the
    records (`id`, `tokens`) of the rows read. Pickles as its array (Ray ships it out of band, zero-copy)."""

    def __init__(self, records: np.ndarray):
        self.records = records
        self.shape = (len(records), records.dtype["tokens"].shape[0])
        self.dtype = records.dtype["tokens"].base

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, ids) -> np.ndarray:
        return self.records[ids]["tokens"]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        tokens = self.records["tokens"]
        return tokens if dtype is None else tokens.astype(dtype)

    def gather(self, ids) -> np.ndarray:
        return self.records[np.asarray(ids, dtype=np.int64)]


def load_blocks(folder: str | Path, shards: list[dict], seq_len: int, dtype) -> TokenBlocks:
    """A split's blocks in memory (data.token_store: memory), from a local folder or a URI."""
    if not shards:
        return TokenBlocks(np.empty(0, block_records(seq_len, dtype)))
    arrays = []
    for shard in shards:
        where = f"{folder}/{shard['file']}"
        data = Store(where).read_bytes()
        if len(data) != shard["bytes"] or hashlib.sha256(data).hexdigest() != shard["sha256"]:
            raise DataError(_damaged(where, folder, shard, len(data) if len(data) != shard["bytes"] else None))
        arrays.append(np.load(io.BytesIO(data)))
    return TokenBlocks(np.concatenate(arrays))


def _damaged(where: str, folder, shard: dict, size: int | None = None) -> str:
    """The message for a shard that is not what its cache's meta.json says (`size`: its bytes, if they differ)."""
    what = (f"has {size} bytes, its cache's meta.json says {shard['bytes']}" if size is not None
            else "does not hold what its cache's meta.json says (its sha256 differs)")
    return f"token shard {where} {what}: the cache is damaged; delete {folder} and rerun to rebuild it"


RACY_S = 2.0  # a file modified this recently may change again within its timestamp's resolution (S3's: 1 s)


def verify_once(where: str, shard: dict, folder: str, fs=None) -> None:
    """Check a shard file (a local path, or a path on the pyarrow filesystem `fs`) against its size and sha256
    in the cache's meta.json, once per node: a marker in the node's temp folder, named by the file's place,
    size, times and expected hash, records that it passed, so the other workers on the node, the next epochs
    and later runs over the same unchanged file skip the read. One process hashes at a time (the others wait,
    then find the marker). No marker for a file modified in the last RACY_S seconds or without a modification
    time (a change could keep its name), nor where the node's marker folder is not this user's own: those are
    hashed at each first read. A file that fails is a DataError naming it; a missing one, FileNotFoundError."""
    if fs is None:
        st = os.stat(where)
        size, mtime = st.st_size, st.st_mtime_ns
        stamp = f"{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}"
    else:
        import pyarrow.fs

        info = fs.get_file_info(where)
        if info.type == pyarrow.fs.FileType.NotFound:
            raise FileNotFoundError(f"{folder}/{shard['file']} does not exist")
        size, mtime = info.size, info.mtime_ns
        stamp = str(mtime)
    if size != shard["bytes"]:
        raise DataError(_damaged(f"{folder}/{shard['file']}", folder, shard, size))
    key = hashlib.sha256(f"{fs.type_name if fs else 'local'}:{where}:{size}:{stamp}:{shard['sha256']}".encode())
    remember = mtime is not None and time.time() - mtime / 1e9 > RACY_S
    marker = _marker(key.hexdigest()[:32]) if remember else None
    if marker is not None and marker.exists():
        return
    with _held(marker):
        if marker is not None and marker.exists():
            return
        with (open(where, "rb") if fs is None else fs.open_input_stream(where)) as f:
            digest = stream_sha256(f)
        if digest != shard["sha256"]:
            raise DataError(_damaged(f"{folder}/{shard['file']}", folder, shard))
        if marker is not None:
            with contextlib.suppress(OSError):  # not remembered: checked again at the next first read
                marker.touch()


def _marker(name: str) -> Path | None:
    """The marker's path in this user's own folder of the node's temp folder; None where that folder cannot
    be made or is not a folder of this user's alone (another user could plant markers in it)."""
    folder = own_temp_folder("behemoth-verified-shards")
    return None if folder is None else folder / name


@contextlib.contextmanager
def _held(marker: Path | None):
    """The marker's lock (flock: released when the file closes, also if this process dies); nothing to hold
    without a marker or where the lock file cannot be opened."""
    try:
        fd = os.open(f"{marker}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600) if marker else None
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def upload(local: Path, uri: str) -> None:
    """A finished local cache folder to `uri`: the shards first, meta.json last (its presence means complete)."""
    Store(uri).put_files_in_order(local, last="meta.json")


class TokenShards:
    """A split's blocks read from their shard files: `len(blocks)`, `blocks[ids]` (tokens by global block index,
    in the order of `ids`), `blocks.gather(ids)` (the records read: `id`, `tokens`), `blocks.prefetch(ids)`.
    Pickles as its folder and shard table; each process opens the files itself, on first use."""

    def __init__(self, folder: str | Path, shards: list[dict], seq_len: int, dtype):
        self.folder, self.shards, self.seq_len, self.dtype = str(folder), shards, seq_len, np.dtype(dtype)
        self.record = block_records(seq_len, dtype)
        self.starts = np.cumsum([0] + [s["blocks"] for s in shards])
        self.shape = (int(self.starts[-1]), seq_len)
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}  # shard -> (mapping, its rows)
        self._remote = None  # a URI folder's reader, made on first use in each process
        self._mapped = Store(folder).is_local  # a local folder's files are memory-mapped, a URI's read by range

    def __len__(self) -> int:
        return self.shape[0]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}, "_remote": None}

    def __getitem__(self, ids) -> np.ndarray:
        return self.gather(ids)["tokens"]

    def gather(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"block index out of range [0, {len(self)})")
        if not self._mapped:
            return self._reader().gather(ids)
        out = np.empty(len(ids), self.record)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        for s in np.unique(shard):
            where = shard == s
            out[where] = self._array(int(s))[ids[where] - self.starts[s]]
        return out

    def prefetch(self, ids) -> None:
        """Start reading these blocks now, so the gather that follows finds them read: a URI's blocks are
        fetched by background threads, a local file's pages asked of the kernel (asynchronously)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self._mapped:
            self._reader().prefetch(ids)
            return
        row, page = self.record.itemsize, mmap.PAGESIZE
        for i in map(int, ids):
            s, offset = self.locate(i)
            aligned = offset // page * page
            self._open(s)[0].madvise(mmap.MADV_WILLNEED, aligned, offset + row - aligned)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard index, byte offset in its file) of block `i`."""
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        return s, self._header(s) + int(i - self.starts[s]) * self.record.itemsize

    def _header(self, s: int) -> int:
        """The bytes of shard `s`'s .npy header: its file's size less its rows'."""
        shard = self.shards[s]
        return shard["bytes"] - shard["blocks"] * self.record.itemsize

    def _reader(self) -> RemoteBlocks:
        if self._remote is None:
            self._remote = RemoteBlocks(self)
        return self._remote

    def _array(self, s: int) -> np.ndarray:
        return self._open(s)[1]

    def _open(self, s: int) -> tuple[mmap.mmap, np.ndarray]:
        if s not in self._maps:
            shard = self.shards[s]
            path = Path(self.folder) / shard["file"]
            if not path.exists():
                raise DataError(f"token shard {path} does not exist on this node: with data.token_store: files, "
                                f"data.cache_dir must be a folder every node reads (one machine or a shared "
                                f"filesystem), or use token_store: memory")
            verify_once(str(path), shard, self.folder)
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            rows = np.frombuffer(m, dtype=self.record, offset=self._header(s), count=shard["blocks"])
            self._maps[s] = (m, rows)
        return self._maps[s]


class RemoteBlocks:
    """Blocks of a URI folder's shards by ranged reads, REMOTE_READERS at a time, started ahead by prefetch:
    the blocks a prefetch asks for that lie within REMOTE_HOLE_BYTES of each other in one shard are read by one
    request (the gap with them; at most REMOTE_RANGE_BYTES a request), so a sequential pass (evaluation, an
    unshuffled epoch) costs a request per few MB instead of one per block. The last REMOTE_CACHE_BLOCKS blocks
    are kept (a block re-read within an epoch, or the evaluation's, costs no request). `requests`: those
    started."""

    def __init__(self, store: TokenShards):
        self.store, self.row = store, store.record.itemsize
        self.fs, self.root = Store(store.folder).pyarrow()
        self.files: dict[str, object] = {}
        self.pool = ThreadPoolExecutor(REMOTE_READERS, thread_name_prefix="behemoth-blocks")
        self.pending: OrderedDict[int, tuple[Future, int]] = OrderedDict()  # block -> (its range's read, row)
        self.lock = threading.Lock()
        self.gates: dict[int, threading.Lock] = {}  # shard -> held while it is checked (verify_once)
        self.checked: set[int] = set()
        self.requests = 0

    def prefetch(self, ids: np.ndarray) -> list[tuple[Future, int]]:
        """The reads of these blocks, started (or found started or done)."""
        with self.lock:
            wanted = [int(i) for i in ids]
            for run in self._ranges(sorted({i for i in wanted if i not in self.pending})):
                read = self.pool.submit(self._read, run)
                self.requests += 1
                for k, i in enumerate(run):
                    self.pending[i] = (read, k)
            found = []
            for i in wanted:
                self.pending.move_to_end(i)
                found.append(self.pending[i])
            while len(self.pending) > REMOTE_CACHE_BLOCKS:
                self.pending.popitem(last=False)
        return found

    def gather(self, ids: np.ndarray) -> np.ndarray:
        rows = [read.result()[k] for read, k in self.prefetch(ids)]
        return np.concatenate(rows) if rows else np.empty(0, self.store.record)

    def _ranges(self, ids: list[int]) -> list[list[int]]:
        """Sorted block ids grouped into the runs one request each reads."""
        runs: list[list[int]] = []
        last = None  # (shard, offset of the run's first block, of its last)
        for i in ids:
            s, offset = self.store.locate(i)
            if (last is not None and s == last[0] and offset - last[2] - self.row <= REMOTE_HOLE_BYTES
                    and offset + self.row - last[1] <= REMOTE_RANGE_BYTES):
                runs[-1].append(i)
                last = (s, last[1], offset)
            else:
                runs.append([i])
                last = (s, offset, offset)
        return runs

    def _read(self, run: list[int]) -> list[np.ndarray]:
        """The records of one run of blocks (one shard), by one ranged request."""
        s, first = self.store.locate(run[0])
        end = self.store.locate(run[-1])[1] + self.row
        shard = self.store.shards[s]
        path = f"{self.root}/{shard['file']}"
        try:
            with self.lock:
                gate = self.gates.setdefault(s, threading.Lock())
            if s not in self.checked:
                with gate:  # the reads of this shard wait for its check
                    if s not in self.checked:
                        verify_once(path, shard, self.store.folder, self.fs)
                        self.checked.add(s)
            with self.lock:
                f = self.files.get(path) or self.files.setdefault(path, self.fs.open_input_file(path))
            data = f.read_at(end - first, first)
        except (OSError, FileNotFoundError) as e:
            raise DataError(f"token shard {self.store.folder}/{shard['file']}: cannot read blocks {run[0]}-{run[-1]} "
                            f"({e})") from None
        if len(data) != end - first:
            raise DataError(f"token shard {self.store.folder}/{shard['file']} ends before block {run[-1]}: the cache "
                            f"is damaged; delete {self.store.folder} and rerun to rebuild it")
        at = [self.store.locate(i)[1] - first for i in run]
        return [np.frombuffer(data[a:a + self.row], dtype=self.store.record) for a in at]
