"""Chat data's preparation (data/chat/chat.py reads and checks the records): Ray Data tasks render each unit's (or a
dataset batch's) records into rows of flagged tokens, in corpus order; the packer puts whole conversations (or
preference pairs) into blocks of data.seq_len, each its own document; the blocks go to text_packing's cache and
token store. Needs Ray.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from behemoth.data.chat.chat import (
    OPEN_BLOCKS,
    REJECTED,
    START,
    TRAIN,
    ChatData,
    Record,
    chat_tokenizer,
    pad_id,
    read_unit_records,
    record_sample,
    render_samples,
    samples_are,
    split_flags,
    tokenizer_files,
)
from behemoth.data.chat.chat_render import Failed, RenderSpec, Window
from behemoth.data.chat.pair_render import TOO_LONG
from behemoth.data.text.text import Unit, is_validation
from behemoth.errors import DataError


@dataclass(frozen=True)
class ChatSpec:
    """What a tokenising task needs: the rendering process's spec (an object-store reference to a RenderSpec: the
    template, the tokenizer's core), the window, and the job's choices."""

    render: object
    window: Window
    seed: int
    val_fraction: float
    pairs: tuple[str, str, str] | None = None  # data.kind preference: the prompt, chosen and rejected fields


@functools.lru_cache(maxsize=4)
def _task_render_spec(ref) -> RenderSpec:
    import ray

    return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref


def encode_records(records: list[Record], split: str, spec: ChatSpec) -> pa.Table:
    """Rows of split ('train', 'val' or 'bad'), tokens (flags included: at most seq_len + 1, data/chat/chat_render.py;
    a preference pair's both sequences) and for a bad record its source, line in the unit and reason; a pair
    longer than a block keeps its split, with TOO_LONG as its problem (the packer counts it)."""
    problems, good, samples = [], [], []
    for record in records:
        problem, sample = record_sample(record.value, spec.pairs, spec.window.train_on)
        problems.append(problem)
        samples.append(sample)
        good += [] if problem else [sample]
    results = iter(render_samples(_task_render_spec(spec.render), good, spec.window, spec.pairs))
    rows = {"split": [], "tokens": [], "source": [], "line": [], "problem": []}
    for record, problem, sample in zip(records, problems, samples):
        tokens = np.empty(0, np.int32)
        if problem is None:
            result = next(results)
            if isinstance(result, Failed):
                problem = result.reason
            elif not result.size:
                problem = "the template renders it as no tokens"
            else:
                tokens = result
        if problem is None or problem == TOO_LONG:
            # a pair's side is its prompt's: a prompt's several pairs (UltraFeedback's completions paired every way,
            # HH's turns) never fall on both sides, where validation would score replies to prompts trained on
            key = json.dumps(sample[0] if spec.pairs else record.value, sort_keys=True)
            chosen = split if split != "auto" else ("val" if is_validation(key, spec.seed, spec.val_fraction)
                                                    else "train")
        _add_row(rows, chosen if problem in (None, TOO_LONG) else "bad", tokens, record.source, record.line,
                 problem or "")
    return _rows_table(rows)


def _add_row(rows: dict, split: str, tokens: np.ndarray, source: str, line: int, problem: str) -> None:
    for key, value in zip(("split", "tokens", "source", "line", "problem"), (split, tokens, source, line, problem)):
        rows[key].append(value)


def _rows_table(rows: dict) -> pa.Table:
    return pa.table({"split": pa.array(rows["split"], pa.string()),
                     "tokens": pa.array(rows["tokens"], pa.list_(pa.int32())),
                     "source": pa.array(rows["source"], pa.string()), "line": pa.array(rows["line"], pa.int64()),
                     "problem": pa.array(rows["problem"], pa.string())})


def encode_units(batch: pa.Table, *, field: str, spec: ChatSpec) -> pa.Table:
    """map_batches UDF over planned units (one per batch): each unit's rows, then a `unit_end` row whose `line`
    is how many lines the unit held (the driver numbers the next unit's lines from it)."""
    tables = []
    for row in batch.to_pylist():
        lines, records = read_unit_records(Unit(**row), field)
        end = {"split": ["unit_end"], "tokens": [np.empty(0, np.int32)], "source": [row["path"]], "line": [lines],
               "problem": [""]}
        tables += [encode_records(records, row["split"], spec), _rows_table(end)]
    return pa.concat_tables(tables)


def encode_rows(batch: pa.Table, *, field: str, spec: ChatSpec, split: str, name: str) -> pa.Table:
    """map_batches UDF over a Hugging Face dataset's rows (with their row numbers in `_row`): `field`'s values, or
    with spec.pairs each row's pair fields."""
    rows = batch.column("_row").to_pylist()
    if spec.pairs:  # (a pair's record: its columns but the row number)
        values = batch.drop_columns(["_row"]).to_pylist()
    else:
        values = batch.column(field).to_pylist()
    return encode_records([Record(f"{name} row {r}", -1, v) for r, v in zip(rows, values)], split, spec)

# ---------------------------------------------------------------------------------------------------------
# Packing conversations into blocks


class ChatPacker:
    """Whole conversations into blocks of seq_len: each goes into the first of the open blocks it fits in (at
    most `open_blocks` open; the oldest is padded and written when another must open), or with open_blocks 0
    one per block. Padding: `pad` with START on its first token and no TRAIN (its own document, never trained).
    `sink`: called with each written block, [1, seq_len] int32."""

    def __init__(self, seq_len: int, pad: int, sink, open_blocks: int = OPEN_BLOCKS, overlong: str = "truncate"):
        self.seq_len, self.pad, self.sink, self.open_blocks, self.overlong = seq_len, pad, sink, open_blocks, overlong
        self.open: list[list[np.ndarray]] = []
        self.room: list[int] = []
        self.counts = {"documents": 0, "tokens": 0, "trained_tokens": 0, "padding_tokens": 0, "blocks": 0,
                       "truncated": 0, "dropped_overlong": 0, "tail_tokens_dropped": 0}

    def add(self, tokens: np.ndarray) -> None:
        if len(tokens) > self.seq_len:
            cut = tokens[:self.seq_len]
            if self.overlong == "drop" or not np.any(cut & TRAIN):  # (nothing left to train on: dropped too)
                self.counts["dropped_overlong"] += 1
                return
            self.counts["truncated"] += 1
            tokens = cut
        self.counts["documents"] += 1
        self.counts["tokens"] += len(tokens)
        self.counts["trained_tokens"] += int(np.count_nonzero(tokens & TRAIN))
        chosen = next((i for i, room in enumerate(self.room) if room >= len(tokens)), None)
        if chosen is None:
            if self.open and len(self.open) >= max(self.open_blocks, 1):
                self._write(0)
            self.open.append([])
            self.room.append(self.seq_len)
            chosen = len(self.open) - 1
        self.open[chosen].append(tokens)
        self.room[chosen] -= len(tokens)
        if self.room[chosen] == 0 or self.open_blocks == 0:
            self._write(chosen)

    def finish(self) -> dict:
        while self.open:
            self._write(0)
        return dict(self.counts)

    def _write(self, i: int) -> None:
        parts, room = self.open.pop(i), self.room.pop(i)
        if room:
            padding = np.full(room, self.pad, np.int32)
            padding[0] |= START
            parts.append(padding)
            self.counts["padding_tokens"] += room
        self.counts["blocks"] += 1
        self.sink(np.concatenate(parts)[None, :])


# ---------------------------------------------------------------------------------------------------------
# The whole preparation: text_packing's cache, chat's stream and packer

CHAT_VERSION = 2  # (in the cache's fingerprint: a change of how conversations become blocks; 2: bounded records)


def prepare_chat(cfg: ChatData, seed: int, units: list[Unit]):
    """The conversations tokenised with Ray Data and packed (or read from the cache): a TokenIndex of int32
    blocks with the flags. Needs Ray."""
    from behemoth.data.text.text_packing import packed_index

    tok = chat_tokenizer(cfg)
    key = {"chat": CHAT_VERSION, "messages_field": cfg.messages_field, "template": tok.chat_template,
           "train_on": cfg.train_on, "packing": cfg.packing, "overlong": cfg.overlong, "open_blocks": OPEN_BLOCKS,
           **({"pairs": cfg.pair_fields(), "pair_version": 2} if cfg.pair_fields() else {})}  # 2: split by prompt
    index = packed_index(cfg, units, seed, np.int32, tok, _pack_chat, key)
    bad = index.stats.get("bad_records", 0)
    if bad > cfg.max_bad_samples:  # (a cache built under a larger data.max_bad_samples)
        raise DataError(_too_many_bad(bad, index.stats.get("bad_examples", []), cfg.max_bad_samples, samples_are(cfg)))
    if cfg.eval_samples:
        index.stats["eval_prompts"] = sample_prompts(index.val, cfg.eval_samples)
        index.stats["tokenizer_files"] = tokenizer_files(tok)  # (the workers decode the replies with it)
    return index


def sample_prompts(blocks, n: int) -> list[list[int]]:
    """The prompts of the first n conversations of the blocks that have a trained token: each conversation's
    tokens before its first trained one (its opening turns and the generation prompt); a preference pair's
    once (its rejected reply's sequence is left out)."""
    prompts = []
    for b in range(len(blocks)):
        stored = blocks[np.array([b])][0].astype(np.int64)
        ids, trained, starts = split_flags(stored)
        bounds = [*np.flatnonzero(starts).tolist(), len(ids)]
        for begin, end in zip(bounds, bounds[1:]):
            first = np.flatnonzero(trained[begin:end])
            if len(first) and not stored[begin] & REJECTED:
                prompts.append(ids[begin:begin + first[0]].tolist())
                if len(prompts) == n:
                    return prompts
    return prompts


def _too_many_bad(count: int, examples: list[str], limit: int, noun: str = "conversations") -> str:
    return (f"{count} records are not {noun}, more than data.max_bad_samples={limit}: "
            f"{'; '.join(examples[:5])}. Mend or remove them, or raise data.max_bad_samples to skip them")


class BadRecords:
    """The bad records the tokenising tasks found, named by file and line (a JSONL file's lines numbered from
    the lines each of its units held: the units arrive in corpus order) or row; more than `limit` fail."""

    def __init__(self, limit: int, noun: str = "conversations"):
        self.limit, self.noun, self.named, self.first_line = limit, noun, [], {}

    def unit_end(self, source: str, lines: int) -> None:
        self.first_line[source] = self.first_line.get(source, 1) + lines

    def add(self, source: str, line: int, problem: str) -> None:
        self.named.append(f"{Record(source, line, None).where(self.first_line.get(source, 1))}: {problem}")
        if len(self.named) > self.limit:
            raise DataError(_too_many_bad(len(self.named), self.named, self.limit, self.noun))


def _pack_chat(folder: Path, cfg: ChatData, units: list[Unit], seed: int, dtype) -> dict:
    from behemoth.data.text.text_packing import CACHE_VERSION, _list_values
    from behemoth.data.token_store import ShardWriter
    from behemoth.progress import progress

    tok = chat_tokenizer(cfg)
    pad, _ = pad_id(tok)
    writers = {split: ShardWriter(folder, split, cfg.seq_len, np.int32) for split in ("train", "val")}
    packers = {split: ChatPacker(cfg.seq_len, pad, writers[split].add, 0 if cfg.packing == "padded" else OPEN_BLOCKS,
                                 cfg.overlong) for split in ("train", "val")}
    bad = BadRecords(cfg.max_bad_samples, samples_are(cfg))
    for batch in progress(_chat_stream(cfg, units, seed, tok), "tokenising", total=None if cfg.hf_dataset else len(units),
                          unit="unit" if not cfg.hf_dataset else "batch"):
        for split, tokens, source, line, problem in zip(
                batch["split"].to_pylist(), _list_values(batch["tokens"]), batch["source"].to_pylist(),
                batch["line"].to_pylist(), batch["problem"].to_pylist()):
            if split in ("bad", "unit_end"):
                bad.add(source, line, problem) if split == "bad" else bad.unit_end(source, line)
            elif problem == TOO_LONG:  # (a preference pair: dropped whole, never cut)
                packers[split].counts["dropped_overlong"] += 1
            else:
                packers[split].add(tokens)
    meta = {"version": CACHE_VERSION, "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer, "dtype": "int32",
            "bad_records": len(bad.named), "bad_examples": bad.named[:20]}
    for split, packer in packers.items():
        counts = packer.finish()
        if counts["blocks"] == 0:
            raise DataError(_nothing_to_train(cfg, split, counts, len(bad.named)))
        meta[split] = {**counts, "shards": writers[split].finish()}
    return meta


def _nothing_to_train(cfg: ChatData, split: str, counts: dict, bad: int) -> str:
    """Why a split packed no block, in the words that fit: no conversation reached it, or all were too long."""
    if counts["dropped_overlong"]:
        if cfg.pair_fields():
            return (f"the {split} pairs leave nothing to train on: all {counts['dropped_overlong']} are longer than "
                    f"data.seq_len={cfg.seq_len} (a pair is dropped whole, never cut): raise data.seq_len to hold "
                    f"the prompt with both replies")
        why = "their assistant tokens all past the cut" if cfg.overlong == "truncate" else "data.overlong: drop"
        return (f"the {split} conversations leave nothing to train on: {counts['dropped_overlong']} longer than "
                f"data.seq_len={cfg.seq_len} dropped ({why}), none kept: raise data.seq_len"
                f"{'' if cfg.overlong == 'truncate' else ', or set data.overlong: truncate'}")
    skipped = f" ({bad} bad records skipped)" if bad else ""
    if split == "val" and not cfg.val_files and not cfg.hf_dataset:
        return (f"no conversation went to the val split: data.val_fraction={cfg.val_fraction} of the train files' "
                f"conversations{skipped} chose none; raise data.val_fraction or give data.val_files")
    source = f"data.hf_dataset's {split} split" if cfg.hf_dataset else f"the data.{split}_files"
    shape = (f"{' / '.join(cfg.pair_fields())} pairs" if cfg.pair_fields() else f"`{cfg.messages_field}` records")
    return f"{source} hold no conversations{skipped}: give files of {shape}"


def _chat_stream(cfg: ChatData, units: list[Unit], seed: int, tok):
    """Ray Data: each unit's (or dataset batch's) conversations encoded, in corpus order."""
    import logging

    import ray.data

    from behemoth.data.pipeline import ordered_data_context
    from behemoth.data.text.text_packing import HF_ROWS_PER_BLOCK, _hf_splits

    ordered_data_context(logging.CRITICAL)
    spec = ChatSpec(render=ray.put(RenderSpec.of(tok)), window=Window.of(tok, cfg.train_on, cfg.seq_len), seed=seed,
                    val_fraction=cfg.val_fraction, pairs=cfg.pair_fields())
    if cfg.hf_dataset:
        pipelines = []
        for split, ds in _hf_splits(cfg, cfg.messages_field, cfg.pair_fields()):
            table = ds.with_format("arrow")[:]
            table = table.append_column("_row", pa.array(range(table.num_rows), pa.int64()))
            blocks = [table.slice(i, HF_ROWS_PER_BLOCK) for i in range(0, max(table.num_rows, 1), HF_ROWS_PER_BLOCK)]
            pipelines.append(ray.data.from_blocks(blocks).map_batches(
                encode_rows, batch_format="pyarrow", batch_size=HF_ROWS_PER_BLOCK, num_cpus=cfg.cpus_per_task,
                fn_kwargs={"field": cfg.messages_field, "spec": spec, "split": split,
                           "name": f"data.hf_dataset {cfg.hf_dataset}"}))
    else:
        rows = [{"split": u.split, "path": u.path, "fmt": u.fmt, "start": u.start, "end": u.end} for u in units]
        pipelines = [ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            encode_units, batch_format="pyarrow", batch_size=1, num_cpus=cfg.cpus_per_task,
            fn_kwargs={"field": spec.pairs or cfg.messages_field, "spec": spec})]
    for ds in pipelines:
        yield from ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=4)
