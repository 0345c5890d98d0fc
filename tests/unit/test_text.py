"""Text sources, tokenisation and packing without Ray: the functions the Ray Data tasks run, run in order."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from behemoth.data.text.text import TextData
from behemoth.errors import ConfigError, DataError
from behemoth.data.text import text
from behemoth.data.order import rank_train_indices, steps_per_epoch
from behemoth.data.text.text_packing import Packer
from behemoth.data.text.text import (
    TokenizerSpec,
    Unit,
    load_tokenizer,
    plan_units,
    read_unit_documents,
    tokenize_units,
)


def text_cfg(corpus, **kw) -> TextData:
    base = dict(kind="text", train_files=[str(corpus / "train.jsonl")], val_files=[str(corpus / "val.jsonl")],
                tokenizer=str(corpus / "tokenizer"), seq_len=32)
    return TextData(**{**base, **kw})


def pack_without_ray(cfg: TextData, seed: int = 0) -> dict:
    """What prepare_text builds, with the Ray Data step replaced by calling its UDF on each unit in order."""
    packers = {"train": Packer(cfg.seq_len), "val": Packer(cfg.seq_len)}
    for unit in plan_units(cfg):
        batch = pa.Table.from_pylist([unit.__dict__])
        out = tokenize_units(batch, text_field=cfg.text_field, tokenizer=TokenizerSpec.of(cfg.tokenizer), seed=seed,
                             val_fraction=cfg.val_fraction)
        for split, tokens, docs in zip(out["split"].to_pylist(), out["tokens"].to_pylist(),
                                       out["documents"].to_pylist()):
            packers[split].add(np.asarray(tokens, dtype=np.int32), docs)
    return {s: p.finish() for s, p in packers.items()}


def reference_stream(path, field, tokenizer) -> tuple[np.ndarray, int]:
    """The corpus tokenised one document at a time, each followed by EOS: what the blocks must hold."""
    tok = load_tokenizer(tokenizer)
    docs = [json.loads(line)[field] for line in open(path, encoding="utf-8") if line.strip()]
    ids = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    return np.asarray(ids), len(docs)


def test_packing_is_exact_across_unit_boundaries(text_corpus, monkeypatch):
    monkeypatch.setattr(text, "UNIT_BYTES", 997)  # many units; lines cross their boundaries
    cfg = text_cfg(text_corpus)
    assert len(plan_units(cfg)) > 40
    packed = pack_without_ray(cfg)
    for split in ("train", "val"):
        stream, n_docs = reference_stream(text_corpus / f"{split}.jsonl", "text", cfg.tokenizer)
        blocks, counts = packed[split]
        assert blocks.shape == (len(stream) // 32, 32)  # block count as computed
        assert counts == {"documents": n_docs, "tokens": len(stream), "blocks": len(stream) // 32,
                          "tail_tokens_dropped": len(stream) % 32}
        # every token of the corpus exactly once, in order, except the final partial block
        np.testing.assert_array_equal(blocks.reshape(-1), stream[: blocks.size])
        eos = load_tokenizer(cfg.tokenizer).eos_token_id
        assert (stream == eos).sum() == n_docs  # one EOS after each document, no other


def test_documents_are_separated_by_eos(text_corpus):
    cfg = text_cfg(text_corpus)
    blocks, _ = pack_without_ray(cfg)["val"]
    tok = load_tokenizer(cfg.tokenizer)
    decoded = tok.decode(blocks.reshape(-1).tolist())
    docs = decoded.split(tok.eos_token)
    first = json.loads(open(text_corpus / "val.jsonl").readline())["text"]
    assert docs[0] == first and len(docs) > 10


def _tokenizer_starting_with_bos(corpus, folder):
    """The corpus's tokenizer with a BOS its encoding starts every text with, as Llama's and Mistral's do."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer.from_file(str(corpus / "tokenizer" / "tokenizer.json"))
    core.add_special_tokens(["<s>"])
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", core.token_to_id("<s>"))])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="<|endoftext|>").save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("starts_with_bos", [False, True])
def test_each_document_is_what_its_tokenizer_makes_of_its_text(tmp_path, text_corpus, starts_with_bos):
    """A tokenizer that starts a text with BOS (Llama's): no block held one, while `generate` put one before
    every prompt. Text that spells a special token ("<|endoftext|>" in a web page) became that token (an EOS,
    with data.document_mask a document's end, mid-document). An empty JSONL text made a document of an EOS."""
    tokenizer = _tokenizer_starting_with_bos(text_corpus, tmp_path / "tok") if starts_with_bos else \
        str(text_corpus / "tokenizer")
    docs = ["the fox ran home", "", "   ", "a <|endoftext|> b"]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = text_cfg(text_corpus, train_files=[str(tmp_path / "t.jsonl")], val_files=[str(tmp_path / "t.jsonl")],
                   tokenizer=tokenizer, seq_len=1)  # (blocks of one token: the whole stream, no tail)
    blocks, counts = pack_without_ray(cfg)["train"]
    tok = load_tokenizer(tokenizer)
    stream = blocks.reshape(-1).tolist()
    assert counts["documents"] == 2 and stream.count(tok.eos_token_id) == 2
    bos = [tok.bos_token_id] if starts_with_bos else []
    expected = [*bos, *tok("the fox ran home", add_special_tokens=False)["input_ids"], tok.eos_token_id,
                *bos, *tok("a <|endoftext|> b", add_special_tokens=False, split_special_tokens=True)["input_ids"],
                tok.eos_token_id]
    assert stream == expected
    # what generate starts a prompt with, and the blocks now too
    assert (tok("x")["input_ids"][0] == tok.bos_token_id) == starts_with_bos


