"""Text for causal language models: read, tokenise on the CPU cores with Ray Data, pack into blocks.

Sources (data.kind: text):
- .txt files, one document per line (empty lines skipped) or one per file (data.document);
- JSONL with the text in data.text_field; parquet with a text column data.text_field;
- a Hugging Face dataset: a folder written by save_to_disk, or a hub name (needs network).

The pipeline, run once per corpus and cached on disk (data.cache_dir, keyed by a fingerprint of the sources,
the tokenizer, seq_len and the split):

1. The driver checks every source (exists, not empty, has the text column) and cuts the files into work
   units: ~1 MB byte ranges on line boundaries (txt lines, JSONL), a parquet row group, a whole file.
2. Ray Data runs one `map_batches` task per unit on the cluster's CPUs: decode UTF-8 (strictly: a bad byte
   is an error naming the file and line), parse, split train/val, tokenise with the fast tokenizer, append
   EOS after every document, and return the unit's token stream. The tasks use the tokenizer's Rust core
   (`tokenizers.Tokenizer`, shipped once through the object store): importing transformers in every task
   process would cost seconds each, and the ids are the same.
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

import functools
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from behemoth.storage import paths
from behemoth.storage.filesystem import read_file
from behemoth.config import DataConfig
from behemoth.data.pipeline import expand_files, ordered_data_context
from behemoth.data.token_store import ShardWriter, TokenBlocks, TokenShards, load_blocks, upload
from behemoth.errors import ConfigError, DataError
from behemoth.progress import progress
from behemoth.storage import filesystem

CACHE_VERSION = 4  # 4: shards with their sha256; 3: each block with its index; 2: shards of tokens; 1: train.npy
UNIT_BYTES = 1 << 20  # a line-oriented file is cut into work units of about this many bytes
_FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass
class TextData(DataConfig):
    """`data:` of a language-model job (kind: text): text files (data.train_files / val_files) or a Hugging
    Face dataset, a tokenizer, and the block length the tokens are packed into (docs/language-models.md)."""

    # auto: from the file suffix (.txt, .jsonl/.json, .parquet), or hf_dataset when data.hf_dataset is set.
    text_format: Literal["auto", "txt", "jsonl", "parquet", "hf_dataset"] = "auto"
    # The JSONL field, parquet column or Hugging Face dataset column holding a document's text.
    text_field: str = "text"
    # .txt files: one document per line (empty lines skipped), or one document per file.
    document: Literal["line", "file"] = "line"
    # Without val_files: this fraction of documents (chosen by a hash of the text and train.seed) is validation.
    val_fraction: float = 0.0
    # A Hugging Face dataset: a folder written by Dataset(Dict).save_to_disk, or a hub name (needs network).
    hf_dataset: str = ""
    hf_config_name: Optional[str] = None
    train_split: str = "train"
    val_split: str = "validation"
    # A fast tokenizer: a local from_pretrained folder (behemoth data train-tokenizer) or a hub name.
    tokenizer: str = ""
    # Tokens per training sample: documents joined with EOS and cut into blocks of seq_len.
    seq_len: int = 512
    # Tokenised, packed corpora are kept here (in shards; a folder or a URI such as s3://bucket/cache), keyed by a
    # fingerprint of sources, tokenizer and seq_len.
    cache_dir: str = "data_cache"
    # How the workers get the packed blocks: memory (through Ray's object store; the corpus must fit in it) or
    # files (each worker reads the cache's shards, memory-mapped or by ranged requests to a URI: a corpus larger
    # than memory; cache_dir must then be one every node reads: one machine, a shared filesystem, a bucket).
    token_store: Literal["memory", "files"] = "memory"

    path_keys: ClassVar[tuple[str, ...]] = (*DataConfig.path_keys, "tokenizer", "hf_dataset", "cache_dir")

    def validate(self) -> None:
        super().validate()
        if not (self.train_files or self.hf_dataset):
            raise ConfigError("data.kind is text: set data.train_files (txt, jsonl or parquet files) "
                              "or data.hf_dataset")
        if self.train_files and self.hf_dataset:
            raise ConfigError("data.train_files and data.hf_dataset are both set: keep one")
        if not self.tokenizer:
            raise ConfigError("data.tokenizer is empty: set a tokenizer folder or hub name "
                              "(behemoth data train-tokenizer makes one from your corpus)")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.train_files and not self.val_files and self.val_fraction == 0:
            raise ConfigError("data: no validation text: set data.val_files or data.val_fraction (e.g. 0.05)")
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2, got {self.seq_len}")

    def source(self) -> str:
        return self.hf_dataset or super().source()


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
# Driver side: check the sources, cut them into work units


@dataclass(frozen=True)
class Unit:
    """One Ray Data task's share of the corpus."""

    split: str  # "train", "val", or "auto" (split by document hash with data.val_fraction)
    path: str
    fmt: str  # txt | txt_file | jsonl | parquet
    start: int = 0  # byte range for txt/jsonl, row group for parquet
    end: int = 0


