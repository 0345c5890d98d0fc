"""Packing a tokenised corpus into the token store, and its cache: `prepare_text` runs steps 1 and 2 of
data/text/text.py's pipeline (the sources cut into work units, tokenised by Ray Data tasks), then step 3 below, once
per corpus; the packed blocks are kept on disk (data.cache_dir, keyed by a fingerprint of the sources, the
tokenizer, seq_len and the split) and read from there by every later run.

3. The streams, in corpus order, are cut into blocks of seq_len tokens (`Packer`): documents are joined by
   EOS and a block may hold the end of one document and the start of the next. No padding anywhere; the
   only tokens not in a block are the final partial block of each split (< seq_len tokens), dropped and
   counted in the cache's meta.json. Labels are the inputs: the model shifts them.

The packed blocks ([n, seq_len] arrays) are written to the cache in shards as they fill
(behemoth.data.token_store), and reach the training workers through Ray's object store (data.token_store:
memory; the nodes need no shared filesystem) or as files each worker memory-maps (files; a corpus larger than
memory). The global order over blocks is behemoth.data.order's, as for images.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from behemoth.data.pipeline import ordered_data_context
from behemoth.data.text.text import (
    TextData,
    TokenizerSpec,
    Unit,
    load_tokenizer,
    plan_units,
    tokenize_rows,
    tokenize_units,
)
from behemoth.data.token_store import ShardWriter, TokenBlocks, TokenShards, load_blocks
from behemoth.errors import DataError
from behemoth.progress import progress
from behemoth.storage import paths
from behemoth.storage.store import Store

CACHE_VERSION = 5  # 5: a document after BOS where the tokenizer starts texts with one, special tokens' text as
# text, empty texts skipped; 4: shards with their sha256; 3: each block with its index; 2: shards of tokens;
# 1: train.npy


@dataclass
class TokenIndex:
    """Packed token blocks per split, and what the model needs to know about the tokenizer."""

    train: TokenBlocks | TokenShards  # [blocks, seq_len], uint16 (vocab <= 65535) or int32; in memory or files
    val: TokenBlocks | TokenShards
    vocab_size: int
    eos_id: int
    bos_id: int | None
    stats: dict = field(default_factory=dict)  # documents, tokens, dropped tail tokens per split; cache path


# ---------------------------------------------------------------------------------------------------------
# Packing: one ordered token stream per split -> [blocks, seq_len]


class Packer:
    """Cuts a stream of token arrays into rows of seq_len tokens; the carry crosses chunk boundaries."""

    def __init__(self, seq_len: int, dtype=np.int32, sink=None):
        """`sink`: called with each chunk of full blocks (a ShardWriter's add); without one they are kept."""
        self.seq_len, self.dtype, self.sink = seq_len, dtype, sink
        self.blocks: list[np.ndarray] = []
        self.count = 0
        self.carry = np.empty(0, dtype=dtype)
        self.tokens = 0
        self.documents = 0

    def add(self, tokens: np.ndarray, documents: int = 0) -> None:
        self.tokens += len(tokens)
        self.documents += documents
        stream = np.concatenate([self.carry, tokens.astype(self.dtype, copy=False)])
        full = len(stream) // self.seq_len * self.seq_len
        if full:
            blocks = stream[:full].reshape(-1, self.seq_len)
            self.count += len(blocks)
            if self.sink:
                self.sink(blocks)
            else:
                self.blocks.append(blocks)
        self.carry = stream[full:]

    def finish(self) -> tuple[np.ndarray, dict]:
        """The full blocks kept (none with a sink), and the counts; the final len(carry) < seq_len tokens are
        dropped."""
        blocks = np.concatenate(self.blocks) if self.blocks else np.empty((0, self.seq_len), self.dtype)
        return blocks, {"documents": self.documents, "tokens": self.tokens, "blocks": self.count,
                        "tail_tokens_dropped": len(self.carry)}


# ---------------------------------------------------------------------------------------------------------
# The whole preparation, with its cache


def check_text_sources(cfg: TextData) -> list[Unit]:
    """Everything that can be checked without Ray: files, formats, columns, the tokenizer."""
    load_tokenizer(cfg.tokenizer)
    if cfg.hf_dataset:
        _hf_splits(cfg)
        return []
    return plan_units(cfg)


EXACT_BYTES = 1 << 22  # training text up to this size is counted in blocks before Ray (about a second's tokenising)


def count_train_blocks(cfg: TextData, units: list[Unit], seed: int) -> int | None:
    """The training blocks packing will make, counted on the driver before Ray where the training files hold at
    most EXACT_BYTES (tokenised here as the Ray Data tasks will: tokenize_units); None for a larger corpus or a
    Hugging Face dataset, whose blocks are known once packed (sequence.prepare_data checks the epoch then)."""
    train = tuple(u for u in units if u.split != "val")
    if cfg.hf_dataset or not train or sum(map(os.path.getsize, {u.path for u in train})) > EXACT_BYTES:
        return None
    return _count_blocks(train, cfg.tokenizer, cfg.text_field, cfg.seq_len, seed, cfg.val_fraction)


@functools.lru_cache(maxsize=8)  # (a sweep checks every trial's job against the same data)
def _count_blocks(units: tuple[Unit, ...], tokenizer: str, text_field: str, seq_len: int, seed: int,
                  val_fraction: float) -> int:
    rows = pa.Table.from_pylist([dataclasses.asdict(u) for u in units])
    tokens = tokenize_units(rows, text_field=text_field, tokenizer=TokenizerSpec.of(tokenizer), seed=seed,
                            val_fraction=val_fraction)
    return sum(len(t) for split, t in zip(tokens["split"].to_pylist(), tokens["tokens"].to_pylist())
               if split == "train") // seq_len


def prepare_text(cfg: TextData, seed: int, units: list[Unit] | None = None) -> TokenIndex:
    """Tokenise and pack the corpus (or reuse the cached result). Needs Ray (ray.init done).
    `units`: what check_text_sources returned, when the caller has already checked the sources."""
    units = check_text_sources(cfg) if units is None else units
    tok = load_tokenizer(cfg.tokenizer)
    dtype = np.uint16 if len(tok) <= np.iinfo(np.uint16).max + 1 else np.int32
    return packed_index(cfg, units, seed, dtype, tok, _pack_into)


def packed_index(cfg: TextData, units: list[Unit], seed: int, dtype, tok, pack, key: dict | None = None) -> TokenIndex:
    """The corpus packed by `pack(folder, cfg, units, seed, dtype) -> meta` into the cache (built once, under a
    fingerprint of the sources, the tokenizer, `cfg` and `key`), read as the workers will read it."""
    vocab = len(tok)
    cache = paths.join(paths.storage_root(cfg.cache_dir), _fingerprint(cfg, units, seed, key))
    meta = _cache_meta(cache)
    if meta is None:
        with Store(cache).built_here("behemoth-tokens-", last="meta.json") as folder:  # a URI's: uploaded, meta last
            _build_cache(cfg, units, seed, dtype, folder, pack)
        meta = _cache_meta(cache)
    read = TokenShards if cfg.token_store == "files" else load_blocks
    arrays = {s: read(cache, meta[s]["shards"], cfg.seq_len, dtype) for s in ("train", "val")}
    return TokenIndex(train=arrays["train"], val=arrays["val"], vocab_size=vocab, eos_id=tok.eos_token_id,
                      bos_id=tok.bos_token_id, stats={**meta, "cache": str(cache)})


def _cache_meta(cache: str) -> dict | None:
    """A complete cache's meta.json (local or under a URI), or None. Every shard it names is a file of the cache's
    own folder (the workers read and memory-map each one joined onto it): else DataError, the cache damaged."""
    try:
        meta = json.loads(Store(f"{cache}/meta.json").read_bytes())
    except (FileNotFoundError, OSError):
        return None
    for split in ("train", "val"):
        for shard in meta.get(split, {}).get("shards", []):
            if "/" in shard["file"] or not paths.is_inside(shard["file"]):
                raise DataError(f"token cache {cache}: its meta.json names the shard {shard['file']!r}, not a file "
                                f"of the cache's folder: the cache is damaged; delete {cache} and rerun to rebuild it")
    return meta


def _build_cache(cfg: TextData, units: list[Unit], seed: int, dtype, cache: Path, pack) -> None:
    """Tokenise and pack into shards in a temporary folder beside `cache`, renamed to it when complete."""
    # a name of its own: on a shared filesystem another node's builder may have this pid (containers), and its
    # half-built folder is not ours to remove
    tmp = cache.with_name(f"{cache.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        meta = pack(tmp, cfg, units, seed, dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # last: its presence means complete
    try:
        os.replace(tmp, cache)
    except OSError:  # another run built the same cache meanwhile: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)


def _pack_into(folder: Path, cfg: TextData, units: list[Unit], seed: int, dtype) -> dict:
    """The token stream packed into each split's shards in `folder` (one shard in memory at a time); the meta."""
    writers = {split: ShardWriter(folder, split, cfg.seq_len, dtype) for split in ("train", "val")}
    packers = {split: Packer(cfg.seq_len, dtype, sink=writers[split].add) for split in ("train", "val")}
    for batch in progress(_token_stream(cfg, units, seed), "tokenising", total=None if cfg.hf_dataset else len(units),
                          unit="unit" if not cfg.hf_dataset else "batch"):
        for split, tokens, docs in zip(batch["split"].to_pylist(), _list_values(batch["tokens"]),
                                       batch["documents"].to_pylist()):
            packers[split].add(tokens, docs)
    meta = {"version": CACHE_VERSION, "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer,
            "dtype": np.dtype(dtype).name}
    for split, packer in packers.items():
        _, counts = packer.finish()
        if counts["blocks"] == 0:
            raise DataError(f"the {split} text holds {counts['tokens']} tokens ({counts['documents']} documents), "
                            f"fewer than one block of data.seq_len={cfg.seq_len}: add text or lower seq_len")
        meta[split] = {**counts, "shards": writers[split].finish()}
    return meta


def _list_values(column: pa.ChunkedArray):
    """The rows of a list<int32> column as numpy views, without a Python list per token."""
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy()
        for i in range(len(chunk)):
            yield values[offsets[i]:offsets[i + 1]]


def _token_stream(cfg: TextData, units: list[Unit], seed: int):
    """Ray Data: tokenised units (or HF rows) in corpus order, as pyarrow tables with split/tokens/documents."""
    import ray.data

    # A DataError raised in a task reaches the user as one line (cli); Ray Data would also log its trace.
    ordered_data_context(logging.CRITICAL)
    spec = TokenizerSpec.of(cfg.tokenizer)
    spec = dataclasses.replace(spec, core=ray.put(spec.core))  # once, not once per task
    common = {"text_field": cfg.text_field, "tokenizer": spec, "seed": seed, "val_fraction": cfg.val_fraction}
    if cfg.hf_dataset:
        pipelines = [ray.data.from_blocks(_hf_blocks(ds, cfg.text_field)).map_batches(
            tokenize_rows, batch_format="numpy", batch_size=HF_ROWS_PER_BLOCK, num_cpus=cfg.cpus_per_task,
            fn_kwargs={**common, "split": split}) for split, ds in _hf_splits(cfg)]
    else:
        rows = [{"split": u.split, "path": u.path, "fmt": u.fmt, "start": u.start, "end": u.end} for u in units]
        pipelines = [ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            tokenize_units, batch_format="pyarrow", batch_size=1, num_cpus=cfg.cpus_per_task, fn_kwargs=common)]
    for ds in pipelines:
        yield from ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=4)


