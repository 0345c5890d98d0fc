"""Chat data's sources before Ray (data.kind chat and preference): every file's format and columns checked, cut
into work units (byte ranges of JSONL, parquet row groups), and its first records read and rendered as the
tokenising tasks will (data/chat/chat_packing.py): a file of the wrong shape or a template that cannot render it fails
here, in one line; bad records among the first ones are named.
"""

from __future__ import annotations

import os

from behemoth.data.chat.chat import (
    ChatData,
    _Bad,
    chat_tokenizer,
    read_unit_records,
    record_sample,
    render_samples,
    samples_are,
)
from behemoth.data.chat.chat_render import Failed, RenderSpec, Window
from behemoth.data.chat.pair_render import TOO_LONG
from behemoth.data.text.text import (FIRST_BYTES, FIRST_RECORDS, Unit, byte_range_units, parquet_row_groups,
                                     planned_files, text_format)
from behemoth.errors import DataError


def plan_chat_units(cfg: ChatData) -> list[Unit]:
    """Check every file (format, the messages column, its first records) and cut it into units, train files
    first, in a fixed order (text's units: byte ranges of JSONL, parquet row groups). Bad records among a file's
    first ones (within data.max_bad_samples) are named on the console."""
    units = []
    for split, path, key in planned_files(cfg):
        fmt = text_format(cfg, path)
        if fmt == "parquet":
            column = ((cfg.pair_fields()[1], "data.chosen_field") if cfg.pair_fields() else
                      (cfg.messages_field, "data.messages_field"))
            groups = parquet_row_groups(path, *column, key)
            units += [Unit(split, path, "parquet", g, g + 1) for g in range(groups)]
            first, first_line = Unit(split, path, "parquet", 0, 1), 1
        elif fmt == "jsonl":
            units += byte_range_units(split, path, fmt)
            start, first_line = _first_record(path, key)
            first = Unit(split, path, fmt, start, min(os.path.getsize(path), start + FIRST_BYTES))
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
