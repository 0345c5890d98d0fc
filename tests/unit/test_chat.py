"""Chat data (issue 66): conversations rendered with the chat template, the loss on the assistant's tokens only
(found from the template's renderings), conversations packed whole with their own positions and attention, the
loss a mean over the global batch's trained tokens, bad records named; all without Ray (the Ray Data pipeline
and a run: tests/integration/test_chat.py)."""

import json

import numpy as np
import pytest
import torch
from behemoth.data.chat.chat import (
    CHATML,
    START,
    TRAIN,
    ChatData,
    chat_tokenizer,
    conversation_problem,
    encode_conversation,
    read_unit_records,
    split_flags,
)
from behemoth.data.chat.chat_packing import ChatPacker
from behemoth.data.chat.chat_sources import check_first_records
from behemoth.data.text.text import Unit
from behemoth.errors import ConfigError, DataError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who found the key?"},
        {"role": "assistant", "content": "Ada found the key."}, {"role": "user", "content": "Where?"},
        {"role": "assistant", "content": "At the market."}]


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    """Generated conversations (train 120, val 20) and a BPE tokenizer with ChatML's tokens and template."""
    from behemoth.data.text.synth_text import write_synth_chat
    from behemoth.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("chat")
    write_synth_chat(root, train_documents=120, val_documents=20, seed=1)
    train_tokenizer([str(root / "train.jsonl")], root / "tokenizer", vocab_size=400, chat=True)
    return root


def _cfg(corpus, **data) -> ChatData:
    cfg = ChatData(kind="chat", train_files=[str(corpus / "train.jsonl")], val_files=[str(corpus / "val.jsonl")],
                   tokenizer=str(corpus / "tokenizer"), **data)
    cfg.validate()
    return cfg


def _trained_runs(tok, ids, trained) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, run = [], []
    for token, on in zip(ids.tolist(), trained.tolist()):
        if on:
            run.append(token)
        elif run:
            runs.append(tok.decode(run)), run.clear()
    return runs + ([tok.decode(run)] if run else [])


def test_the_assistant_turns_are_the_trained_tokens_found_from_the_templates_renderings(chat_corpus):
    tok = chat_tokenizer(_cfg(chat_corpus))
    stored = encode_conversation(tok, CHAT)
    ids, trained, starts = split_flags(stored)
    assert ids.tolist() == list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=False))  # as rendered
    assert starts.tolist() == [True] + [False] * (len(ids) - 1)
    # the trained runs are exactly each reply and its end of turn (the model learns to stop), nothing of the
    # system's or user's turns, nor the generation prompt "<|im_start|>assistant\n"
    runs = _trained_runs(tok, ids, trained)
    assert runs == ["Ada found the key.<|im_end|>\n", "At the market.<|im_end|>\n"]
    every = split_flags(encode_conversation(tok, CHAT, train_on="all"))[1]
    assert every.all()


def test_a_conversation_opening_with_the_assistant_trains_its_later_replies_only(chat_corpus):
    """A conversation whose first turn is the assistant's: its span began at the rendering's first character, so
    the template's opening (a default system prompt, the turn's header) was trained as the reply. It is context
    now, and the replies after a user's turn train as in any conversation."""
    tok = chat_tokenizer(_cfg(chat_corpus))
    opening = [{"role": "assistant", "content": "Hello there."}, *[m for m in CHAT if m["role"] != "system"]]
    ids, trained, _ = split_flags(encode_conversation(tok, opening))
    runs = _trained_runs(tok, ids, trained)
    assert runs == ["Ada found the key.<|im_end|>\n", "At the market.<|im_end|>\n"]


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(chat_corpus, tmp_path):
    # a template that shows the system line only once the conversation has an assistant turn: the prefix with the
    # generation prompt is not the start of the conversation with the reply
    template = tmp_path / "odd.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] != 'system' or messages|length > 2 %}<|im_start|>"
                        "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = chat_tokenizer(_cfg(chat_corpus, chat_template=str(template)))
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        encode_conversation(tok, CHAT[:3])


def test_a_tokenizer_without_a_template_or_without_chatmls_tokens_is_refused(chat_corpus, text_corpus):
    plain = {"train_files": [str(chat_corpus / "train.jsonl")], "val_files": [str(chat_corpus / "val.jsonl")],
             "tokenizer": str(text_corpus / "tokenizer")}
    with pytest.raises(ConfigError, match="has no chat template"):
        chat_tokenizer(ChatData(kind="chat", **plain))
    with pytest.raises(ConfigError, match="no <|im_start|>, <|im_end|> token"):
        chat_tokenizer(ChatData(kind="chat", chat_template="chatml", **plain))
    assert chat_tokenizer(_cfg(chat_corpus, chat_template="chatml")).chat_template == CHATML
    with pytest.raises(ConfigError, match="data.document_mask is always on"):
        _cfg(chat_corpus, document_mask=False)


