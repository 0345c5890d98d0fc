"""Text for causal language models: the job's `data:` section (TextData), and the corpus read and tokenised
on the CPU cores with Ray Data; packing the tokens into blocks, and the cache of the packed corpus, are
data/text/text_packing.py's.

Sources (data.kind: text):
- .txt files, one document per line (empty lines skipped) or one per file (data.document);
- JSONL with the text in data.text_field; parquet with a text column data.text_field;
- a Hugging Face dataset: a folder written by save_to_disk, or a hub name (needs network).

The pipeline, run once per corpus and cached on disk (data.cache_dir, keyed by a fingerprint of the sources,
the tokenizer, seq_len and the split; text_packing.prepare_text):

1. The driver checks every source (exists, not empty, has the text column) and cuts the files into work
   units: ~1 MB byte ranges on line boundaries (txt lines, JSONL), a parquet row group, a whole file.
2. Ray Data runs one `map_batches` task per unit on the cluster's CPUs: decode UTF-8 (strictly: a bad byte
   is an error naming the file and line), parse, split train/val, tokenise with the fast tokenizer, append
   EOS after every document, and return the unit's token stream. The tasks use the tokenizer's Rust core
   (`tokenizers.Tokenizer`, shipped once through the object store): importing transformers in every task
   process would cost seconds each, and the ids are the same.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import ClassVar, Literal, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from behemoth.config import DataConfig
from behemoth.data.pipeline import expand_files
from behemoth.errors import ConfigError, DataError

UNIT_BYTES = 1 << 20  # a line-oriented file is cut into work units of about this many bytes
FIRST_BYTES, FIRST_RECORDS = 1 << 13, 16  # what the driver reads of every file before Ray (_check_first_records)
_FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


# A text record that cannot be read (a field that is not text, a line that is not JSON) is refused by the check,
# naming its file and line, before any of it is tokenised: there is nothing for data.max_bad_samples to drop, and
# a budget that was taken but never used said it would skip what it did not.
NO_BAD_SAMPLES = ("data.max_bad_samples is for images (undecodable ones) and chat or preference records: a "
                   "{kind} record that cannot be read stops the check naming its file and line; mend or remove it, "
                   "and leave data.max_bad_samples at 0")


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
    # Keep attention and positions inside each document of a packed block: a token attends only to the earlier
    # tokens of its own document, positions restart at each document, and no token is trained to predict the
    # first token of the next document (tasks/causal_lm.py). Off: the block is one sequence, as packed.
    document_mask: bool = False

    path_keys: ClassVar[tuple[str, ...]] = (*DataConfig.path_keys, "tokenizer", "hf_dataset", "cache_dir")

    def validate(self) -> None:
        super().validate()
        if not (self.train_files or self.hf_dataset):
            raise ConfigError("data.kind is text: set data.train_files (txt, jsonl or parquet files) "
                              "or data.hf_dataset")
        if self.train_files and self.hf_dataset:
            raise ConfigError("data.train_files and data.hf_dataset are both set: keep one")
        if self.max_bad_samples and self.kind == "text":  # (chat and preference, this class's heirs, drop them)
            raise ConfigError(NO_BAD_SAMPLES.format(kind="text"))
        if not self.tokenizer:
            raise ConfigError("data.tokenizer is empty: set a tokenizer folder or hub name "
                              "(behemoth data train-tokenizer makes one from your corpus)")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_files and self.val_fraction:  # (the files won, and the fraction was dropped without a word)
            raise ConfigError(f"data.val_files and data.val_fraction {self.val_fraction} are both set: validation "
                              f"is one or the other; keep one")
        if self.train_files and not self.val_files and self.val_fraction == 0:
            raise ConfigError("data: no validation text: set data.val_files or data.val_fraction (e.g. 0.05)")
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2, got {self.seq_len}")

    def source(self) -> str:
        return self.hf_dataset or super().source()


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
    return [unit for split, path, key in planned_files(cfg) for unit in _file_units(cfg, split, path, key)]


def planned_files(cfg) -> Iterator[tuple[str, str, str]]:
    """(split, absolute path, the config key naming it) of every file of a text or chat job, train files first
    ("auto": val cut from train where there are no val files), in a fixed order; an empty file is one line
    naming it. Text's planning and chat's (data/chat/chat_sources.py) both cut the files it yields."""
    for split, patterns in (("auto" if not cfg.val_files else "train", cfg.train_files), ("val", cfg.val_files)):
        key = "data.val_files" if split == "val" else "data.train_files"
        for path in map(os.path.abspath, expand_files(patterns, key)):
            if os.path.getsize(path) == 0:
                raise DataError(f"{path} is empty: fill it or remove it from the {key} list")
            yield split, path, key


def byte_range_units(split: str, path: str, fmt: str) -> list[Unit]:
    """A line-delimited file's units: UNIT_BYTES ranges (a task reads the lines that start in its range)."""
    size = os.path.getsize(path)
    return [Unit(split, path, fmt, s, min(s + UNIT_BYTES, size)) for s in range(0, size, UNIT_BYTES)]