def test_workers_shards_cover_each_block_once_per_epoch():
    blocks, global_batch, world = 1001, 16, 2
    steps = steps_per_epoch(blocks, global_batch)
    for epoch in range(2):
        shards = [rank_train_indices(blocks, global_batch, 0, epoch, rank, world) for rank in range(world)]
        seen = np.concatenate(shards)
        assert len(seen) == len(np.unique(seen)) == steps * global_batch  # disjoint, none repeated
        assert len(set(range(blocks)) - set(seen)) == blocks % global_batch  # only the epoch's tail left out


def test_jsonl_with_another_field_name(tmp_path, text_corpus):
    src = tmp_path / "notes.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "body": f"note number {i} says hello"}) for i in range(50)))
    cfg = text_cfg(text_corpus, train_files=[str(src)], val_files=[], val_fraction=0.2, text_field="body")
    packed = pack_without_ray(cfg)
    assert packed["train"][1]["documents"] + packed["val"][1]["documents"] == 50
    assert 0 < packed["val"][1]["documents"] < 25
    with pytest.raises(DataError, match=rf"{src} line 1: no field 'text' \(data.text_field\); the record has "
                                        r"\['body', 'id'\]"):
        pack_without_ray(text_cfg(text_corpus, train_files=[str(src)], val_files=[], val_fraction=0.2))


