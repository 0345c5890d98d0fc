"""Benchmark: what templating and assistant-only masking cost chat data, against plain text packing of the same
conversations (issue 66).

The same generated conversations go two ways, alternating, `--repeats` times after a warm-up of each:
- chat (data.kind chat): Ray Data tasks render each conversation with the tokenizer's chat template
  (`apply_chat_template`, once for the whole and twice per assistant turn to find its tokens), set the flags, and
  the driver packs whole conversations into blocks (first fit);
- text (data.kind text): the conversations already rendered with the template, written as one text document each,
  tokenised by the fast tokenizer's Rust core in the same Ray Data tasks and cut into blocks.
Printed: tokens/s of each preparation (once per corpus: the result is cached), and of the workers' side, which
runs every step: a batch gathered from the token store and turned into the model's inputs (ids, positions, the
document mask, labels) — chat from its flags, text with data.document_mask from its EOS tokens.

    .venv/bin/python bench/chat_pipeline.py [--conversations 20000] [--repeats 3] [--cpus 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def prepare(kind: str, corpus: Path, tokenizer: str, seq_len: int, work: Path, cpus_per_task: float):
    from behemoth.data.chat.chat import ChatData
    from behemoth.data.chat.chat_packing import prepare_chat
    from behemoth.data.chat.chat_sources import plan_chat_units
    from behemoth.data.text.text import TextData
    from behemoth.data.text.text_packing import prepare_text

    cache = work / f"cache-{kind}"
    shutil.rmtree(cache, ignore_errors=True)
    common = {"tokenizer": tokenizer, "seq_len": seq_len, "cache_dir": str(cache), "cpus_per_task": cpus_per_task}
    if kind == "chat":
        cfg = ChatData(kind="chat", train_files=[str(corpus / "train.jsonl")], val_files=[str(corpus / "val.jsonl")],
                       **common)
        return prepare_chat(cfg, seed=0, units=plan_chat_units(cfg))
    cfg = TextData(kind="text", train_files=[str(corpus / "text_train.jsonl")],
                   val_files=[str(corpus / "text_val.jsonl")], document_mask=True, **common)
    return prepare_text(cfg, seed=0)


def feed_rate(kind: str, index, batch: int, seconds: float) -> float:
    """Tokens/s of model inputs made from the store's blocks, as a worker makes them each step (on this CPU)."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from behemoth.data.chat.chat import split_flags
    from behemoth.tasks.causal_lm import CausalLM, gather_batch

    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    rng = np.random.default_rng(0)
    tokens, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        stored = gather_batch(index.train, rng.integers(0, len(index.train), batch))["input_ids"]
        if kind == "chat":
            ids, trained, starts = split_flags(stored)
            labels = ids.masked_fill(~trained | starts, -100)
        else:
            ids = stored
            starts = torch.zeros_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, :-1] == index.eos_id
            labels = ids.masked_fill(starts, -100)
        CausalLM.document_inputs(model, ids, starts, labels)
        tokens += ids.numel()
    return tokens / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="blocks per batch on the workers' side")
    args = parser.parse_args()

    import ray
    from behemoth.data.text.synth_text import write_synth_chat
    from behemoth.data.tokenizer import train_tokenizer
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    corpus = work / "corpus"
    write_synth_chat(corpus, train_documents=args.conversations, val_documents=max(args.conversations // 20, 50))
    tokenizer = str(work / "tokenizer")
    train_tokenizer([str(corpus / "train.jsonl")], tokenizer, vocab_size=2048, chat=True)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    for split in ("train", "val"):  # the same conversations, rendered, as text documents
        with open(corpus / f"text_{split}.jsonl", "w") as out:
            for line in (corpus / f"{split}.jsonl").read_text().splitlines():
                text = tok.apply_chat_template(json.loads(line)["messages"], tokenize=False)
                out.write(json.dumps({"text": text}) + "\n")
    print(f"{args.conversations} conversations; {args.cpus} CPUs; seq_len {args.seq_len}")
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="error")

    made = {}
    for kind in ("chat", "text"):  # warm-up: imports, Ray worker processes
        made[kind] = prepare(kind, corpus, tokenizer, args.seq_len, work, 1.0)
    rates = {"chat": [], "text": []}
    feeds = {"chat": [], "text": []}
    for r in range(args.repeats):
        for kind in ("chat", "text"):
            t0 = time.perf_counter()
            index = prepare(kind, corpus, tokenizer, args.seq_len, work, 1.0)
            seconds = time.perf_counter() - t0
            # the tokens the conversations hold (chat: without its padding; text: in its blocks)
            tokens = (index.stats["train"]["tokens"] + index.stats["val"]["tokens"])
            rates[kind].append(tokens / seconds)
            feeds[kind].append(feed_rate(kind, index, args.batch, 3.0))
            print(f"  repeat {r}: {kind}: prepared {tokens} tokens in {seconds:.2f} s = {tokens / seconds / 1e3:.0f} "
                  f"k tokens/s; inputs made at {feeds[kind][-1] / 1e6:.1f} M tokens/s", flush=True)
    padding = made["chat"].stats["train"]["padding_tokens"] / (made["chat"].train.shape[0] * args.seq_len)
    for name, values in (("preparation", rates), ("workers' inputs", feeds)):
        ratios = [c / t for c, t in zip(values["chat"], values["text"])]
        print(f"{name}: chat {statistics.median(values['chat']) / 1e3:,.0f} k tokens/s, text "
              f"{statistics.median(values['text']) / 1e3:,.0f} k tokens/s; ratio chat / text median "
              f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    print(f"chat blocks: {100 * padding:.1f} % padding (whole conversations, first fit); trained tokens "
          f"{made['chat'].stats['train']['trained_tokens']} of {made['chat'].stats['train']['tokens']}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
