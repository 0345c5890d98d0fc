"""What a chat record or a chat template can cost is bounded (issue 72, item 4): a conversation costs what its
first seq_len tokens cost whatever its length or number of turns; templates render in a process of their own
with a CPU-time and a memory bound; a late work unit's lines are numbered without reading the file from its
start; files of no records, and files that are not what their name says, are one line before Ray."""

import dataclasses
import json
import os
import signal
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from behemoth.data.chat.chat import ChatData, chat_tokenizer, encode_conversation, read_unit_records, split_flags
from behemoth.data.chat.chat_packing import BadRecords, _nothing_to_train, encode_units
from behemoth.data.chat.chat_sources import check_first_records, plan_chat_units
from behemoth.data.chat.chat_render import RenderSpec, TemplateProcess, Window, conversation_tokens, window_chars
from behemoth.data.text.text import UNIT_BYTES, Unit
from behemoth.errors import DataError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who found the key?"},
        {"role": "assistant", "content": "Ada found the key."}, {"role": "user", "content": "Where?"},
        {"role": "assistant", "content": "At the market."}]


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    from behemoth.data.text.synth_text import write_synth_chat
    from behemoth.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("chat")
    write_synth_chat(root, train_documents=40, val_documents=10, seed=1)
    train_tokenizer([str(root / "train.jsonl")], root / "tokenizer", vocab_size=400, chat=True)
    return root


@pytest.fixture(scope="module")
def tok(chat_corpus):
    return chat_tokenizer(_cfg(chat_corpus))


def _cfg(corpus, **data) -> ChatData:
    data = {"train_files": [str(corpus / "train.jsonl")], "val_files": [str(corpus / "val.jsonl")], **data}
    cfg = ChatData(kind="chat", tokenizer=str(corpus / "tokenizer"), **data)
    cfg.validate()
    return cfg


def _counting(tok):
    """apply_chat_template and the Rust encoder, counting the characters each is given."""
    seen = {"renders": 0, "rendered": 0, "encoded": 0}

    def render(messages, gen):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        seen["renders"] += 1
        seen["rendered"] += len(text)
        return text

    def encode(text):
        seen["encoded"] += len(text)
        return tok.backend_tokenizer.encode(text, add_special_tokens=False)

    return render, encode, seen


def test_the_rendering_process_gives_the_tokens_apply_chat_template_gives(chat_corpus, tok):
    conversations = [json.loads(line)["messages"] for line in (chat_corpus / "train.jsonl").read_text().splitlines()]
    trained = 0
    for seq_len in (None, 48):
        got = TemplateProcess(RenderSpec.of(tok)).tokens(conversations, Window.of(tok, "assistant", seq_len))
        for conversation, tokens in zip(conversations, got):
            assert np.array_equal(tokens, encode_conversation(tok, conversation, "assistant", seq_len))
            whole = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
            kept = whole if seq_len is None else whole[:seq_len + 1]
            assert split_flags(tokens)[0].tolist() == kept
            trained += int(split_flags(tokens)[1].sum())
    assert trained > 0


