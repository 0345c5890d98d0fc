"""Chat data for fine-tuning a causal LM (data.kind: chat): conversations in the OpenAI / Hugging Face `messages`
shape, `[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]`, one per JSONL line, parquet
row or Hugging Face dataset row (the column: data.messages_field).

The pipeline is the text pipeline's (data/text.py, data/text_packing.py: work units, Ray Data tasks, a packed
cache on disk, the token store), with three differences:

1. A conversation is rendered with a chat template: the tokenizer's own (`apply_chat_template`), or the one the
   job names (data.chat_template: a .jinja file, or `chatml`); a tokenizer with none and no data.chat_template is
   refused before Ray, never rendered in a made-up format.
2. The tokens the loss is taken on are the assistant's turns (data.train_on: assistant), found from the
   template's own renderings: the conversation up to turn i with the generation prompt is a prefix of the
   conversation through turn i, and the text between the two is turn i's reply (its end-of-turn token
   included: the model learns to stop); the tokens starting in it (the whole rendering is encoded once, with
   offsets) are trained. A template whose renderings are not prefixes of each other (one that
   rewrites earlier turns) is refused by name: its assistant tokens cannot be told this way.
3. Conversations are packed whole into blocks of data.seq_len (first fit over the last OPEN_BLOCKS blocks, the
   rest padded), or one per block (data.packing: padded); never cut across blocks. Each conversation is its own
   document: positions restart and attention stays inside it (tasks/chat.py). A conversation longer than a block
   is cut at seq_len or dropped (data.overlong), counted.

Each stored token carries two flags in bits above any vocabulary's ids (the blocks are int32): TRAIN (a token the
loss is taken on) and START (a conversation's, or a padding run's, first token). One array per split keeps the
token store, its checksums, gathers and the sample ledger as they are for text; the worker splits them on the
device (`split_flags`).

A record that is not a conversation (not a list, an unknown role, content that is not text, no assistant turn,
not JSON) is a bad sample, named by file and line (or row): up to data.max_bad_samples are skipped and counted,
more fail the preparation naming them.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from behemoth.data.chat_tokens import ROLES, conversation_problem  # noqa: F401 - named here too
from behemoth.data.chat_render import (  # noqa: F401 - TRAIN, START, REJECTED, IDS: the stored flags, named here too
    IDS,
    REJECTED,
    START,
    TRAIN,
    Failed,
    RenderSpec,
    Window,
    conversation_tokens,
    process_for,
)
from behemoth.data.pair_render import TOO_LONG, pair_of
from behemoth.data.pipeline import expand_files
from behemoth.data.text import (
    FIRST_BYTES,
    FIRST_RECORDS,
    UNIT_BYTES,
    TextData,
    Unit,
    _read_line_range,
    is_validation,
    load_tokenizer,
    parquet_row_groups,
    text_format,
)
from behemoth.errors import ConfigError, DataError

MAX_RECORD_BYTES = 64 << 20  # a JSONL line longer than this is a bad record, not parsed
OPEN_BLOCKS = 64  # blocks still open to a shorter conversation while packing (first fit)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


@dataclass
class ChatData(TextData):
    """`data:` of a chat fine-tuning job (kind: chat): the text keys (files or a Hugging Face dataset, a
    tokenizer, seq_len, the cache), and how conversations become training blocks (docs/chat.md)."""

    # The JSONL field, parquet column or dataset column holding a conversation (a list of {role, content}).
    messages_field: str = "messages"
    # The template conversations are rendered with: empty for the tokenizer's own (its chat_template), `chatml`,
    # or a .jinja file. It is the exported tokenizer's template too.
    chat_template: str = ""
    # The tokens the loss is taken on: the assistant's turns, or every token of the conversation.
    train_on: Literal["assistant", "all"] = "assistant"
    # packed: whole conversations share a block (each its own document); padded: one conversation per block.
    packing: Literal["packed", "padded"] = "packed"
    # A conversation longer than seq_len: cut at seq_len (its assistant tokens within it still train) or dropped.
    overlong: Literal["truncate", "drop"] = "truncate"
    # Always on for chat: each conversation is its own document (positions and attention), packed or padded.
    document_mask: bool = True
    # At each evaluation, the model's greedy replies to the prompts of the first N validation conversations
    # (up to their first assistant turn), at most eval_max_new_tokens each: in the run's records (val_outputs)
    # and report. 0: none.
    eval_samples: int = 3
    eval_max_new_tokens: int = 48

    path_keys: ClassVar[tuple[str, ...]] = (*TextData.path_keys, "chat_template")

    def validate(self) -> None:
        if self.text_format == "txt" or self.document != "line" or self.text_field != "text":
            raise ConfigError("data.kind chat reads conversations from JSONL, parquet or a Hugging Face dataset "
                              "(data.messages_field): data.text_format txt, data.document and data.text_field are "
                              "for data.kind text")
        if self.eval_samples < 0 or self.eval_max_new_tokens < 1:
            raise ConfigError(f"data.eval_samples must be >= 0 and data.eval_max_new_tokens >= 1, got "
                              f"{self.eval_samples} and {self.eval_max_new_tokens}")
        if not self.document_mask:
            raise ConfigError("data.document_mask is always on for data.kind chat: packed conversations never "
                              "attend to each other (data.packing: padded puts one per block)")
        super().validate()

    def pair_fields(self) -> tuple[str, str, str] | None:
        """A preference pair's fields (data.kind preference); None: records are conversations."""
        return None

    def template_text(self) -> str | None:
        """data.chat_template's text (None: the tokenizer's own)."""
        if not self.chat_template:
            return None
        if self.chat_template == "chatml":
            return CHATML
        path = Path(self.chat_template).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.chat_template {self.chat_template!r} is neither `chatml` nor a template file: "
                              f"give a .jinja file's path, or leave it empty for the tokenizer's own template")
        return read_template(path, f"data.chat_template {self.chat_template!r}")