HF_ROWS_PER_BLOCK = 1000


def _hf_blocks(ds, text_field: str) -> list:
    """The text column of a loaded datasets.Dataset as Arrow tables of HF_ROWS_PER_BLOCK rows, in order.

    Not ray.data.from_huggingface: for a Dataset that is not a hub dataset as published (a local
    save_to_disk folder, a transformed one) it first tries to reload it by its builder name (`json`,
    `parquet`, ...) to compare fingerprints, and with no data files given that builder globs the working
    directory recursively (slow from a large folder, such as a repository root). Then it falls back
    to this very read: the dataset's Arrow table, already on this node (memory-mapped)."""
    table = ds.select_columns([text_field]).with_format("arrow")[:]
    return [table.slice(i, HF_ROWS_PER_BLOCK) for i in range(0, max(table.num_rows, 1), HF_ROWS_PER_BLOCK)]


def _hf_splits(cfg: TextData, field: str | None = None, pairs: tuple[str, str, str] | None = None
               ) -> list[tuple[str, object]]:
    """[(split, datasets.Dataset)]: the train and validation splits, or train with split 'auto'; each with the
    column `field` alone (data.text_field's, which must hold text, by default), or with `pairs` (a preference
    pair's prompt, chosen and rejected fields) the two replies' columns and the prompt's where there is one."""
    import datasets

    try:
        if Path(cfg.hf_dataset).is_dir():
            loaded = datasets.load_from_disk(cfg.hf_dataset)
        else:
            loaded = datasets.load_dataset(cfg.hf_dataset, cfg.hf_config_name)
    except Exception as e:  # datasets raises many types: missing folder, no network, unknown name
        raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} cannot be loaded: {' '.join(str(e).split())}") from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({cfg.train_split: loaded})
    chosen = [(cfg.train_split, "train" if cfg.val_fraction == 0 else "auto")]
    if cfg.val_fraction == 0:
        chosen.append((cfg.val_split, "val"))
    out = []
    for name, split in chosen:
        if name not in loaded:
            raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} has no split '{name}' (its splits: "
                            f"{list(loaded)}); set data.train_split/data.val_split, or data.val_fraction")
        ds = loaded[name]
        if pairs:
            missing = [f for f in pairs[1:] if f not in ds.column_names]
            if missing:
                raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} split '{name}' has no column "
                                f"{' or '.join(map(repr, missing))} (data.chosen_field / data.rejected_field); its "
                                f"columns: {ds.column_names}")
            out.append((split, ds.select_columns([f for f in pairs if f in ds.column_names])))
            continue
        column, key = (field, "data.messages_field") if field else (cfg.text_field, "data.text_field")
        if column not in ds.column_names:
            raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} split '{name}' has no column "
                            f"'{column}' ({key}); its columns: {ds.column_names}")
        feature = ds.features[column]  # (a chat dataset's `messages` is a list of turns, not text)
        if not field and getattr(feature, "dtype", None) not in ("string", "large_string"):
            hint = ": a conversation column is data.kind chat's (data.messages_field)" if "role" in str(feature) else ""
            raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} split '{name}': column '{column}' "
                            f"(data.text_field) holds {feature}, not text{hint}")
        out.append((split, ds.select_columns([column])))
    return out


def _fingerprint(cfg: TextData, units: list[Unit], seed: int, key: dict | None = None) -> str:
    """Changes when anything that changes the packed blocks changes (`key`: a packing's own settings)."""
    h = hashlib.sha256()
    parts = {"version": CACHE_VERSION, "seq_len": cfg.seq_len, "text_field": cfg.text_field,
             "document": cfg.document, "text_format": cfg.text_format, "val_fraction": cfg.val_fraction,
             "seed": seed if cfg.val_fraction else None, "hf": [cfg.hf_dataset, cfg.hf_config_name,
                                                                 cfg.train_split, cfg.val_split],
             "files": sorted({(u.split, u.path, os.path.getsize(u.path), os.stat(u.path).st_mtime_ns)
                              for u in units}),
             "tokenizer": _tokenizer_identity(cfg.tokenizer), **(key or {})}
    if cfg.hf_dataset and Path(cfg.hf_dataset).is_dir():
        parts["hf_files"] = sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                   for p in Path(cfg.hf_dataset).rglob("*") if p.is_file())
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _tokenizer_identity(name: str):
    folder = Path(name)
    if not folder.is_dir():
        return name  # a hub name: its revision is pinned by the hub cache
    return sorted((p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in folder.iterdir() if p.is_file())