def test_a_conversation_costs_what_its_first_seq_len_tokens_cost(tok):
    seq_len = 64
    window = window_chars(tok, seq_len)
    # one 50 MB message: only the window's characters are rendered and encoded (it was the whole: 154 s, 10.8 GB)
    huge = [CHAT[0], {"role": "user", "content": "the key " * 6_500_000}, *CHAT[2:]]
    render, encode, seen = _counting(tok)
    stored = conversation_tokens(render, encode, huge, "assistant", seq_len, window)
    assert len(stored) == seq_len + 1 and seen["encoded"] <= window + 200 and seen["rendered"] <= 2 * (window + 200)
    # ... and its first seq_len tokens are the uncut conversation's (checked where the whole is cheap to encode)
    long = [CHAT[0], {"role": "user", "content": "the key " * (window // 4)}, *CHAT[2:]]
    whole = list(tok.apply_chat_template(long, tokenize=True, return_dict=False))
    assert split_flags(encode_conversation(tok, long, "assistant", seq_len))[0].tolist() == whole[:seq_len + 1]
    # 8,000 short turns: the renderings stop at the first assistant turn past the seq_len-th token (it was
    # 2 x 4,000 + 1 renderings of up to the whole conversation: quadratic, 258 s)
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(8000)]
    render, encode, seen = _counting(tok)
    stored = conversation_tokens(render, encode, turns, "assistant", seq_len, window)
    assert seen["renders"] < 30 and len(stored) == seq_len + 1
    assert np.array_equal(stored, encode_conversation(tok, turns[:40], "assistant", seq_len))


def test_a_50_mb_record_is_checked_in_seconds(chat_corpus, tmp_path):
    path = tmp_path / "huge.jsonl"
    huge = [CHAT[0], {"role": "user", "content": "the key " * 6_500_000}, *CHAT[2:]]
    path.write_text(json.dumps({"messages": huge}) + "\n" + json.dumps({"messages": CHAT}) + "\n")
    cfg = _cfg(chat_corpus, train_files=[str(path)], seq_len=64)
    started = time.monotonic()
    assert check_first_records(cfg, Unit("train", str(path), "jsonl", 0, 8192)) == []
    assert time.monotonic() - started < 30  # (10 s here; 154 s before the bound)


def test_a_record_whose_other_fields_no_window_bounds_is_a_bad_record_not_the_templates(chat_corpus, tok):
    window = Window.of(tok, "assistant", 16)
    heavy = [{"role": "user", "content": "hi", "name": "x" * (window.max_chars + 1)}, CHAT[2]]
    (failed,) = TemplateProcess(RenderSpec.of(tok)).tokens([heavy], window)
    assert not failed.template and "message 0's fields besides its content" in failed.reason


def test_templates_are_bounded_in_time_and_memory_and_the_process_goes_on(tok):
    spec, window = RenderSpec.of(tok), Window.of(tok, "assistant", 64)
    loops = dataclasses.replace(spec, cpu_s=1.0, template="{% for i in range(100000) %}{% for j in range(100000) %}"
                                                          "{% endfor %}{% endfor %}")
    started = time.monotonic()
    assert [r.reason for r in TemplateProcess(loops).tokens([CHAT, CHAT], window)] == \
        ["the chat template took more than 1 s of CPU to render it"] * 2
    assert time.monotonic() - started < 20
    big = dataclasses.replace(spec, memory_bytes=256 << 20, template="{% if messages|length > 2 %}{{ 'x' * "
                              "4000000000 }}{% endif %}" + spec.template)
    process = TemplateProcess(big)
    failed, fine = process.tokens([CHAT, CHAT[1:3]], window)
    assert failed.reason == "the chat template needed more than 0.25 GiB to render it" and failed.template
    assert np.array_equal(fine, encode_conversation(tok, CHAT[1:3], "assistant", 64))


def test_a_rendering_process_that_dies_costs_the_record_it_was_on(tok):
    window = Window.of(tok, "assistant", 64)
    spec = dataclasses.replace(RenderSpec.of(tok), cpu_s=60.0, template=(
        "{% if messages[0]['content'] == 'slow' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}" + RenderSpec.of(tok).template))
    process = TemplateProcess(spec)
    process.tokens([CHAT[1:3]], window)  # (started)
    pid = process._child.pid
    import threading

    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    first, second, third = process.tokens([CHAT[1:3], [{"role": "user", "content": "slow"}, CHAT[2]], CHAT[1:3]],
                                          window)
    assert second.reason == "the chat template's process ended while rendering it (out of memory, or killed)"
    assert np.array_equal(first, third) and process._child.pid != pid


def test_a_late_units_lines_are_numbered_without_reading_the_file_from_its_start(chat_corpus, tok, tmp_path):
    line = json.dumps({"messages": CHAT}) + "\n"
    path = tmp_path / "big.jsonl"
    path.write_text(line * (40 * UNIT_BYTES // len(line)))
    size = path.stat().st_size
    before = _bytes_read()
    read_unit_records(Unit("train", str(path), "jsonl", size - UNIT_BYTES // 2, size), "messages")
    assert _bytes_read() - before < 2 * UNIT_BYTES  # (it read the file up to that unit: 40 MB)
    # the driver numbers each unit's lines from the lines the units before it held
    small = tmp_path / "small.jsonl"
    small.write_text("".join("{not json\n" if n in (7, 31, 52) else line for n in range(1, 60)))
    size, step = small.stat().st_size, 2000  # (units of 2,000 bytes: several lines each, lines across cuts)
    from behemoth.data.chat.chat_packing import ChatSpec

    spec = ChatSpec(RenderSpec.of(tok), Window.of(tok, "assistant", 64), 0, 0.0)
    bad = BadRecords(limit=5)
    for start in range(0, size, step):
        unit = Unit("train", str(small), "jsonl", start, min(start + step, size))
        table = encode_units(pa.Table.from_pylist([dataclasses.asdict(unit)]), field="messages", spec=spec)
        for row in table.to_pylist():
            if row["split"] == "bad":
                bad.add(row["source"], row["line"], row["problem"])
            elif row["split"] == "unit_end":
                bad.unit_end(row["source"], row["line"])
    assert [name.split(": ")[0] for name in bad.named] == [f"{small} line {n}" for n in (7, 31, 52)]


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_json_nested_past_pythons_recursion_is_a_bad_record_named_at_check(chat_corpus, tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + "[" * 100_000 + "\n" + json.dumps({"messages": CHAT}) + "\n")
    plan_chat_units(_cfg(chat_corpus, train_files=[str(path)], max_bad_samples=1))
    assert f"{path}: 1 of its first records are not conversations (skipped in training, within " \
           f"data.max_bad_samples=1): {path} line 2: not valid JSON here (nested too deeply)" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"line 2: not valid JSON here \(nested too deeply\)"):
        plan_chat_units(_cfg(chat_corpus, train_files=[str(path)], max_bad_samples=0))


def test_files_of_no_records_are_refused_before_ray(chat_corpus, tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n" * 10_000)
    with pytest.raises(DataError, match=f"{blank} holds only blank lines, no records: fill it or remove it from "
                                        "the data.train_files list"):
        plan_chat_units(_cfg(chat_corpus, train_files=[str(blank)]))
    late = tmp_path / "late.jsonl"  # blank lines past the first 8 KiB, then a record that is not one
    late.write_text("\n" * 20_000 + json.dumps({"text": "a story"}) + "\n")
    with pytest.raises(DataError, match=f"{late} line 20001: no field 'messages'"):
        plan_chat_units(_cfg(chat_corpus, train_files=[str(late)]))
    not_parquet = tmp_path / "val.parquet"
    not_parquet.write_text("not parquet")
    with pytest.raises(DataError, match=f"{not_parquet} is not a parquet file pyarrow can read .*remove it from the "
                                        "data.val_files list"):
        plan_chat_units(_cfg(chat_corpus, val_files=[str(not_parquet)]))
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string()),
                                                                          ("content", pa.string())])))}), empty)
    with pytest.raises(DataError, match=f"{empty} holds no rows: fill it or remove it from the data.val_files list"):
        plan_chat_units(_cfg(chat_corpus, val_files=[str(empty)]))


def test_a_split_that_packs_nothing_says_why_in_its_own_words(chat_corpus):
    none = {"documents": 0, "dropped_overlong": 0}
    assert _nothing_to_train(_cfg(chat_corpus, val_files=[], val_fraction=0.01), "val", none, 0) == (
        "no conversation went to the val split: data.val_fraction=0.01 of the train files' conversations chose "
        "none; raise data.val_fraction or give data.val_files")
    assert _nothing_to_train(_cfg(chat_corpus), "train", none, 3) == (
        "the data.train_files hold no conversations (3 bad records skipped): give files of `messages` records")
    assert "2 longer than data.seq_len=512 dropped" in _nothing_to_train(
        _cfg(chat_corpus), "train", {"documents": 0, "dropped_overlong": 2}, 0)