TEMPLATE_BYTES = 1 << 20  # a template file's size at most (models' own are tens of KB)


def read_template(path: Path, where: str) -> str:
    """A chat template file's text, or one ConfigError naming it (`where`: the key or flag and the path): not a
    file, unreadable, larger than TEMPLATE_BYTES or not UTF-8 text."""
    try:
        if not path.is_file():  # (a device or a pipe would be read without end)
            raise ConfigError(f"{where} is not a file: give a Jinja chat template file")
        with open(path, "rb") as f:
            data = f.read(TEMPLATE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    if len(data) > TEMPLATE_BYTES:
        raise ConfigError(f"{where} is larger than {TEMPLATE_BYTES >> 20} MiB: not a chat template (a model's own is "
                          f"tens of KB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}): save the template as "
                          f"UTF-8") from None


# ---------------------------------------------------------------------------------------------------------
# The tokenizer and its template


def chat_tokenizer(cfg: ChatData):
    """The run's tokenizer with data.chat_template set on it (the one the records are rendered with and the
    export keeps); refused where there is no template, or ChatML's markers are not tokens of its vocabulary."""
    tok = load_tokenizer(cfg.tokenizer)
    template = cfg.template_text()
    if template is None and not tok.chat_template:
        raise ConfigError(f"data.tokenizer {cfg.tokenizer!r} has no chat template (tokenizer_config.json's "
                          f"chat_template or chat_template.jinja): set data.chat_template to a .jinja file or "
                          f"`chatml`; behemoth never renders conversations in a format of its own")
    if template == CHATML:
        missing = [t for t in CHATML_TOKENS if t not in tok.get_vocab()]
        if missing:
            raise ConfigError(f"data.chat_template chatml marks turns with {' and '.join(CHATML_TOKENS)}, and "
                              f"data.tokenizer {cfg.tokenizer!r} has no {', '.join(missing)} token: a model would see "
                              f"them as plain text and never learn where a turn ends. Use the model's own template, "
                              f"or a tokenizer with them (behemoth data train-tokenizer --chat)")
    if template is not None:
        tok = _with_template(tok, template)
    return tok


def _with_template(tok, template: str):
    import copy

    tok = copy.copy(tok)  # (load_tokenizer's is shared by the process)
    tok.chat_template = template
    return tok


def pad_id(tok) -> tuple[int, str | None]:
    """The id padding is written with, and where the tokenizer has no pad token, the one line that says so:
    EOS pads (padding is masked from the loss and from attention, so no embedding is added or resized)."""
    if tok.pad_token_id is not None:
        return tok.pad_token_id, None
    return tok.eos_token_id, (f"data.tokenizer has no pad token: padding uses EOS ({tok.eos_token!r}, id "
                              f"{tok.eos_token_id}), masked from the loss and attention; no embedding is added")


def tokenizer_files(tok) -> dict[str, bytes]:
    """The tokenizer (template included) as its saved files: what the workers rebuild it from to decode the
    evaluation's replies, and what a checkpoint keeps, on any node (a Hub name or a folder only the driver sees
    included); a file in a folder of its own (transformers' additional_chat_templates/) by its relative path."""
    with tempfile.TemporaryDirectory(prefix="behemoth-chat-tok-") as folder:
        tok.save_pretrained(folder)
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
                if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes]):
    """The tokenizer tokenizer_files saved, loaded again (never its own code)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="behemoth-chat-tok-") as folder:
        for name, data in files.items():
            Path(folder, name).parent.mkdir(parents=True, exist_ok=True)
            Path(folder, name).write_bytes(data)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


# ---------------------------------------------------------------------------------------------------------
# A record -> its tokens, with the flags


def render_text(tok, messages: list[dict]) -> str:
    """A conversation as the template renders it (no generation prompt), in the bounded rendering process
    (TemplateRefused, a ValueError: the template's error or a bound)."""
    return process_for(RenderSpec.of(tok)).render(messages, generation_prompt=False)


def render_prompt(tok, messages: list[dict]) -> str:
    """A conversation with the template's generation prompt after it (`behemoth generate`'s prompts), rendered in
    the bounded rendering process as the training records are (TemplateRefused: the template's error or a bound)."""
    return process_for(RenderSpec.of(tok)).render(messages, generation_prompt=True)


def encode_conversation(tok, messages: list[dict], train_on: str = "assistant", seq_len: int | None = None) -> np.ndarray:
    """A conversation's tokens as the template renders it (the rendering encoded as apply_chat_template encodes
    it), int32 with the TRAIN flag on the tokens the loss is taken on and START on the first; with `seq_len`, at
    most seq_len + 1 of them, bounded as the tokenising tasks bound them (data/chat_render.py). In this process:
    the reference the rendering process is tested against; data preparation renders in that process."""
    window = Window.of(tok, train_on, seq_len)

    def render(turns, generation_prompt):
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(text):
        return tok.backend_tokenizer.encode(text, add_special_tokens=False)

    return conversation_tokens(render, encode, messages, train_on, seq_len, window.max_chars)


def split_flags(stored):
    """(token ids, trained, starts) of stored blocks (numpy or torch, any shape)."""
    return stored & IDS, (stored & TRAIN) != 0, (stored & START) != 0


# ---------------------------------------------------------------------------------------------------------
# Driver side: the sources, cut into work units; their first records read before Ray


def plan_chat_units(cfg: ChatData) -> list[Unit]:
    """Check every file (format, the messages column, its first records) and cut it into units, train files
    first, in a fixed order (text's units: byte ranges of JSONL, parquet row groups). Bad records among a file's
    first ones (within data.max_bad_samples) are named on the console."""
    splits = [("auto" if not cfg.val_files else "train", cfg.train_files), ("val", cfg.val_files)]
    units = []
    for split, patterns in splits:
        key = "data.val_files" if split == "val" else "data.train_files"
        for path in map(os.path.abspath, expand_files(patterns, key)):
            fmt = text_format(cfg, path)
            size = os.path.getsize(path)
            if size == 0:
                raise DataError(f"{path} is empty: fill it or remove it from the {key} list")
            if fmt == "parquet":
                column = ((cfg.pair_fields()[1], "data.chosen_field") if cfg.pair_fields() else
                          (cfg.messages_field, "data.messages_field"))
                groups = parquet_row_groups(path, *column, key)
                units += [Unit(split, path, "parquet", g, g + 1) for g in range(groups)]
                first, first_line = Unit(split, path, "parquet", 0, 1), 1
            elif fmt == "jsonl":
                units += [Unit(split, path, fmt, s, min(s + UNIT_BYTES, size)) for s in range(0, size, UNIT_BYTES)]
                start, first_line = _first_record(path, key)
                first = Unit(split, path, fmt, start, min(size, start + FIRST_BYTES))
            else:
                raise DataError(f"{path}: data.kind chat reads JSONL or parquet conversations, not {fmt} text")
            bad = check_first_records(cfg, first, first_line)
            if bad:
                print(f"[behemoth] {path}: {len(bad)} of its first records are not {samples_are(cfg)} (skipped in "
                      f"training, within data.max_bad_samples={cfg.max_bad_samples}): {'; '.join(bad)}", flush=True)
    return units


def _first_record(path: str, key: str) -> tuple[int, int]:
    """The byte offset and line number of the file's first line that is not blank; a file of blank lines is
    refused here, not found empty after Ray has tokenised it."""
    offset, line_start, line = 0, 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(FIRST_BYTES):
            filled = len(chunk) - len(chunk.lstrip())
            if filled < len(chunk):
                head = chunk[:filled]
                cut = head.rfind(b"\n")
                return (offset + cut + 1 if cut >= 0 else line_start), line + head.count(b"\n")
            if (cut := chunk.rfind(b"\n")) >= 0:
                line_start = offset + cut + 1
            line += chunk.count(b"\n")
            offset += len(chunk)
    raise DataError(f"{path} holds only blank lines, no records: fill it or remove it from the {key} list")


def check_first_records(cfg: ChatData, unit: Unit, first_line: int = 1) -> list[str]:
    """A file's first records read and rendered as the tokenising task will (at most FIRST_RECORDS): a file
    of the wrong shape, or a template that cannot render it, fails here in one line, before Ray starts. Bad
    records among them fail only beyond data.max_bad_samples; returned, named ("FILE line N: why")."""
    pairs = cfg.pair_fields()
    _, records = read_unit_records(unit, pairs or cfg.messages_field)
    named = [(r.where(first_line), r.value) for r in records[:FIRST_RECORDS]]
    if named and all(isinstance(v, _Bad) for _, v in named):
        where, bad = named[0]
        raise DataError(f"{where}: {bad.reason}: is data.messages_field ({cfg.messages_field!r}) the column "
                        f"holding conversations?" if not pairs else f"{where}: {bad.reason}")
    bad, good = [], []
    for where, value in named:
        problem, sample = record_sample(value, pairs, cfg.train_on)
        (bad.append(f"{where}: {problem}") if problem else good.append((where, sample)))
    tok = chat_tokenizer(cfg)
    rendered = render_samples(RenderSpec.of(tok), [s for _, s in good], Window.of(tok, cfg.train_on, cfg.seq_len),
                              pairs)
    for (where, _), result in zip(good, rendered):
        if isinstance(result, Failed) and result.template:
            raise DataError(f"{where}: {result.reason}")
        if isinstance(result, Failed) and result.reason != TOO_LONG:
            bad.append(f"{where}: {result.reason}")
    if len(bad) > cfg.max_bad_samples:
        raise DataError(f"{len(bad)} of the first {len(named)} records are not {samples_are(cfg)}, more than "
                        f"data.max_bad_samples={cfg.max_bad_samples}: {'; '.join(bad[:5])}")
    return bad


@dataclass(frozen=True)
class _Bad:
    reason: str


@dataclass(frozen=True)
class Record:
    """A record as read: `source` names its file (a JSONL record's line is its unit's first line + `line`) or
    its row ("FILE row N"; `line` -1); `value` is the conversation, or a _Bad."""

    source: str
    line: int
    value: object

    def where(self, first_line: int) -> str:
        return self.source if self.line < 0 else f"{self.source} line {first_line + self.line}"


def read_unit_records(unit: Unit, field: str | tuple[str, ...]) -> tuple[int, list[Record]]:
    """The lines a unit holds (its successor's first line is this one's + that: no file is read again from its
    start to number lines), and its records: `field`'s value, or with a tuple of fields (a preference pair's) the
    record (a parquet row: those of its columns the file has, whatever other columns hold)."""
    if unit.fmt == "parquet":
        pf = pq.ParquetFile(unit.path)
        first_row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
        if isinstance(field, tuple):
            columns = [f for f in field if f in pf.schema_arrow.names]
            values = pf.read_row_group(unit.start, columns=columns).to_pylist()
        else:
            values = pf.read_row_group(unit.start, columns=[field]).column(field).to_pylist()
        return 0, [Record(f"{unit.path} row {first_row + i}", -1, v) for i, v in enumerate(values)]
    data, _ = _read_line_range(unit.path, unit.start, unit.end)
    lines = data.split(b"\n")
    out = [Record(unit.path, i, _parse_record(line, field)) for i, line in enumerate(lines) if line.strip()]
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0), out


