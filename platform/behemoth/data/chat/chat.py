"""Chat data for fine-tuning a causal LM (data.kind: chat): conversations in the OpenAI / Hugging Face `messages`
shape, `[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]`, one per JSONL line, parquet
row or Hugging Face dataset row (the column: data.messages_field).

The pipeline is the text pipeline's (data/text/text.py, data/text/text_packing.py: work units, Ray Data tasks, a packed
cache on disk, the token store; for chat, data/chat/chat_sources.py plans the units and checks the first records before
Ray, data/chat/chat_packing.py tokenises and packs), with three differences:

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

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pyarrow.parquet as pq

from behemoth.data.chat.chat_tokens import ROLES, conversation_problem  # noqa: F401 - named here too
from behemoth.data.chat.chat_render import (  # noqa: F401 - TRAIN, START, REJECTED, IDS: the stored flags, named
    # here too
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
from behemoth.data.chat.pair_render import pair_of
from behemoth.data.text.text import (
    TextData,
    Unit,
    _read_line_range,
    load_tokenizer,
)
from behemoth.errors import ConfigError

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
    most seq_len + 1 of them, bounded as the tokenising tasks bound them (data/chat/chat_render.py). In this process:
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


def record_sample(value, pairs: tuple[str, str, str] | None, train_on: str) -> tuple[str | None, object]:
    """(why the record is not a sample or None, the sample): a conversation, or with `pairs` (the prompt, chosen
    and rejected fields) a preference pair's (prompt, chosen, rejected) messages (data/chat/pair_render.py)."""
    if isinstance(value, _Bad):
        return value.reason, None
    if pairs:
        return pair_of(value, pairs)
    return conversation_problem(value, train_on), value


def render_samples(spec: RenderSpec, samples: list, window: Window, pairs) -> list[np.ndarray | Failed]:
    """The samples' stored tokens, rendered in the bounded process: conversations, or (`pairs`) preference pairs."""
    process = process_for(spec)
    return process.pairs(samples, window) if pairs else process.tokens(samples, window)


def samples_are(cfg: ChatData) -> str:
    return "preference pairs" if cfg.pair_fields() else "conversations"