def text_format(cfg: TextData, path: str) -> str:
    if cfg.text_format != "auto":
        return cfg.text_format
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise DataError(f"{path}: cannot tell the text format from '{suffix}': name it .txt, .jsonl or .parquet, "
                        f"or set data.text_format")
    return _FORMATS[suffix]


def plan_units(cfg: TextData) -> list[Unit]:
    """Check every file and cut it into units, train files first, in a fixed order."""
    splits = [("auto" if not cfg.val_files else "train", cfg.train_files), ("val", cfg.val_files)]
    units = []
    for split, patterns in splits:
        key = "data.val_files" if split == "val" else "data.train_files"
        for path in map(os.path.abspath, expand_files(patterns, key)):
            units += _file_units(cfg, split, path)
    return units


def _file_units(cfg: TextData, split: str, path: str) -> list[Unit]:
    fmt = text_format(cfg, path)
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path} is empty: fill it or remove it from the data.*_files list")
    if fmt == "parquet":
        schema = pq.read_schema(path)
        if cfg.text_field not in schema.names:
            raise DataError(f"{path} has no column '{cfg.text_field}' (data.text_field); its columns: "
                            f"{schema.names}")
        if not pa.types.is_string(schema.field(cfg.text_field).type) and \
                not pa.types.is_large_string(schema.field(cfg.text_field).type):
            raise DataError(f"{path}: column '{cfg.text_field}' holds {schema.field(cfg.text_field).type}, "
                            f"not text")
        groups = pq.ParquetFile(path).num_row_groups
        return [Unit(split, path, "parquet", g, g + 1) for g in range(groups)]
    if fmt == "txt" and cfg.document == "file":
        return [Unit(split, path, "txt_file", 0, size)]
    return [Unit(split, path, fmt, s, min(s + UNIT_BYTES, size)) for s in range(0, size, UNIT_BYTES)]


# ---------------------------------------------------------------------------------------------------------
# Ray Data task side: one unit -> documents -> token streams


def read_unit_documents(unit: Unit, text_field: str) -> list[str]:
    """The documents of one unit, decoded strictly (invalid UTF-8 is an error naming file and line)."""
    if unit.fmt == "parquet":
        table = pq.ParquetFile(unit.path).read_row_group(unit.start, columns=[text_field])
        return [t for t in table.column(text_field).to_pylist() if t and t.strip()]
    data, offset = _read_line_range(unit.path, unit.start, unit.end) if unit.fmt != "txt_file" else \
        (Path(unit.path).read_bytes(), 0)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = offset + e.start
        raise DataError(f"{unit.path}: invalid UTF-8 at line {_line_of(unit.path, at)} (byte {at}): {e.reason}. "
                        f"Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if unit.fmt == "txt_file":
        return [text] if text.strip() else []
    lines = text.split("\n")
    if unit.fmt == "txt":
        return [line for line in lines if line.strip()]
    return [_jsonl_text(unit.path, offset, text, i, line, text_field) for i, line in enumerate(lines)
            if line.strip()]


def _jsonl_text(path: str, offset: int, text: str, i: int, line: str, text_field: str) -> str:
    def where() -> str:  # the file's line number, computed only when there is an error to report
        consumed = len("\n".join(text.split("\n")[:i]).encode()) + (1 if i else 0)
        return f"{path} line {_line_of(path, offset + consumed)}"

    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where()}: not valid JSON ({e})") from None
    if not isinstance(record, dict) or text_field not in record:
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where()}: no field '{text_field}' (data.text_field); the record has {fields}")
    value = record[text_field]
    if not isinstance(value, str):
        raise DataError(f"{where()}: field '{text_field}' holds {type(value).__name__}, not text")
    return value