def _parse_record(line: bytes, field: str | tuple[str, ...]):
    """A JSONL line's conversation (`field`'s value; a tuple of fields: the whole record), or a _Bad saying why not. A line longer than MAX_RECORD_BYTES is not parsed
    (its parse alone costs several times its size in memory)."""
    if len(line) > MAX_RECORD_BYTES:
        return _Bad(f"a record of {len(line)} bytes, more than the {MAX_RECORD_BYTES >> 20} MiB a record may hold")
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return _Bad(f"invalid UTF-8 ({e.reason})")
    except ValueError as e:
        return _Bad(f"not valid JSON ({e})")
    except RecursionError:
        return _Bad("not valid JSON here (nested too deeply)")
    if isinstance(field, tuple):
        return record if isinstance(record, dict) else _Bad(f"not a JSON object ({type(record).__name__})")
    if not isinstance(record, dict) or field not in record:
        fields = sorted(record)[:20] if isinstance(record, dict) else type(record).__name__
        return _Bad(f"no field '{field}' (data.messages_field); the record has {fields}")
    return record[field]


# ---------------------------------------------------------------------------------------------------------
# Ray Data task side: records -> one row per conversation (or per bad record)


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
    """Rows of split ('train', 'val' or 'bad'), tokens (flags included: at most seq_len + 1, data/chat_render.py;
    a preference pair's both sequences) and for a bad record its source, line in the unit and reason; a pair
    longer than a block keeps its split, with TOO_LONG as its problem (the packer counts it)."""
    problems, good = [], []
    for record in records:
        problem, sample = record_sample(record.value, spec.pairs, spec.window.train_on)
        problems.append(problem)
        good += [] if problem else [sample]
    results = iter(render_samples(_task_render_spec(spec.render), good, spec.window, spec.pairs))
    rows = {"split": [], "tokens": [], "source": [], "line": [], "problem": []}
    for record, problem in zip(records, problems):
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
            chosen = split if split != "auto" else ("val" if is_validation(json.dumps(record.value, sort_keys=True),
                                                                           spec.seed, spec.val_fraction) else "train")
        _add_row(rows, chosen if problem in (None, TOO_LONG) else "bad", tokens, record.source, record.line,
                 problem or "")
    return _rows_table(rows)