def test_txt_lines_files_and_parquet(tmp_path, text_corpus):
    (tmp_path / "a.txt").write_text("first line\n\n  \nsecond line\n")
    (tmp_path / "b.txt").write_text("a whole file\nof two lines")
    pq.write_table(pa.table({"text": ["one", "", "two"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    read = lambda **kw: [d for u in plan_units(text_cfg(text_corpus, **kw)) for d in read_unit_documents(u, "text")]
    assert read(train_files=[str(tmp_path / "a.txt")], val_files=[str(tmp_path / "b.txt")]) == \
        ["first line", "second line", "a whole file", "of two lines"]
    assert read(train_files=[str(tmp_path / "b.txt")], document="file", val_fraction=0.5, val_files=[]) == \
        ["a whole file\nof two lines"]
    assert read(train_files=[str(tmp_path / "c.parquet")], val_files=[str(tmp_path / "c.parquet")]) == \
        ["one", "two", "one", "two"]


def test_invalid_utf8_names_file_and_line(tmp_path, text_corpus):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("good line\nanother\ncaf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=rf"{bad}: invalid UTF-8 at line 3 \(byte 21\).*iconv"):
        plan_units(text_cfg(text_corpus, train_files=[str(bad)]))  # the driver reads every file's first records
    with pytest.raises(DataError, match=rf"{bad}: invalid UTF-8 at line 3 \(byte 21\).*iconv"):
        read_unit_documents(Unit("train", str(bad), "txt", 0, bad.stat().st_size), "text")  # and so does a task


def test_empty_file_and_parquet_without_column_fail_on_the_driver(tmp_path, text_corpus):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"{empty} is empty"):
        plan_units(text_cfg(text_corpus, val_files=[str(empty)]))
    table = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"content": ["x"]}), table)
    with pytest.raises(DataError, match=rf"{table} has no column 'text' \(data.text_field\); its columns: "
                                        r"\['content'\]"):
        plan_units(text_cfg(text_corpus, train_files=[str(table)]))
    with pytest.raises(DataError, match="matches no file"):
        plan_units(text_cfg(text_corpus, train_files=[str(tmp_path / "missing.jsonl")]))


def test_bad_jsonl_line_is_named(tmp_path, text_corpus):
    src = tmp_path / "broken.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": "cut off\n')
    with pytest.raises(DataError, match=rf"{src} line 3: not valid JSON"):
        plan_units(text_cfg(text_corpus, train_files=[str(src)]))  # the driver reads every file's first records
    with pytest.raises(DataError, match=rf"{src} line 3: not valid JSON"):
        read_unit_documents(Unit("train", str(src), "jsonl", 0, src.stat().st_size), "text")  # and so does a task


def test_tokenizer_round_trip_and_eos(text_corpus):
    tok = load_tokenizer(str(text_corpus / "tokenizer"))
    sentence = "One morning Ada went to the market. Zürich!"  # unseen characters still encode (byte-level)
    assert tok.decode(tok(sentence, add_special_tokens=False)["input_ids"]) == sentence
    assert tok.eos_token == "<|endoftext|>" and 300 < len(tok) <= 400


def test_missing_tokenizer_is_a_data_error(tmp_path, text_corpus):
    with pytest.raises(DataError, match="data.tokenizer .*cannot be loaded.*train-tokenizer"):
        load_tokenizer(str(tmp_path / "no_tokenizer"))


@pytest.mark.parametrize("loader", ["load_tokenizer", "load_classification_tokenizer"])
def test_a_tokenizer_asking_to_run_its_own_code_is_refused_without_asking(tmp_path, capfd, loader):
    """A tokenizer folder whose config names its own class (auto_map, as a received checkpoint's tokenizer may):
    one DataError naming it, never transformers' terminal prompt to run the code (which waits for an answer)."""
    import json

    from behemoth.data.text import labelled_text, text
    from behemoth.data.tokenizer import train_tokenizer
    from behemoth.errors import DataError

    (tmp_path / "c.txt").write_text("hello world\n" * 100)
    train_tokenizer([str(tmp_path / "c.txt")], tmp_path / "tok", vocab_size=300)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTok", auto_map={"AutoTokenizer": ["my_tok.MyTok", "my_tok.MyTok"]})
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tok" / "my_tok.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    load = getattr(text if loader == "load_tokenizer" else labelled_text, loader)
    with pytest.raises(DataError, match="contains custom code"):
        load(str(tmp_path / "tok"))
    out, err = capfd.readouterr()
    assert "Do you wish to run the custom code" not in out + err and not (tmp_path / "ran").exists()


def test_text_cache_builders_with_one_pid_on_two_hosts_keep_their_own_temporary_folders(tmp_path, monkeypatch):
    """A token cache on a shared filesystem: a builder on another node with the same pid (containers) is half-way;
    this one builds beside it and leaves its folder alone (before, both were `<key>.tmp-<pid>` and the second
    began by removing it)."""
    import os

    from behemoth.data.text import text_packing

    cache = tmp_path / "cache" / "abc123"
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    theirs = cache.with_name(f"{cache.name}.tmp-4242")  # the other node's, as the old name had it
    theirs.mkdir(parents=True)
    (theirs / "train-00000.bin").write_bytes(b"half-written")
    text_packing._build_cache(None, [], 0, "uint16", cache, lambda folder, *args: {"version": text_packing.CACHE_VERSION})
    assert (cache / "meta.json").is_file()
    assert (theirs / "train-00000.bin").read_bytes() == b"half-written"


def _tiny_llama(implementation: str = "sdpa", positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions)
    config._attn_implementation = implementation
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_document_in_a_packed_block_sees_only_itself_with_document_mask(implementation):
    """data.document_mask (issue 58): in a block packing document A (ending in EOS) then document B, B's logits
    equal B's alone (positions restart, nothing of A attended), and the loss is the two documents' own losses
    weighted by their predicted tokens (A's last token is not trained to predict B's first). Without the mask
    B's logits depend on A."""
    from types import SimpleNamespace

    from behemoth.tasks.causal_lm import CausalLM

    eos = 1
    a, b = [5, 6, 7, 8, eos], [9, 10, 11, 12, 13, eos]
    block = torch.tensor([a + b])
    task = object.__new__(CausalLM)
    task.cfg, task.index, task.transformers_model = SimpleNamespace(data=SimpleNamespace(document_mask=True)), \
        SimpleNamespace(eos_id=eos), True
    model = _tiny_llama(implementation)
    with torch.no_grad():
        starts = torch.tensor([[False] * len(a) + [True] + [False] * (len(b) - 1)])
        inputs = task.document_inputs(model, block, starts, block.masked_fill(starts, -100))
        assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]
        masked = model(input_ids=block, **{k: v for k, v in inputs.items() if k != "labels"}).logits
        alone = model(input_ids=torch.tensor([b])).logits
        assert torch.allclose(masked[0, len(a):], alone[0], atol=1e-5)
        plain = model(input_ids=block).logits
        assert not torch.allclose(plain[0, len(a):], alone[0], atol=1e-3)
        loss = task._mean_loss(model, block)
        loss_a = model(input_ids=torch.tensor([a]), labels=torch.tensor([a])).loss
        loss_b = model(input_ids=torch.tensor([b]), labels=torch.tensor([b])).loss
        assert loss.item() == pytest.approx(((4 * loss_a + 5 * loss_b) / 9).item(), rel=1e-5)
        sums = task.eval_sums(model, {"input_ids": block})
        assert sums["tokens"].item() == 9 and sums["loss"].item() == pytest.approx(9 * loss.item(), rel=1e-6)


