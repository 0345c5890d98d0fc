"""Preference tuning (issue 75): pairs read and rendered with the chat template (the prompt's tokens the same in
both replies, only the replies trained, bad records named), packed whole, and DPO's loss from per-reply
log-probability sums that equal a hand computation over each sequence alone; the reference never trained; no
gradient from a prompt or padding token. Without Ray (a run: tests/integration/test_preference.py)."""

import json
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from behemoth.job import config_from_dict
from behemoth.data.chat.chat import REJECTED, START, TRAIN, chat_tokenizer, read_unit_records, split_flags
from behemoth.data.chat.chat_packing import ChatPacker
from behemoth.data.chat.chat_sources import check_first_records
from behemoth.data.chat.chat_render import Failed, RenderSpec, Window, process_for
from behemoth.data.chat.pair_render import TOO_LONG, pair_of
from behemoth.data.chat.preference import PreferenceData
from behemoth.data.text.text import Unit
from behemoth.errors import ConfigError, DataError
from behemoth.tasks.dpo import dpo_losses, sequence_logps
from behemoth.tasks.preference import PreferenceLM

FIELDS = ("prompt", "chosen", "rejected")
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who found the key?"}]
PAIR = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "Ada found the key."}],
        "rejected": [{"role": "assistant", "content": "Boris found the map."}]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Generated pairs (train 60, val 12) and a BPE tokenizer with ChatML's tokens and template."""
    from behemoth.data.text.synth_text import write_synth_chat, write_synth_preference
    from behemoth.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("preference")
    write_synth_chat(root / "chat", train_documents=120, val_documents=2, seed=1)
    train_tokenizer([str(root / "chat" / "train.jsonl")], root / "tokenizer", vocab_size=400, chat=True)
    write_synth_preference(root, train_documents=60, val_documents=12, seed=1)
    return root


def _data(corpus, **keys) -> PreferenceData:
    cfg = PreferenceData(kind="preference", tokenizer=str(corpus / "tokenizer"),
                         **{"train_files": [str(corpus / "train.jsonl")], "val_files": [str(corpus / "val.jsonl")],
                            "seq_len": 256, **keys})
    cfg.validate()
    return cfg


def _pairs(cfg, pairs):
    tok = chat_tokenizer(cfg)
    return tok, process_for(RenderSpec.of(tok)).pairs(pairs, Window.of(tok, "assistant", cfg.seq_len))


def test_explicit_and_implicit_prompts_give_the_same_pair_and_bad_records_say_why():
    problem, pair = pair_of(PAIR, FIELDS)
    assert problem is None and pair == (PROMPT, PAIR["chosen"], PAIR["rejected"])
    implicit = {"chosen": PROMPT + PAIR["chosen"], "rejected": PROMPT + PAIR["rejected"]}
    assert pair_of(implicit, FIELDS) == (None, pair)
    for record, why in [({"chosen": PAIR["chosen"]}, "no field 'rejected'"),
                        ({**PAIR, "rejected": "Boris"}, "rejected: not a list of messages"),
                        ({**PAIR, "rejected": PAIR["chosen"]}, "the same reply"),
                        ({**PAIR, "chosen": [{"role": "user", "content": "hm"}]}, "chosen reply has no assistant"),
                        ({"chosen": PAIR["chosen"], "rejected": PAIR["rejected"]}, "share no opening message"),
                        # conversations that part at a user's turn: the replies would not start where the prompt ends
                        ({"chosen": PROMPT + PAIR["chosen"] + [{"role": "user", "content": "And?"}] + PAIR["chosen"],
                          "rejected": PROMPT + PAIR["chosen"] + [{"role": "user", "content": "Or?"}] + PAIR["rejected"]},
                         "the chosen reply starts with a user message")]:
        problem, pair = pair_of(record, FIELDS)
        assert pair is None and why in problem, (record, problem)