def record_sample(value, pairs: tuple[str, str, str] | None, train_on: str) -> tuple[str | None, object]:
    """(why the record is not a sample or None, the sample): a conversation, or with `pairs` (the prompt, chosen
    and rejected fields) a preference pair's (prompt, chosen, rejected) messages (data/pair_render.py)."""
    if isinstance(value, _Bad):
        return value.reason, None
    if pairs:
        return pair_of(value, pairs)
    return conversation_problem(value, train_on), value


def render_samples(spec: RenderSpec, samples: list, window: Window, pairs) -> list[np.ndarray | Failed]:
    """The samples' stored tokens, rendered in the bounded process: conversations, or (`pairs`) preference pairs."""
    process = process_for(spec)
    return process.pairs(samples, window) if pairs else process.tokens(samples, window)


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
    from behemoth.data.text_packing import packed_index

    tok = chat_tokenizer(cfg)
    key = {"chat": CHAT_VERSION, "messages_field": cfg.messages_field, "template": tok.chat_template,
           "train_on": cfg.train_on, "packing": cfg.packing, "overlong": cfg.overlong, "open_blocks": OPEN_BLOCKS,
           **({"pairs": cfg.pair_fields(), "pair_version": 1} if cfg.pair_fields() else {})}
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


def samples_are(cfg: ChatData) -> str:
    return "preference pairs" if cfg.pair_fields() else "conversations"


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
    from behemoth.data.text_packing import CACHE_VERSION, _list_values
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
    from behemoth.data.text_packing import HF_ROWS_PER_BLOCK, _hf_splits

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