def test_with_document_mask_the_step_is_a_mean_over_its_predicted_tokens_not_of_micro_batch_means():
    """data.document_mask leaves out a document's first token: a micro-batch of many short documents predicts
    fewer tokens than one of a single document. Every micro-batch weighed 1/n, so the accumulated gradient (and
    the reported loss) was a mean of micro-batch means; now it is the mean over the step's predicted tokens, as
    one batch of both rows gives it."""
    from types import SimpleNamespace

    from behemoth.tasks.causal_lm import CausalLM
    from behemoth.worker.loop import loss_weights

    eos = 1
    torch.manual_seed(0)
    rows = torch.randint(2, 50, (2, 16))
    rows[0, 1::2] = eos  # row 0: eight 2-token documents, 8 tokens predicted; row 1: one document, 15
    task = object.__new__(CausalLM)
    task.cfg, task.index, task.transformers_model = SimpleNamespace(data=SimpleNamespace(document_mask=True)), \
        SimpleNamespace(eos_id=eos), True
    model = _tiny_llama("sdpa").train()
    batches = [{"input_ids": rows[i:i + 1]} for i in range(2)]
    weights = loss_weights(task, batches)
    assert [float(task.loss_items(b)) for b in batches] == [8, 15]
    reported = 0.0
    for batch, weight in zip(batches, weights):
        loss, count = task.loss(model, batch)
        (loss * weight).backward()
        reported += float(loss) * float(count)
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole, count = task.loss(model, {"input_ids": rows})
    whole.backward()
    assert float(count) == 23 and reported / 23 == pytest.approx(float(whole), rel=1e-5)
    for got, want in zip(accumulated, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def _flex_against_dense(device: str, backward: bool) -> None:
    """FlexAttention with the block mask of a batch's packed documents against SDPA with the dense mask: the mask
    function element for element, then the logits, loss (and the gradients where `backward`)."""
    from types import SimpleNamespace

    from torch.nn.attention.flex_attention import BlockMask, create_mask

    from behemoth.tasks.causal_lm import CausalLM, document_block_mask

    eos = 1
    torch.manual_seed(1)
    block = torch.randint(2, 50, (2, 300))  # (3 blocks of 128, the last cut short)
    block[0, [7, 20, 21, 40]] = eos  # documents of 8, 13, 1, 19 and 259 tokens in row 0; row 1 one document
    block = block.to(device)
    task = object.__new__(CausalLM)
    task.cfg, task.index, task.transformers_model = SimpleNamespace(data=SimpleNamespace(document_mask=True)), \
        SimpleNamespace(eos_id=eos), True
    starts = torch.zeros_like(block, dtype=torch.bool)
    starts[:, 1:] = block[:, :-1] == eos
    mask = document_block_mask(starts.cumsum(dim=1))
    assert isinstance(mask, BlockMask) and mask.shape == (2, 1, 300, 300) and mask.full_kv_num_blocks.sum() > 0
    assert mask.kv_indices.shape == (2, 1, 3, 3)  # (300 / 128 blocks a side, not 300 x 300)
    dense = task.document_inputs(_tiny_llama("sdpa", 512).to(device), block, starts, block)["attention_mask"]
    assert torch.equal(create_mask(mask.mask_mod, 2, 1, 300, 300, device=device), dense)
    outs = []
    for implementation in ("sdpa", "flex_attention"):
        model = _tiny_llama(implementation, 512).to(device).train()
        inputs = task.document_inputs(model, block, starts, block.masked_fill(starts, -100))
        assert isinstance(inputs["attention_mask"], BlockMask) == (implementation == "flex_attention")
        with torch.set_grad_enabled(backward):
            out = model(input_ids=block, use_cache=False, **inputs)
        if backward:
            out.loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()]) if backward else None
        outs.append((out.logits.detach(), out.loss.detach(), grad))
    (logits, loss, grad), (flex_logits, flex_loss, flex_grad) = outs
    assert torch.allclose(flex_logits, logits, atol=1e-5) and torch.allclose(flex_loss, loss, atol=1e-6)
    if backward:
        assert torch.allclose(flex_grad, grad, atol=1e-5)