@pytest.mark.parametrize("value, reason", [
    ("hi", "not a list of messages"), ([], "an empty list"),
    ([{"role": "bot", "content": "x"}], "role 'bot', not one of"),
    ([{"role": "user", "content": ["x"]}], "content of type list, not text"),
    ([{"role": "user", "content": "x"}], "no assistant turn"),
])
def test_what_is_not_a_conversation(value, reason):
    assert reason in conversation_problem(value)


def test_bad_records_are_named_by_file_and_line_and_fail_beyond_max_bad_samples(chat_corpus, tmp_path):
    lines = [json.dumps({"messages": CHAT[1:3]}), "{not json", json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
             json.dumps({"text": "a story"}), json.dumps({"messages": CHAT})]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    lines_held, records = read_unit_records(Unit("train", str(path), "jsonl", 0, path.stat().st_size), "messages")
    assert [r.where(1) for r in records] == [f"{path} line {i}" for i in range(1, 6)] and lines_held == 5
    cfg = _cfg(chat_corpus, max_bad_samples=2)
    with pytest.raises(DataError, match=rf"3 of the first 5 records.*{path} line 2: not valid JSON"):
        check_first_records(cfg, Unit("train", str(path), "jsonl", 0, path.stat().st_size))
    check_first_records(_cfg(chat_corpus, max_bad_samples=3), Unit("train", str(path), "jsonl", 0, path.stat().st_size))
    wrong = tmp_path / "text.jsonl"
    wrong.write_text(json.dumps({"text": "a story"}) + "\n")
    with pytest.raises(DataError, match="line 1: no field 'messages'.*is data.messages_field"):
        check_first_records(cfg, Unit("train", str(wrong), "jsonl", 0, wrong.stat().st_size))


def _conversation(length: int, first: int, trained_from: int) -> np.ndarray:
    out = np.arange(first, first + length, dtype=np.int32)
    out[trained_from:] |= TRAIN
    out[0] |= START
    return out


def test_conversations_are_packed_whole_padded_apart_and_the_overlong_counted():
    blocks = []
    packer = ChatPacker(8, pad=0, sink=blocks.append, open_blocks=2)
    for length in (5, 6, 3, 2, 12):  # 5 -> block 0; 6 -> block 1; 3 -> block 0 (full); 2 -> block 1 (full); 12: cut
        packer.add(_conversation(length, 100 + 10 * length, 1))
    counts = packer.finish()
    rows = np.concatenate(blocks)
    ids, trained, starts = split_flags(rows)
    assert ids.tolist()[:2] == [[150, 151, 152, 153, 154, 130, 131, 132], [160, 161, 162, 163, 164, 165, 120, 121]]
    assert ids.tolist()[2] == [220 + i for i in range(8)] and starts[2].tolist() == [True] + [False] * 7  # cut at 8
    assert counts == {"documents": 5, "tokens": 24, "trained_tokens": 19, "padding_tokens": 0, "blocks": 3,
                      "truncated": 1, "dropped_overlong": 0, "tail_tokens_dropped": 0}
    blocks.clear()
    padded = ChatPacker(8, pad=0, sink=blocks.append, open_blocks=0, overlong="drop")
    for length in (5, 3, 12):
        padded.add(_conversation(length, 100, 1))
    counts = padded.finish()
    rows = np.concatenate(blocks)
    assert len(rows) == 2 and counts["dropped_overlong"] == 1 and counts["padding_tokens"] == 3 + 5
    ids, trained, starts = split_flags(rows[0])
    assert starts.tolist() == [True, False, False, False, False, True, False, False]  # the padding: its own document
    assert not trained[5:].any() and ids[5:].tolist() == [0, 0, 0]
    nothing = ChatPacker(4, pad=0, sink=blocks.append)
    nothing.add(_conversation(6, 1, 5))  # its only trained token is past the cut: nothing left to train on
    assert nothing.finish()["dropped_overlong"] == 1


def _tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _task(seq_len: int):
    from types import SimpleNamespace

    from behemoth.tasks.chat import ChatLM

    task = object.__new__(ChatLM)
    task.cfg = SimpleNamespace(data=SimpleNamespace(document_mask=True, seq_len=seq_len))
    task.transformers_model = True
    return task