def _read_line_range(path: str, start: int, end: int) -> tuple[bytes, int]:
    """The lines that *start* in [start, end): a line crossing a unit boundary belongs to the unit it starts in.
    Newline bytes never occur inside a multi-byte UTF-8 character, so the cut is safe for any UTF-8 text."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the rest of a line that started in the previous unit
        pos = f.tell()
        if pos >= end:
            return b"", pos
        data = f.read(end - pos)
        if not data.endswith(b"\n"):
            data += f.readline()
        return data, pos


def _line_of(path: str, byte_offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(byte_offset).count(b"\n") + 1


def is_validation(text: str, seed: int, val_fraction: float) -> bool:
    """A document's split from a hash of its text: stable under reordering, and duplicates stay together."""
    return zlib.crc32(f"{seed}:{text}".encode()) / 2**32 < val_fraction


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str):
    """A fast tokenizer, loaded once per process. model_max_length is lifted: documents are cut by packing."""
    from transformers import AutoTokenizer

    try:
        # never a tokenizer's own code (a tokenizer_config with auto_map): left unset, transformers asks on the
        # terminal; a checkpoint received from someone else names its tokenizer
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DataError(f"data.tokenizer {name!r} cannot be loaded: {e}. Point it at a folder holding "
                        f"tokenizer.json (behemoth data train-tokenizer makes one) or a hub name") from None
    if not tok.is_fast:
        raise DataError(f"data.tokenizer {name!r} is not a fast (Rust) tokenizer: behemoth needs one")
    if tok.eos_token_id is None:
        raise DataError(f"data.tokenizer {name!r} has no eos_token: documents are separated by it; set one")
    tok.model_max_length = 1 << 62
    return tok


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenising task needs: the fast tokenizer's serialised core (a JSON string, or an object-store
    reference to one) and the EOS id."""

    core: object
    eos_id: int

    @classmethod
    def of(cls, name: str) -> TokenizerSpec:
        tok = load_tokenizer(name)
        return cls(core=tok.backend_tokenizer.to_str(), eos_id=tok.eos_token_id)


@functools.lru_cache(maxsize=4)
def _tokenizer_core(core):
    import ray
    from tokenizers import Tokenizer

    return Tokenizer.from_str(core if isinstance(core, str) else ray.get(core))


def tokenize_documents(texts: list[str], splits: list[str], tokenizer: TokenizerSpec) -> pa.Table:
    """Documents -> one row per split: the documents' tokens, each followed by EOS, in order."""
    core = _tokenizer_core(tokenizer.core)
    ids = [e.ids for e in core.encode_batch(texts, add_special_tokens=False)] if texts else []
    rows = {"split": [], "tokens": [], "documents": []}
    for split in ("train", "val"):
        chosen = [doc + [tokenizer.eos_id] for doc, s in zip(ids, splits) if s == split]
        if chosen:
            rows["split"].append(split)
            total = sum(map(len, chosen))
            rows["tokens"].append(np.fromiter(itertools.chain.from_iterable(chosen), np.int32, count=total))
            rows["documents"].append(len(chosen))
    return pa.table({"split": pa.array(rows["split"], pa.string()),
                     "tokens": pa.array(rows["tokens"], pa.list_(pa.int32())),
                     "documents": pa.array(rows["documents"], pa.int64())})


def tokenize_units(batch: pa.Table, *, text_field: str, tokenizer: TokenizerSpec, seed: int,
                   val_fraction: float) -> pa.Table:
    """map_batches UDF over planned units (one per batch)."""
    tables = []
    for row in batch.to_pylist():
        unit = Unit(**row)
        docs = read_unit_documents(unit, text_field)
        splits = [unit.split if unit.split != "auto" else
                  ("val" if is_validation(d, seed, val_fraction) else "train") for d in docs]
        tables.append(tokenize_documents(docs, splits, tokenizer))
    return pa.concat_tables(tables)