def test_flash_attention_gets_every_documents_bounds_over_a_micro_batch_of_several_rows():
    """Flash attention (a GPU's attn_implementation flash_attention_*): transformers infers packed documents from the
    position ids only for a batch of one row (modeling_flash_attention_utils._is_packed_sequence), so with two rows
    each row would be one causal sequence and its documents would attend to each other. document_inputs hands it
    the documents' cumulative lengths over the flattened micro-batch (its padding-free path): the bounds of every
    document of every row, the rows' ends among them. (No flash kernel on a CPU: the kwargs are what is checked.)"""
    from types import SimpleNamespace

    from behemoth.tasks.causal_lm import CausalLM

    ids = torch.arange(12).reshape(2, 6)
    starts = torch.tensor([[True, False, False, True, False, False], [True, False, True, False, False, False]])
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    inputs = CausalLM.document_inputs(model, ids, starts, ids)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]]
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 3, 6, 8, 12]
    assert int(inputs["max_length_q"]) == int(inputs["max_length_k"]) == 4


def test_flex_attentions_block_mask_of_packed_documents_matches_the_dense_mask(monkeypatch):
    """Issue 74 item 2: FlexAttention with the block mask of the packed documents (causal within a document,
    never across) gives the dense SDPA mask's logits and loss; the block mask is (L / 128)^2 blocks, not L x L.
    Forward only: torch has no FlexAttention backward on a CPU (the GPU test below takes the gradients, with
    the compiled kernel), which is also why a CPU keeps the dense mask. Here FlexAttention runs eagerly: the
    compile transformers asks for takes ~20 s on a CPU, and the kernel is torch's."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex_attention(query, key, value, **kwargs))
    _flex_against_dense("cpu", backward=False)


@pytest.mark.parametrize("length", [640, 600])
def test_the_document_block_mask_is_what_flex_attention_would_build_from_the_whole_mask(length):
    """document_block_mask builds its blocks from each block's first and last document, never the L x L mask:
    the same partial and whole blocks as create_block_mask evaluating the mask at every position pair, for
    documents shorter than a block, spanning many blocks (whole blocks), and a last block cut short."""
    from torch.nn.attention.flex_attention import create_block_mask

    from behemoth.tasks.causal_lm import document_block_mask

    gen = torch.Generator().manual_seed(3)
    starts = torch.rand(3, length, generator=gen) < torch.tensor([[0.02], [0.005], [0.0]])
    starts[0, 300:] = False  # (row 0: short documents, then one over the last blocks)
    document = starts.cumsum(dim=1)
    ours = document_block_mask(document)
    want = create_block_mask(ours.mask_mod, 3, None, length, length, device="cpu")
    assert torch.equal(ours.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, want.full_kv_num_blocks) and ours.full_kv_num_blocks.sum() > 0
    for mine, theirs, counts in ((ours.kv_indices, want.kv_indices, want.kv_num_blocks),
                                 (ours.full_kv_indices, want.full_kv_indices, want.full_kv_num_blocks)):
        for b in range(3):
            for i in range(counts.shape[-1]):
                k = int(counts[b, 0, i])
                assert set(mine[b, 0, i, :k].tolist()) == set(theirs[b, 0, i, :k].tolist()), (b, i)
    assert torch.equal(ours.to_dense(), want.to_dense())


@pytest.mark.gpu
def test_flex_attentions_block_mask_gives_the_dense_masks_gradients_on_a_gpu():
    _flex_against_dense("cuda", backward=True)


@pytest.mark.gpu
def test_flash_attention_keeps_each_document_of_a_two_row_micro_batch_to_itself_on_a_gpu():
    """The kwargs of test_flash_attention_gets_every_documents_bounds... through the real kernel: with two rows of
    packed documents, each document's logits are its own alone (bf16 tolerance). Skipped without flash-attn."""
    pytest.importorskip("flash_attn")
    from types import SimpleNamespace

    from behemoth.tasks.causal_lm import CausalLM

    model = _tiny_llama("flash_attention_2").to("cuda", torch.bfloat16)
    docs = [[5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15, 16]]
    ids = torch.tensor([docs[0] + docs[1], docs[2] + docs[3]], device="cuda")
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[0, [0, 3]] = starts[1, [0, 2]] = True
    inputs = CausalLM.document_inputs(SimpleNamespace(config=model.config), ids, starts, ids)
    inputs.pop("labels")
    with torch.no_grad():
        packed = model(input_ids=ids, **inputs).logits.float()
        for row, begin, doc in ((0, 0, docs[0]), (0, 3, docs[1]), (1, 0, docs[2]), (1, 2, docs[3])):
            alone = model(input_ids=torch.tensor([doc], device="cuda")).logits.float()[0]
            assert torch.allclose(packed[row, begin:begin + len(doc)], alone, atol=3e-2), (row, begin)