def test_the_loss_is_the_assistant_tokens_own_and_user_tokens_carry_no_gradient(chat_corpus):
    """Two conversations packed in one block: the loss equals a hand-computed cross-entropy over the assistant
    tokens of each conversation run alone; the logits at positions that predict a user's (or the system's, or the
    padding's) tokens get no gradient."""
    import torch.nn.functional as F

    tok = chat_tokenizer(_cfg(chat_corpus))
    first, second = encode_conversation(tok, CHAT), encode_conversation(tok, CHAT[1:3])
    block = np.concatenate([first, second, np.full(5, tok.eos_token_id | START, np.int32)])
    stored = torch.from_numpy(block.astype(np.int64))[None]
    model, task = _tiny_llama(len(tok)), _task(len(block))
    seen = {}

    def keep(module, args, out):
        if out.requires_grad:  # (the training forward's, not the hand computation's)
            out.retain_grad()
            seen["logits"] = out

    model.lm_head.register_forward_hook(keep)
    loss, count = task.loss(model, {"input_ids": stored})
    loss.backward()
    hand, tokens = 0.0, 0
    for conversation in (first, second):
        ids, trained, _ = split_flags(torch.from_numpy(conversation.astype(np.int64)))
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        targets = trained[1:]
        hand += F.cross_entropy(logits[:-1][targets], ids[1:][targets], reduction="sum").item()
        tokens += int(targets.sum())
    assert int(count) == tokens and loss.item() == pytest.approx(hand / tokens, rel=1e-4)
    ids, trained, starts = split_flags(stored[0])
    predicts_trained = torch.zeros(len(block), dtype=torch.bool)
    predicts_trained[:-1] = trained[1:] & ~starts[1:]  # position t's logits predict token t + 1
    grad = seen["logits"].grad[0].abs().sum(dim=-1)
    assert (grad[~predicts_trained] == 0).all() and (grad[predicts_trained] > 0).all()


def test_the_step_is_a_mean_over_the_global_batchs_trained_tokens_not_of_micro_batch_means(chat_corpus):
    """Two micro-batches with 1 and many trained tokens: the accumulated gradient equals the gradient of the
    token-mean loss over both at once (a mean of micro-batch means would weigh the lone token as much as all the
    others)."""
    from behemoth.worker.loop import loss_weights

    tok = chat_tokenizer(_cfg(chat_corpus))
    long = encode_conversation(tok, CHAT)
    short = long.copy()
    short[:] = short & ~TRAIN
    short[-3] |= TRAIN  # one trained token
    batches = [{"input_ids": torch.from_numpy(b.astype(np.int64))[None]} for b in (long, short)]
    model, task = _tiny_llama(len(tok)), _task(len(long))
    weights = loss_weights(task, batches)
    for i, batch in enumerate(batches):
        loss, _ = task.loss(model, batch)
        (loss * weights[i]).backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    both = {"input_ids": torch.cat([b["input_ids"] for b in batches])}
    task.loss(model, both)[0].backward()
    for got, want in zip(accumulated, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    many = int(task.loss_items(batches[0]))
    assert many > 10 and [float(w) for w in weights] == pytest.approx([many / (many + 1), 1 / (many + 1)])


def test_the_evaluations_prompts_are_each_conversations_opening_and_the_replies_are_the_models_own(chat_corpus):
    """data.eval_samples: the prompts are the validation blocks' first conversations up to their first trained
    token (the template's generation prompt included), and eval_samples gives transformers' greedy reply to
    each, decoded."""
    from types import SimpleNamespace

    from behemoth.data.chat.chat import tokenizer_files
    from behemoth.data.chat.chat_packing import sample_prompts
    from behemoth.data.chat.chat import render_text
    from behemoth.models.causal_lm import generation_config

    tok = chat_tokenizer(_cfg(chat_corpus))
    blocks = []
    packer = ChatPacker(256, tok.eos_token_id, blocks.append)
    for conversation in (CHAT, CHAT[1:3], CHAT[3:5]):
        packer.add(encode_conversation(tok, conversation))
    packer.finish()
    prompts = sample_prompts(np.concatenate(blocks), 2)
    assert prompts == [list(tok.apply_chat_template(c, tokenize=True, return_dict=False, add_generation_prompt=True))
                       for c in (CHAT[:2], CHAT[1:2])]
    model, task = _tiny_llama(len(tok)), _task(256)
    task.cfg.data.eval_max_new_tokens = 6
    task.index = SimpleNamespace(stats={"eval_prompts": prompts, "tokenizer_files": tokenizer_files(tok),
                                        "eval_stop_ids": generation_config(tok, render_text).eos_token_id})
    said = task.eval_samples(model.eval())
    expected = model.generate(torch.tensor([prompts[1]]), max_new_tokens=6, do_sample=False,
                              pad_token_id=tok.eos_token_id)[0, len(prompts[1]):]
    assert said[1] == {"prompt": tok.decode(prompts[1], skip_special_tokens=True).strip(),
                       "reply": tok.decode(expected, skip_special_tokens=True)}
    assert "Who found the key?" in said[1]["prompt"] and len(said) == 2