def test_a_pair_shares_its_prompt_tokens_and_trains_only_its_replies(corpus):
    cfg = _data(corpus)
    tok, (stored,) = _pairs(cfg, [pair_of(PAIR, FIELDS)[1]])
    ids, trained, starts = split_flags(stored.astype(np.int64))
    second = int(np.flatnonzero(starts)[1])
    chosen, rejected = ids[:second], ids[second:]
    # each sequence is the template's rendering of the prompt and its reply, token for token
    assert chosen.tolist() == list(tok.apply_chat_template(PROMPT + PAIR["chosen"], tokenize=True, return_dict=False))
    assert rejected.tolist() == list(tok.apply_chat_template(PROMPT + PAIR["rejected"], tokenize=True,
                                                             return_dict=False))
    prompt = list(tok.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert chosen[:len(prompt)].tolist() == rejected[:len(prompt)].tolist() == prompt
    # trained: exactly each reply and its end of turn; REJECTED on every token of the second sequence alone
    assert tok.decode(chosen[trained[:second]]) == "Ada found the key.<|im_end|>\n"
    assert tok.decode(rejected[trained[second:]]) == "Boris found the map.<|im_end|>\n"
    assert not trained[:len(prompt)].any() and not trained[second:second + len(prompt)].any()
    flagged = (stored & REJECTED) != 0
    assert not flagged[:second].any() and flagged[second:].all()


def test_a_pair_longer_than_a_block_is_dropped_whole_and_a_bad_one_named(corpus, tmp_path):
    cfg = _data(corpus, seq_len=40)
    _, (result,) = _pairs(cfg, [pair_of(PAIR, FIELDS)[1]])
    assert isinstance(result, Failed) and result.reason == TOO_LONG and not result.template
    lines = [PAIR, {**PAIR, "rejected": PAIR["chosen"]}, {"chosen": [], "rejected": []}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    unit = Unit("train", str(path), "jsonl", 0, path.stat().st_size)
    with pytest.raises(DataError, match="2 of the first 3 records are not preference pairs"):
        check_first_records(_data(corpus), unit)
    bad = check_first_records(_data(corpus, max_bad_samples=2), unit)
    assert [b.split(": ", 1)[0] for b in bad] == [f"{path} line 2", f"{path} line 3"], bad
    assert "nothing to prefer" in bad[0] and "chosen: not a list of messages (an empty list)" in bad[1]


def test_parquet_rows_are_pairs_too(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.parquet"
    import datetime

    # (another column of a type JSON cannot write: the pair's columns alone are read)
    when = datetime.datetime(2026, 11, 29)
    pq.write_table(pa.Table.from_pylist([{**PAIR, "at": when}, {**PAIR, "rejected": PAIR["chosen"], "at": when}]), path)
    cfg = _data(corpus, train_files=[str(path)], max_bad_samples=1)
    from behemoth.data.chat.chat_sources import plan_chat_units

    units = plan_chat_units(cfg)  # (the first records of each file checked: the row that is not a pair named)
    assert [u.fmt for u in units if u.path == str(path)] == ["parquet"]
    _, records = read_unit_records(units[0], FIELDS)
    assert set(records[0].value) == set(FIELDS)
    assert [pair_of(r.value, FIELDS)[0] is None for r in records] == [True, False]
    assert records[1].where(1) == f"{path} row 1"


def test_a_hugging_face_datasets_rows_are_pairs_too(corpus, tmp_path):
    """data.hf_dataset: the reply columns (and the prompt's) selected, each row read as a record, rendered as the
    files' are (the tokenising task's function called here without Ray); a dataset without a rejected column is
    refused by name."""
    import datasets
    from behemoth.data.chat.chat_packing import ChatSpec, encode_rows
    from behemoth.data.text.text_packing import _hf_splits

    rows = [PAIR, {**PAIR, "rejected": PAIR["chosen"]}]
    datasets.Dataset.from_list([{**r, "source": "x"} for r in rows]).save_to_disk(str(tmp_path / "ds"))
    cfg = _data(corpus, train_files=[], val_files=[], hf_dataset=str(tmp_path / "ds"), val_fraction=0.5,
                max_bad_samples=1)
    ((split, ds),) = _hf_splits(cfg, cfg.messages_field, cfg.pair_fields())
    assert split == "auto" and sorted(ds.column_names) == ["chosen", "prompt", "rejected"]
    tok = chat_tokenizer(cfg)
    spec = ChatSpec(render=RenderSpec.of(tok), window=Window.of(tok, "assistant", cfg.seq_len), seed=0,
                    val_fraction=0.5, pairs=cfg.pair_fields())
    table = ds.with_format("arrow")[:]
    import pyarrow as pa

    out = encode_rows(table.append_column("_row", pa.array([0, 1], pa.int64())), field=cfg.messages_field,
                      spec=spec, split="train", name="ds").to_pylist()
    assert out[0]["split"] == "train" and out[0]["tokens"] == _pairs(cfg, [pair_of(PAIR, FIELDS)[1]])[1][0].tolist()
    assert out[1]["split"] == "bad" and out[1]["source"] == "ds row 1" and "nothing to prefer" in out[1]["problem"]
    datasets.Dataset.from_list([{"chosen": PAIR["chosen"]}]).save_to_disk(str(tmp_path / "half"))
    with pytest.raises(DataError, match="has no column 'rejected'"):
        _hf_splits(_data(corpus, train_files=[], val_files=[], hf_dataset=str(tmp_path / "half"), val_fraction=0.5),
                   "messages", FIELDS)


def test_pairs_are_packed_whole_chosen_then_rejected_in_one_block():
    rng = random.Random(0)
    blocks = []
    packer = ChatPacker(64, 0, blocks.append, open_blocks=4, overlong="drop")
    for i in range(200):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        pair = np.full(a + b, TRAIN | (i + 1), np.int32)
        pair[0] |= START
        pair[a:] |= REJECTED
        pair[a] |= START
        packer.add(pair) if a + b <= 64 else None
    packer.finish()
    for block in blocks:
        starts = np.flatnonzero(block[0] & START).tolist()
        docs = [block[0][s:e] for s, e in zip(starts, starts[1:] + [64])]
        real = [d for d in docs if d[0] & TRAIN]
        assert len(real) % 2 == 0
        for chosen, rejected in zip(real[::2], real[1::2]):  # adjacent, the same pair's ids, chosen first
            assert not chosen[0] & REJECTED and rejected[0] & REJECTED
            assert (chosen[0] & 0xFFFF) == (rejected[0] & 0xFFFF)


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _block(pairs, length, pad=0):
    """One stored block from [(prompt ids, chosen ids, rejected ids)], padded."""
    out = []
    for prompt, chosen, rejected in pairs:
        for reply, flag in ((chosen, 0), (rejected, REJECTED)):
            seq = np.array(prompt + reply, np.int64) | flag
            seq[len(prompt):] |= TRAIN
            seq[0] |= START
            out.append(seq)
    used = sum(map(len, out))
    padding = np.full(length - used, pad, np.int64)
    padding[0] |= START
    return torch.from_numpy(np.concatenate(out + [padding]))


def _alone(model, prompt, reply) -> float:
    """log p(reply | prompt), the sequence by itself with plain log-softmax: the hand computation."""
    ids = torch.tensor([prompt + reply])
    logp = F.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    return sum(logp[t - 1, ids[0, t]].item() for t in range(len(prompt), len(prompt) + len(reply)))


def _task(data_keys=None, model_keys=None):
    cfg = config_from_dict({"data": {"kind": "preference", "train_files": ["x.jsonl"], "val_fraction": 0.1,
                                     "tokenizer": "t", "seq_len": 48, **(data_keys or {})},
                            "model": {"name": "causal_lm", "hf_config": {"model_type": "llama"}, **(model_keys or {})}})
    index = SimpleNamespace(train=[0], val=[0], vocab_size=64, eos_id=1, bos_id=None, stats={})
    return PreferenceLM(cfg, index)


def test_the_dpo_loss_equals_a_hand_computation_from_each_sequence_alone():
    policy, reference = _tiny_llama(0), _tiny_llama(1)
    pairs = [([5, 6, 7], [8, 9], [10, 11, 12]), ([13, 14], [15], [16, 17])]
    stored = torch.stack([_block(pairs, 48), _block(pairs[::-1], 48)])
    task = _task({"reference": "copy"})
    task._reference = reference  # (the frozen copy, made by hand: its weights differ from the policy's)
    loss, count = task.loss(policy, {"input_ids": stored})
    assert count.item() == 4
    hand = []
    for order in (pairs, pairs[::-1]):
        for prompt, chosen, rejected in order:
            pc, pr = _alone(policy, prompt, chosen), _alone(policy, prompt, rejected)
            rc, rr = _alone(reference, prompt, chosen), _alone(reference, prompt, rejected)
            hand.append(-F.logsigmoid(torch.tensor(0.1 * ((pc - rc) - (pr - rr)))).item())
    assert loss.item() == pytest.approx(sum(hand) / 4, rel=1e-4)
    # the window's metrics: TRL's names, over the pairs
    metrics = task.window_metrics(dict(zip(task.window_sum_names, task.take_window_sums().tolist())))
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                            "logps/chosen", "logps/rejected", "nll_loss"}
    chosen0 = _alone(policy, *pairs[0][:2])
    logps = [_alone(policy, p, c) for p, c, _ in pairs] * 2
    assert metrics["logps/chosen"] == pytest.approx(sum(logps) / 4, rel=1e-4) and chosen0 in logps
    # RPO (data.rpo_alpha): each pair's loss gains alpha x its chosen reply's mean token NLL
    rpo = _task({"reference": "copy", "rpo_alpha": 0.5})
    rpo._reference = reference
    nll = [-_alone(policy, p, c) / len(c) for p, c, _ in pairs] * 2
    expected = (sum(hand) + 0.5 * sum(nll)) / 4
    assert rpo.loss(policy, {"input_ids": stored})[0].item() == pytest.approx(expected, rel=1e-4)


def test_label_smoothing_is_the_conservative_loss():
    policy = (torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([2.0]))
    reference = (torch.tensor([-4.0]), torch.tensor([-4.5]))
    losses, sums = dpo_losses(policy, reference, beta=0.5, label_smoothing=0.2)
    z = 0.5 * ((-3.0 + 4.0) - (-5.0 + 4.5))
    assert losses.item() == pytest.approx(-0.8 * F.logsigmoid(torch.tensor(z)).item()
                                          - 0.2 * F.logsigmoid(torch.tensor(-z)).item())
    assert sums["correct"].item() == 1.0 and sums["chosen"].item() == pytest.approx(0.5)


def test_no_gradient_from_prompt_or_padding_tokens_and_none_into_the_reference():
    pairs = [([5, 6, 7], [8, 9], [10, 11, 12])]
    stored = _block(pairs, 24)[None]
    logits = torch.randn(1, 24, 64, requires_grad=True)
    chosen, rejected = sequence_logps(logits, stored)
    (chosen.sum() - 2 * rejected.sum()).backward()
    rows = logits.grad[0].abs().sum(-1)
    # a logit row predicts the next token: only the rows before a trained, non-first token carry gradient
    _, trained, starts = split_flags(stored[0])
    predicts = torch.zeros(24, dtype=torch.bool)
    predicts[:-1] = trained[1:] & ~starts[1:]
    assert (rows[~predicts] == 0).all() and (rows[predicts] > 0).all()
    assert predicts.sum().item() == 5  # chosen's 2, rejected's 3: no prompt token, no padding
    # the frozen copy: no gradient, unchanged by a step
    policy, task = _tiny_llama(0), _task({"reference": "copy"})
    task._reference = _tiny_llama(1).requires_grad_(False)
    before = {k: v.clone() for k, v in task._reference.state_dict().items()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    loss, _ = task.loss(policy, {"input_ids": _block(pairs, 48)[None]})
    loss.backward()
    optimizer.step()
    assert all(p.grad is None for p in task._reference.parameters())
    assert all(torch.equal(before[k], v) for k, v in task._reference.state_dict().items())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_the_precomputed_reference_is_the_starting_models_read_by_block_and_checked(tmp_path):
    """The table a scoring actor writes (its function called here without Ray: data/chat/block_scores.py's pass is
    tests/integration's) gives, block by block in any batch order, what the starting model's copy gives; a table
    whose bytes changed is refused."""
    import hashlib
    import io

    from behemoth.tasks.preference_reference import ReferenceScorer

    sizes = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    model = {"hf_config": sizes}
    blocks = torch.stack([_block([([5, 6, 7], [8, 9], [10, 11, 12]), ([13, 14], [15], [16, 17])], 48),
                          _block([([20, 21], [22, 23, 24], [25])], 48),
                          _block([([30, 31, 32, 33], [34], [35, 36]), ([5], [6], [7]), ([8], [9], [10])], 48)])
    precomputed = _task(model_keys=model)
    scores = ReferenceScorer(PreferenceLM, precomputed.cfg, 64, 1, None)()(blocks.numpy())
    assert [len(s) for s in scores] == [4, 2, 6]
    data = io.BytesIO()
    np.savez(data, offsets=np.cumsum([0] + [len(s) for s in scores]), logps=np.concatenate(scores))
    (tmp_path / "train.npz").write_bytes(data.getvalue())
    digest = hashlib.sha256(data.getvalue()).hexdigest()
    precomputed.index.stats["reference"] = {"folder": str(tmp_path), "train": {"file": "train.npz", "sha256": digest}}
    copy = _task({"reference": "copy"}, model_keys=model)
    policy = _tiny_llama(3)
    order = torch.tensor([2, 0])  # (a batch of blocks 2 and 0)
    batch = {"input_ids": blocks[order], "sample_id": order}
    with torch.no_grad():
        a, _ = precomputed.loss(policy, batch)
        b, _ = copy.loss(policy, batch)
    assert a.item() == pytest.approx(b.item(), rel=1e-5) and copy._reference is not None
    assert precomputed.__dict__.get("_reference") is None  # (no model built on the worker)
    with pytest.raises(DataError, match="holds 3 train blocks, the batch asks for block 7"):
        precomputed.loss(policy, {"input_ids": blocks[:1], "sample_id": torch.tensor([7])})
    precomputed.__dict__.pop("_tables")
    (tmp_path / "train.npz").write_bytes(data.getvalue()[:-8] + b"\0" * 8)
    with pytest.raises(DataError, match="does not hold the DPO reference the run computed"):
        precomputed.loss(policy, batch)


def test_the_references_identity_changes_with_its_starting_folder_local_or_under_a_uri(tmp_path):
    """The precomputed reference is reused only for the same starting weights: train.init_from's files (names,
    sizes, modification times) are part of its identity, read alike from a folder and from the same folder
    under a URI (file://: the object-store arm), so a folder rewritten in place is a new reference."""
    import os

    from behemoth.tasks.preference_reference import reference_identity

    start = tmp_path / "start"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"w" * 10)
    index = SimpleNamespace(stats={"cache": "tokens"})
    for source in (str(start), f"file://{start}"):
        cfg = _task().cfg
        cfg.train.init_from = source
        before = reference_identity(cfg, index)
        assert [name for name, *_ in before["init_from_files"]] == ["model.safetensors"]
        stat = os.stat(start / "model.safetensors")
        (start / "model.safetensors").write_bytes(b"v" * 10)  # the same size, its time put back: the same stamp
        os.utime(start / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert reference_identity(cfg, index) == before
        os.utime(start / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten later
        assert reference_identity(cfg, index) != before
    cfg.train.init_from = str(tmp_path / "missing")
    assert reference_identity(cfg, index)["init_from_files"] is None


def test_a_found_references_table_names_only_its_own_files(tmp_path):
    """A reference found beside the token cache is read from its meta.json: a file named outside its folder
    ('..', a '/', absolute) or a "folder" key among the splits (it would move the folder the workers read) is a
    damaged reference, refused naming meta.json, never read; a whole one is returned with its own folder."""
    from behemoth.tasks.preference_reference import precompute_reference, reference_folder, reference_identity

    cfg, index = _task().cfg, SimpleNamespace(stats={"cache": str(tmp_path / "tokens")})
    folder = reference_folder(reference_identity(cfg, index), index)
    (tmp_path / "tokens" / folder.rsplit("/", 1)[1]).mkdir(parents=True)
    entry = {"file": "val.npz", "sha256": "0" * 64}

    def found(files):
        (tmp_path / folder / "meta.json").write_text(json.dumps({"identity": {}, "files": files}))
        return precompute_reference(PreferenceLM, cfg, index)

    whole = {"train": {"file": "train.npz", "sha256": "1" * 64}, "val": entry}
    assert found(whole) == ({"folder": folder, **whole}, False)
    for bad in ({"train": {"file": "../../../outside.npz", "sha256": "1" * 64}, "val": entry},
                {"train": {"file": "sub/train.npz", "sha256": "1" * 64}, "val": entry},
                {"train": {"file": str(tmp_path / "outside.npz"), "sha256": "1" * 64}, "val": entry},
                {**whole, "folder": str(tmp_path)}, {"train": whole["train"]}, ["train.npz"]):
        with pytest.raises(DataError, match=re.escape(f"{folder}/meta.json is not a DPO")):
            found(bad)
    (tmp_path / folder / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="meta.json is not a DPO reference's table"):
        precompute_reference(PreferenceLM, cfg, index)


def test_the_starting_weights_are_held_in_model_dtype_as_the_policy_is():
    """The reference (a copy, or the pass's model) in model.dtype, as the loop holds the policy: a checkpoint's
    stored dtype (from_pretrained keeps it) would score the pairs otherwise than the step-0 policy."""
    sizes = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    for dtype, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        task = _task(model_keys={"hf_config": sizes, "dtype": dtype})
        assert {p.dtype for p in task.starting_model().parameters()} == {expected}


def test_with_lora_the_reference_is_the_model_with_its_adapters_off():
    pytest.importorskip("peft")
    from behemoth.models.lora import add_adapters

    lora = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = add_adapters(_tiny_llama(0), lora, "CAUSAL_LM")
    for name, p in model.named_parameters():  # adapters that change the outputs (peft starts B at zero)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    task = _task(model_keys={"lora": {"r": 4}})
    stored = _block([([5, 6, 7], [8, 9], [10, 11, 12])], 24)[None]
    with torch.no_grad():
        reference = task._reference_logps(model, stored, "train", None)
        with model.disable_adapter():
            base = sequence_logps(model(input_ids=stored & 0xFFFF).logits, stored)
        adapted = sequence_logps(model(input_ids=stored & 0xFFFF).logits, stored)
    # the chosen reply, the row's first document: its log-probabilities need no document mask to compare
    assert torch.allclose(reference[0], base[0], atol=1e-4) and task._reference is None  # (no copy was made)
    assert not torch.allclose(reference[0], adapted[0], atol=1e-3)


def test_config_names_what_a_preference_run_cannot_take(corpus):
    with pytest.raises(ConfigError, match="data.messages_field is for data.kind chat"):
        _data(corpus, messages_field="conversation")
    with pytest.raises(ConfigError, match="data.beta must be > 0"):
        _data(corpus, beta=0.0)
    base = {"data": {"kind": "preference", "train_files": ["x.jsonl"], "val_fraction": 0.1, "tokenizer": "t"},
            "model": {"name": "causal_lm", "hf_config": {"model_type": "llama"}, "lora": {"r": 4}},
            "train": {"init_from": "runs/sft"}}
    with pytest.raises(ConfigError, match="name the SFT model as model.pretrained"):
        PreferenceLM.check_model(config_from_dict(base))


def test_a_prompts_pairs_fall_on_one_side_of_the_validation_split(corpus):
    """data.val_fraction splits pairs by their prompt (explicit, or the messages both replies open with), not by
    the whole record: 40 prompts with 4 pairs each (UltraFeedback's completions paired every way) put each
    prompt's 4 on one side, where a split by record scored validation on prompts trained on (~all 40 were on both
    sides at 0.5)."""
    from behemoth.data.chat.chat import Record
    from behemoth.data.chat.chat_packing import ChatSpec, encode_records

    cfg = _data(corpus, train_files=[], val_files=[], hf_dataset="unused", val_fraction=0.5)
    tok = chat_tokenizer(cfg)
    spec = ChatSpec(render=RenderSpec.of(tok), window=Window.of(tok, "assistant", cfg.seq_len), seed=3,
                    val_fraction=0.5, pairs=cfg.pair_fields())
    records, prompts = [], []
    for p in range(40):
        prompt = [{"role": "user", "content": f"Who found key {p}?"}]
        for r in range(4):
            reply = [{"role": "assistant", "content": f"Ada found key {p}, take {r}."}]
            other = [{"role": "assistant", "content": f"Boris found map {p}, take {r}."}]
            # half with the prompt as its own field, half HH's way: the prompt opens both conversations
            value = ({"prompt": prompt, "chosen": reply, "rejected": other} if r % 2 else
                     {"chosen": prompt + reply, "rejected": prompt + other})
            records.append(Record("pairs.jsonl", len(records) + 1, value))
            prompts.append(p)
    splits = encode_records(records, "auto", spec).column("split").to_pylist()
    sides = {p: {s for s, q in zip(splits, prompts) if q == p} for p in range(40)}
    assert all(len(s) == 1 for s in sides.values()), sides
    assert 8 <= sum(s == {"val"} for s in sides.values()) <= 32  # (both sides used)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_the_policy_trains_without_dropout_as_its_reference_is_scored(model_type):
    """The reference's log-probabilities are taken without dropout (eval mode, or precomputed so); the policy,
    trained in training mode, had its dropout on (GPT-2's 0.1, Llama's attention_dropout): its step-0
    log-ratio to the reference was noise, not 0. Off, as TRL's disable_dropout (its default) does: in training
    mode the policy's logits equal the reference's at the start."""
    sizes = ({"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64, "resid_pdrop": 0.3, "embd_pdrop": 0.3,
              "attn_pdrop": 0.3} if model_type == "gpt2" else
             {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "attention_dropout": 0.3})
    task = _task(model_keys={"hf_config": {"model_type": model_type, **sizes}})
    torch.manual_seed(task.cfg.train.seed)  # (the seed starting_model builds the reference from)
    policy = task.build_model().train()
    reference = task.starting_model().eval()
    stored = torch.randint(2, 64, (2, 49))
    with torch.no_grad():
        torch.testing.assert_close(policy(input_ids=stored).logits, reference(input_ids=stored).logits)