def test_the_document_attention_switch_takes_flex_on_a_gpu_unless_the_job_chose():
    """train_on_document_attention (what build_lm calls for a document-masked run): FlexAttention where the model
    had plain SDPA on a GPU and the job named no attn_implementation; left as it is on a CPU, where the job chose,
    and for other kernels."""
    from behemoth.models.causal_lm import train_on_document_attention

    model = _tiny_llama("sdpa")
    assert train_on_document_attention(model, "cpu", chosen=False) is None
    assert train_on_document_attention(model, "cuda", chosen=True) is None
    assert model.config._attn_implementation == "sdpa"
    said = train_on_document_attention(model, "cuda", chosen=False)
    assert "FlexAttention" in said and model.config._attn_implementation == "flex_attention"
    assert train_on_document_attention(_tiny_llama("eager"), "cuda", chosen=False) is None


def tiny_lm(vocab_size: int) -> torch.nn.Module:
    """A user's own language model by import path (unit.test_text:tiny_lm): called with the tokens alone."""
    return torch.nn.Embedding(vocab_size, vocab_size)


def test_document_mask_needs_a_transformers_model(tmp_path):
    from behemoth.job import config_from_dict

    job = {"data": {"kind": "text", "train_files": [str(tmp_path / "t.txt")], "val_fraction": 0.1,
                    "tokenizer": str(tmp_path), "document_mask": True},
           "model": {"name": "unit.test_text:tiny_lm"}}
    with pytest.raises(ConfigError, match="data.document_mask needs a transformers model"):
        config_from_dict(job)


def test_a_double_star_glob_finds_files_at_any_depth(tmp_path):
    """`data.train_files: [corpus/**/*.jsonl]` read one folder level (glob without recursive): two of three files
    left out without a word."""
    from behemoth.data.pipeline import expand_files

    for name in ("a.jsonl", "sub/b.jsonl", "sub/deeper/c.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    found = expand_files([f"{tmp_path}/**/*.jsonl"], "data.train_files")
    assert [f[len(str(tmp_path)) + 1:] for f in found] == ["a.jsonl", "sub/b.jsonl", "sub/deeper/c.jsonl"]