def tokenize_rows(batch: dict, *, text_field: str, tokenizer: TokenizerSpec, split: str, seed: int,
                  val_fraction: float) -> pa.Table:
    """map_batches UDF over Hugging Face dataset rows."""
    docs = [t for t in batch[text_field] if t and t.strip()]
    splits = [split if split != "auto" else ("val" if is_validation(d, seed, val_fraction) else "train")
              for d in docs]
    return tokenize_documents(docs, splits, tokenizer)


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


def prepare_text(cfg: TextData, seed: int, units: list[Unit] | None = None) -> TokenIndex:
    """Tokenise and pack the corpus (or reuse the cached result). Needs Ray (ray.init done).
    `units`: what check_text_sources returned, when the caller has already checked the sources."""
    units = check_text_sources(cfg) if units is None else units
    tok = load_tokenizer(cfg.tokenizer)
    vocab = len(tok)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32
    cache = paths.join(paths.storage_root(cfg.cache_dir), _fingerprint(cfg, units, seed))
    meta = _cache_meta(cache)
    if meta is None:
        if filesystem.is_uri(cache):  # built here, then uploaded (meta.json last)
            with tempfile.TemporaryDirectory(prefix="behemoth-tokens-") as local:
                _build_cache(cfg, units, seed, dtype, Path(local) / "cache")
                upload(Path(local) / "cache", cache)
        else:
            _build_cache(cfg, units, seed, dtype, Path(cache))
        meta = _cache_meta(cache)
    read = TokenShards if cfg.token_store == "files" else load_blocks
    arrays = {s: read(cache, meta[s]["shards"], cfg.seq_len, dtype) for s in ("train", "val")}
    return TokenIndex(train=arrays["train"], val=arrays["val"], vocab_size=vocab, eos_id=tok.eos_token_id,
                      bos_id=tok.bos_token_id, stats={**meta, "cache": str(cache)})


def _cache_meta(cache: str) -> dict | None:
    """A complete cache's meta.json (local or under a URI), or None."""
    try:
        return json.loads(read_file(f"{cache}/meta.json"))
    except (FileNotFoundError, OSError):
        return None


def _build_cache(cfg: TextData, units: list[Unit], seed: int, dtype, cache: Path) -> None:
    """Tokenise and pack into shards in a temporary folder beside `cache`, renamed to it when complete."""
    # a name of its own: on a shared filesystem another node's builder may have this pid (containers), and its
    # half-built folder is not ours to remove
    tmp = cache.with_name(f"{cache.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        meta = _pack_into(tmp, cfg, units, seed, dtype)
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
    spec = TokenizerSpec(core=ray.put(spec.core), eos_id=spec.eos_id)  # once, not once per task
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


def _hf_splits(cfg: TextData) -> list[tuple[str, object]]:
    """[(split, datasets.Dataset)]: the train and validation splits, or train with split 'auto'."""
    import datasets

    try:
        if Path(cfg.hf_dataset).is_dir():
            loaded = datasets.load_from_disk(cfg.hf_dataset)
        else:
            loaded = datasets.load_dataset(cfg.hf_dataset, cfg.hf_config_name)
    except Exception as e:  # datasets raises many types: missing folder, no network, unknown name
        raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} cannot be loaded: {e}") from None
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
        if cfg.text_field not in ds.column_names:
            raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} split '{name}' has no column "
                            f"'{cfg.text_field}' (data.text_field); its columns: {ds.column_names}")
        out.append((split, ds.select_columns([cfg.text_field])))
    return out


def _fingerprint(cfg: TextData, units: list[Unit], seed: int) -> str:
    """Changes when anything that changes the packed blocks changes."""
    h = hashlib.sha256()
    parts = {"version": CACHE_VERSION, "seq_len": cfg.seq_len, "text_field": cfg.text_field,
             "document": cfg.document, "text_format": cfg.text_format, "val_fraction": cfg.val_fraction,
             "seed": seed if cfg.val_fraction else None, "hf": [cfg.hf_dataset, cfg.hf_config_name,
                                                                 cfg.train_split, cfg.val_split],
             "files": sorted({(u.split, u.path, os.path.getsize(u.path), os.stat(u.path).st_mtime_ns)
                              for u in units}),
             "tokenizer": _tokenizer_identity(cfg.tokenizer)}
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
