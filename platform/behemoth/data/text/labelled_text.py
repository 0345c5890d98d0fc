"""Labelled text for sequence classification: (text, label) rows from JSONL, CSV or parquet files, or from a
Hugging Face dataset saved with `save_to_disk`. Labels are names (strings, or integers read as names); the
classes are the training split's labels, sorted.

The driver reads and checks every row before Ray starts (`read_labelled`: a missing column, an empty text or
a validation label the training split lacks is one error naming the file and row); once Ray is up, Ray Data
tasks tokenise the rows (`tokenise`) into fixed-length arrays (truncated and right-padded to data.max_length,
with the attention mask) that travel to every worker once through the object store; a worker's batch is a
gather by row index. Nothing is decoded or tokenised during training.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow as pa

from behemoth.config import DataConfig
from behemoth.data.pipeline import expand_files, ordered_data_context
from behemoth.data.text.text import NO_BAD_SAMPLES
from behemoth.errors import ConfigError, DataError

_READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
BLOCK_ROWS = 2048  # rows per tokenising task
CLASS_ORDER = b"behemoth.class_order"  # a table's metadata: a Hugging Face ClassLabel's names, in its order


@dataclass
class LabelledTextData(DataConfig):
    """`data:` of a text-classification job (kind: text_classification)."""

    # The column (JSONL field, CSV header, parquet or dataset column) holding the text, and the one holding
    # its label (a name, or an integer read as a name).
    text_column: str = "text"
    label_column: str = "label"
    # Instead of train_files/val_files: a Hugging Face dataset folder written by DatasetDict.save_to_disk (or a
    # hub name: that needs network), with these splits.
    hf_dataset: str = ""
    train_split: str = "train"
    val_split: str = "validation"
    # A fast tokenizer: a local from_pretrained folder (behemoth data train-tokenizer) or a hub name.
    tokenizer: str = ""
    # Tokens per sample: longer texts are truncated, shorter ones padded (the attention mask marks which).
    max_length: int = 128

    path_keys: ClassVar[tuple[str, ...]] = (*DataConfig.path_keys, "tokenizer", "hf_dataset")

    def validate(self) -> None:
        super().validate()
        if bool(self.train_files) == bool(self.hf_dataset):
            raise ConfigError("data.kind is text_classification: set data.train_files and data.val_files "
                              "(jsonl, csv or parquet), or data.hf_dataset")
        if self.train_files and not self.val_files:
            raise ConfigError("data: no validation rows: set data.val_files")
        if self.max_bad_samples:
            raise ConfigError(NO_BAD_SAMPLES.format(kind="text_classification"))
        if not self.tokenizer:
            raise ConfigError("data.tokenizer is empty: set a tokenizer folder or hub name "
                              "(behemoth data train-tokenizer makes one from your texts)")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2, got {self.max_length}")

    def source(self) -> str:
        return self.hf_dataset or super().source()


@dataclass
class LabelledRows:
    """What the driver read: each split's texts and label names, where each row came from, and the classes."""

    texts: dict[str, list[str]]
    labels: dict[str, list[str]]
    origins: dict[str, list[tuple[str, int]]]  # split -> [(file or dataset split, rows)], in order
    classes: list[str]


@dataclass
class TokenisedRows:
    """What the workers read: per split, token ids [rows, max_length] (int32), the attention mask (int8) and
    the class ids (int64); plus the classes and where each row came from (for messages)."""

    ids: dict[str, np.ndarray]
    mask: dict[str, np.ndarray]
    labels: dict[str, np.ndarray]
    classes: list[str]
    origins: dict[str, list[tuple[str, int]]]
    pad_id: int
    vocab_size: int
    bos_id: int | None = None  # the tokenizer's (a model built from model.hf_config takes them)
    eos_id: int | None = None
    # the tokenizer's saved files (data/chat/chat.tokenizer_files), kept in every checkpoint for the export
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)

    def describe(self, split: str, row: int) -> str:
        return describe_row(self.origins[split], row)