def _file_units(cfg: TextData, split: str, path: str, key: str) -> list[Unit]:
    fmt = text_format(cfg, path)
    size = os.path.getsize(path)
    if fmt == "parquet":
        groups = parquet_row_groups(path, cfg.text_field, "data.text_field", key)
        kind = pq.read_schema(path).field(cfg.text_field).type
        if not pa.types.is_string(kind) and not pa.types.is_large_string(kind):
            raise DataError(f"{path}: column '{cfg.text_field}' holds {kind}, not text")
        return [Unit(split, path, "parquet", g, g + 1) for g in range(groups)]
    if fmt == "txt" and cfg.document == "file":
        if size <= FIRST_BYTES:  # (a larger one is one document: a cut could split a character)
            read_unit_documents(Unit(split, path, "txt_file", 0, size), cfg.text_field)
        return [Unit(split, path, "txt_file", 0, size)]
    _check_first_records(cfg, Unit(split, path, fmt, 0, min(size, FIRST_BYTES)))
    return byte_range_units(split, path, fmt)


def parquet_row_groups(path: str, column: str, column_key: str, files_key: str) -> int:
    """How many row groups a parquet file has, once it is known to be parquet, to hold `column` (the config's
    `column_key`) and to hold rows; else one line naming the file."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a parquet file pyarrow can read ({' '.join(str(e).split())[:200]}): write "
                        f"it again, or remove it from the {files_key} list") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{path} has no column '{column}' ({column_key}); its columns: {names}")
    if pf.num_row_groups == 0 or pf.metadata.num_rows == 0:
        raise DataError(f"{path} holds no rows: fill it or remove it from the {files_key} list")
    return pf.num_row_groups


def _check_first_records(cfg: TextData, first: Unit) -> None:
    """The file's first records read as the tokenising task will read them (strict UTF-8; JSONL: JSON, the field
    present and text), so that a file of the wrong shape fails here, in one line naming it and the line, before
    Ray starts, and not inside a Ray Data task after the others were tokenised. The file's whole lines in its
    first FIRST_BYTES (at least one line), at most FIRST_RECORDS of them."""
    data, _ = _read_line_range(first.path, 0, first.end)
    lines = data.split(b"\n")[:FIRST_RECORDS]
    read_unit_documents(Unit(first.split, first.path, first.fmt, 0, len(b"\n".join(lines))), cfg.text_field)


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
    texts = (_jsonl_text(unit.path, offset, text, i, line, text_field) for i, line in enumerate(lines) if line.strip())
    return [t for t in texts if t.strip()]  # (an empty text is no document: the other formats skip it too)


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


def open_tokenizer(name: str):
    """data.tokenizer as a fast tokenizer (uncached: each task's loader adjusts its own); a failure is one line
    naming the key (a folder holding no tokenizer at all is refused before, by preflight: a config error)."""
    from transformers import AutoTokenizer

    from behemoth.storage.model_copy import local_source

    try:
        # never a tokenizer's own code (a tokenizer_config with auto_map): left unset, transformers asks on the
        # terminal; a checkpoint received from someone else names its tokenizer. An object store's folder is
        # read from this node's copy of it.
        tok = AutoTokenizer.from_pretrained(local_source(name, "data.tokenizer", weights=False), trust_remote_code=False)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # transformers' reasons run over several lines
        raise DataError(f"data.tokenizer {name!r} cannot be loaded: {reason}. Point it at a folder holding "
                        f"tokenizer.json (the model's own, or behemoth data train-tokenizer's) or a hub name") from None
    if not tok.is_fast:
        raise DataError(f"data.tokenizer {name!r} is not a fast (Rust) tokenizer: behemoth needs one")
    return tok


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str):
    """A fast tokenizer, loaded once per process. model_max_length is lifted: documents are cut by packing."""
    tok = open_tokenizer(name)
    if tok.eos_token_id is None:
        raise DataError(f"data.tokenizer {name!r} has no eos_token: documents are separated by it; set one")
    tok.model_max_length = 1 << 62
    return tok


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenising task needs: the fast tokenizer's serialised core (a JSON string, or an object-store
    reference to one), the EOS id, and the BOS id where the tokenizer starts a text with it (Llama's, Mistral's;
    None where it does not: GPT-2's)."""

    core: object
    eos_id: int
    bos_id: int | None = None

    @classmethod
    def of(cls, name: str) -> TokenizerSpec:
        tok = load_tokenizer(name)
        return cls(core=tok.backend_tokenizer.to_str(), eos_id=tok.eos_token_id, bos_id=starts_with_bos(tok))


def starts_with_bos(tok) -> int | None:
    """The BOS id where the tokenizer puts it before a text it encodes (as `generate` encodes a prompt), else None."""
    bos = tok.bos_token_id
    return bos if bos is not None and tok("a")["input_ids"][:1] == [bos] else None


@functools.lru_cache(maxsize=4)
def _tokenizer_core(core):
    import ray
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(core if isinstance(core, str) else ray.get(core))
    # a corpus's text is text: "<|endoftext|>" written in a document is those characters, not an EOS ending it
    # (with data.document_mask, a document boundary) in the middle
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenize_documents(texts: list[str], splits: list[str], tokenizer: TokenizerSpec) -> pa.Table:
    """Documents -> one row per split: the documents' tokens, each after BOS where the tokenizer starts a text
    with one (the model then sees in training what a prompt to `generate` starts with, as the model's own
    pretraining did) and followed by EOS, in order."""
    core = _tokenizer_core(tokenizer.core)
    ids = [e.ids for e in core.encode_batch(texts, add_special_tokens=False)] if texts else []
    rows = {"split": [], "tokens": [], "documents": []}
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for split in ("train", "val"):
        chosen = [bos + doc + [tokenizer.eos_id] for doc, s in zip(ids, splits) if s == split]
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
