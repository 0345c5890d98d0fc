"""Packed token blocks on disk, in shards: written once as the packer fills them, read by global block index.

A split's blocks ([n, seq_len] tokens) are `.npy` files of about SHARD_BYTES each (`train-00000.npy`, ...),
listed with their block counts and byte sizes in the cache's meta.json (written last: its presence means
complete). The packer streams full blocks into a ShardWriter, so building a corpus holds one shard in memory,
not the corpus.

Two ways the workers read them (data.token_store):
- `memory`: the driver loads every shard into one array, which reaches the workers through Ray's object store
  (the corpus must fit in it; no shared filesystem needed).
- `files`: the workers get only a TokenShards (the folder and the shard table, a few hundred bytes) and
  memory-map the shards themselves; a batch is a gather by global block index, and the next batch's pages are
  asked of the kernel ahead (`prefetch`, madvise WILLNEED). The OS page cache is the per-worker cache. The
  corpus need not fit in memory or the object store; the cache folder must be readable by every node (one
  machine, or a shared filesystem).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from behemoth.errors import DataError

SHARD_BYTES = 64 << 20


class ShardWriter:
    """Appends blocks of one split; each SHARD_BYTES of them become one `.npy` file in `folder`."""

    def __init__(self, folder: Path, split: str, seq_len: int, dtype, shard_bytes: int = SHARD_BYTES):
        self.folder, self.split, self.seq_len, self.dtype = Path(folder), split, seq_len, np.dtype(dtype)
        self.shard_blocks = max(1, shard_bytes // (seq_len * self.dtype.itemsize))
        self.pending: list[np.ndarray] = []
        self.pending_blocks = 0
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
        """The shard table: [{"file", "blocks", "bytes"}] in block order."""
        if self.pending_blocks:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_blocks = [], 0
        return self.shards

    def _write(self, blocks: np.ndarray) -> None:
        name = f"{self.split}-{len(self.shards):05d}.npy"
        np.save(self.folder / name, np.ascontiguousarray(blocks, dtype=self.dtype))
        self.shards.append({"file": name, "blocks": len(blocks), "bytes": (self.folder / name).stat().st_size})


def load_blocks(folder: str | Path, shards: list[dict], seq_len: int, dtype) -> np.ndarray:
    """A split's blocks as one array in memory (data.token_store: memory)."""
    if not shards:
        return np.empty((0, seq_len), dtype)
    return np.concatenate([np.load(Path(folder) / s["file"]) for s in shards])


class TokenShards:
    """A split's blocks read from their shard files: `len(blocks)`, `blocks[ids]` (rows by global block index,
    in the order of `ids`), `blocks.prefetch(ids)`. Pickles as its folder and shard table; each process opens
    the files itself, on first use."""

    def __init__(self, folder: str | Path, shards: list[dict], seq_len: int, dtype):
        self.folder, self.shards, self.seq_len, self.dtype = str(folder), shards, seq_len, np.dtype(dtype)
        self.starts = np.cumsum([0] + [s["blocks"] for s in shards])
        self.shape = (int(self.starts[-1]), seq_len)
        self._maps: dict[int, tuple[mmap.mmap, int, np.ndarray]] = {}  # shard -> (mapping, header bytes, rows)

    def __len__(self) -> int:
        return self.shape[0]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"block index out of range [0, {len(self)})")
        out = np.empty((len(ids), self.seq_len), self.dtype)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        for s in np.unique(shard):
            where = shard == s
            out[where] = self._array(int(s))[ids[where] - self.starts[s]]
        return out

    def prefetch(self, ids) -> None:
        """Ask the kernel to read these blocks' pages now (asynchronously), so the gather that follows finds
        them in the page cache."""
        ids = np.asarray(ids, dtype=np.int64)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        row = self.seq_len * self.dtype.itemsize
        page = mmap.PAGESIZE
        for s, i in zip(shard, ids):
            m, header, _ = self._open(int(s))
            start = header + int(i - self.starts[s]) * row
            aligned = start // page * page
            m.madvise(mmap.MADV_WILLNEED, aligned, start + row - aligned)

    def _array(self, s: int) -> np.ndarray:
        return self._open(s)[2]

    def _open(self, s: int) -> tuple[mmap.mmap, int, np.ndarray]:
        if s not in self._maps:
            shard = self.shards[s]
            path = Path(self.folder) / shard["file"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise DataError(f"token shard {path} does not exist on this node: with data.token_store: files, "
                                f"data.cache_dir must be a folder every node reads (one machine or a shared "
                                f"filesystem), or use token_store: memory") from None
            if size != shard["bytes"]:
                raise DataError(f"token shard {path} has {size} bytes, its cache's meta.json says {shard['bytes']}: "
                                f"the cache is damaged; delete {self.folder} and rerun to rebuild it")
            header = size - shard["blocks"] * self.seq_len * self.dtype.itemsize  # the .npy header's bytes
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            rows = np.frombuffer(m, dtype=self.dtype, offset=header).reshape(shard["blocks"], self.seq_len)
            self._maps[s] = (m, header, rows)
        return self._maps[s]