def describe_row(origins: list[tuple[str, int]], row: int) -> str:
    """A split's row by its file (or dataset split) and row there."""
    for where, n in origins:
        if row < n:
            return f"{where} row {row}"
        row -= n
    raise IndexError(row)


def read_labelled(cfg: LabelledTextData) -> LabelledRows:
    """Every row of both splits, checked (columns present, texts non-empty, validation labels known)."""
    texts, labels, origins, order = {}, {}, {}, None
    for split, tables in _split_tables(cfg):
        texts[split], labels[split], origins[split] = [], [], []
        for where, table in tables:
            if split == "train" and table.schema.metadata and CLASS_ORDER in table.schema.metadata:
                order = json.loads(table.schema.metadata[CLASS_ORDER])
            split_texts, split_labels = _columns(cfg, where, table)
            texts[split] += split_texts
            labels[split] += split_labels
            origins[split].append((where, len(split_texts)))
        if not texts[split]:
            raise DataError(f"data: the {split} split has no rows ({', '.join(w for w, _ in origins[split])})")
    names = set(labels["train"])
    numeric = all(re.fullmatch(r"-?[0-9]+", n) for n in names)  # (ASCII digits: str.isdigit takes "²")
    if order is not None and names <= set(order):  # a Hugging Face ClassLabel's order
        classes = sorted(names, key=order.index)
    else:
        classes = sorted(names, key=(lambda n: (int(n), n)) if numeric else str)  # "1" and "01": one order
    if len(classes) < 2:
        raise DataError(f"data: the training rows hold {len(classes)} label(s) ({classes}): a classifier needs 2 "
                        f"or more")
    for row, name in enumerate(labels["val"]):
        if name not in names:
            raise DataError(f"{describe_row(origins['val'], row)}: label {name!r} is not among the training rows' "
                            f"labels ({', '.join(classes)})")
    return LabelledRows(texts, labels, origins, classes)


def _split_tables(cfg: LabelledTextData):
    """[(split, [(where, pyarrow Table)])] for train and val."""
    if cfg.hf_dataset:
        return [(split, [(f"{cfg.hf_dataset} [{name}]", _hf_split(cfg, name))])
                for split, name in (("train", cfg.train_split), ("val", cfg.val_split))]
    return [(split, [(path, _read_file(path)) for path in expand_files(files, f"data.{split}_files")])
            for split, files in (("train", cfg.train_files), ("val", cfg.val_files))]


def _read_file(path: str) -> pa.Table:
    kind = _READERS.get(Path(path).suffix.lower())
    if kind is None:
        raise DataError(f"{path}: a text-classification file is .jsonl, .json, .csv or .parquet")
    try:
        if kind == "json":
            import pyarrow.json

            return pyarrow.json.read_json(path)
        if kind == "csv":  # every column as text: a label "007" stays "007", a text of digits stays text
            import pyarrow.csv

            types = {name: pa.string() for name in pyarrow.csv.open_csv(path).schema.names}  # the header only
            return pyarrow.csv.read_csv(path, convert_options=pyarrow.csv.ConvertOptions(column_types=types))
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path} cannot be read as {kind}: {e}") from None


def _hf_split(cfg: LabelledTextData, name: str) -> pa.Table:
    import datasets

    try:
        loaded = (datasets.load_from_disk(cfg.hf_dataset) if Path(cfg.hf_dataset).is_dir()
                  else datasets.load_dataset(cfg.hf_dataset))
    except Exception as e:  # datasets raises many types: missing folder, no network, unknown name
        raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} cannot be loaded: {e}") from None
    if not isinstance(loaded, datasets.DatasetDict) or name not in loaded:
        splits = list(loaded) if isinstance(loaded, datasets.DatasetDict) else "one unnamed split"
        raise DataError(f"data.hf_dataset {cfg.hf_dataset!r} has no split '{name}' (its splits: {splits}); set "
                        f"data.train_split / data.val_split")
    split = loaded[name]
    table = split.with_format("arrow")[:]
    feature = split.features.get(cfg.label_column)
    if isinstance(feature, datasets.ClassLabel) and cfg.label_column in table.column_names:
        # a ClassLabel's integers are indices into its names: the classes are those names, in its order (the
        # export's id2label says "positive", not "1"); an index outside them (-1: unlabelled) is kept as a number
        index = table.column(cfg.label_column).to_pylist()
        names = [feature.names[i] if isinstance(i, int) and 0 <= i < len(feature.names) else i for i in index]
        table = table.set_column(table.column_names.index(cfg.label_column), cfg.label_column,
                                 pa.array([str(n) if n is not None else None for n in names], pa.string()))
        table = table.replace_schema_metadata({CLASS_ORDER: json.dumps(feature.names)})
    return table


def _columns(cfg: LabelledTextData, where: str, table: pa.Table) -> tuple[list[str], list[str]]:
    for key, column in (("text_column", cfg.text_column), ("label_column", cfg.label_column)):
        if column not in table.column_names:
            raise DataError(f"{where} has no column '{column}' (data.{key}); its columns: {table.column_names}")
    texts = table.column(cfg.text_column).to_pylist()
    labels = table.column(cfg.label_column).to_pylist()
    for row, (text, label) in enumerate(zip(texts, labels)):
        if not isinstance(text, str) or not text.strip():
            what = "empty" if isinstance(text, str) else repr(text)
            raise DataError(f"{where} row {row}: '{cfg.text_column}' is {what}: every row needs a text")
        if label is None or isinstance(label, (float, dict, list)):
            raise DataError(f"{where} row {row}: '{cfg.label_column}' is {label!r}: a label is a name or an "
                            f"integer")
    return texts, [str(label) for label in labels]


def tokenise(cfg: LabelledTextData, rows: LabelledRows) -> TokenisedRows:
    """Ray Data tasks tokenise both splits (in order); the driver collects the fixed-length arrays."""
    import ray.data

    tok = load_classification_tokenizer(cfg.tokenizer)
    ordered_data_context()
    class_id = {name: i for i, name in enumerate(rows.classes)}
    ids, mask, labels = {}, {}, {}
    for split in ("train", "val"):
        texts = rows.texts[split]
        blocks = [pa.table({"text": texts[i:i + BLOCK_ROWS]}) for i in range(0, len(texts), BLOCK_ROWS)]
        ds = ray.data.from_arrow(blocks).map_batches(
            _tokenise_batch, fn_kwargs={"tokenizer": cfg.tokenizer, "max_length": cfg.max_length},
            batch_format="numpy", batch_size=256, num_cpus=cfg.cpus_per_task)
        parts = list(ds.iter_batches(batch_format="numpy", batch_size=None))
        ids[split] = np.concatenate([p["input_ids"] for p in parts])
        mask[split] = np.concatenate([p["attention_mask"] for p in parts])
        labels[split] = np.asarray([class_id[name] for name in rows.labels[split]], dtype=np.int64)
    return TokenisedRows(ids, mask, labels, rows.classes, rows.origins, tok.pad_token_id, len(tok), tok.bos_token_id,
                         tok.eos_token_id)


@functools.lru_cache(maxsize=4)
def load_classification_tokenizer(name: str):
    """A fast tokenizer that pads on the right: with its own pad token, else its EOS (a tokenizer made by
    `behemoth data train-tokenizer` has only an EOS). Loaded once per process."""
    from behemoth.data.text.text import open_tokenizer

    tok = open_tokenizer(name)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(f"data.tokenizer {name!r} has neither a pad nor an EOS token: set one")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def _tokenise_batch(batch: dict, tokenizer: str, max_length: int) -> dict:
    enc = load_classification_tokenizer(tokenizer)(
        list(batch["text"]), truncation=True, max_length=max_length, padding="max_length")
    return {"input_ids": np.asarray(enc["input_ids"], dtype=np.int32),
            "attention_mask": np.asarray(enc["attention_mask"], dtype=np.int8)}
