"""Benchmark: tokens/s of behemoth's tokenise + pack pipeline (Ray Data) vs Hugging Face `datasets`.

Baseline: what a user would otherwise write (transformers' run_clm recipe): `Dataset.map(tokenize,
batched=True, num_proc=N)` then `Dataset.map(group_texts, batched=True, num_proc=N)`, with the same fast
tokenizer on the same JSONL corpus. Both sides add EOS after each document; datasets' group_texts drops each
map batch's remainder, behemoth packs one continuous stream (so it keeps slightly more tokens).

Both run in this one process, alternating, `--repeats` times after a warm-up of each; the median ratio is
printed. Ray is started once (as a run starts it once); its worker processes are warm after the warm-up.
datasets forks its process pool per map call, as it does for a user. Caches are off on both sides
(behemoth gets a fresh cache folder per repeat; datasets gets a fresh cache folder per repeat for
load_dataset's JSON-to-Arrow conversion, and runs its maps with caching disabled).

    .venv/bin/python bench/tokenize_pack.py [--documents 60000] [--repeats 5] [--cpus 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def run_behemoth(corpus: Path, tokenizer: str, seq_len: int, workdir: Path, cpus: int) -> int:
    from behemoth.data.text.text import TextData
    from behemoth.data.text.text_packing import prepare_text

    cache = workdir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cfg = TextData(kind="text", train_files=[str(corpus / "train.jsonl")], val_files=[str(corpus / "val.jsonl")],
                     tokenizer=tokenizer, seq_len=seq_len, cache_dir=str(cache), cpus_per_task=1.0)
    tokens = prepare_text(cfg, seed=0)
    return tokens.train.size + tokens.val.size


def run_datasets(corpus: Path, tokenizer: str, seq_len: int, num_proc: int) -> int:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cache = tempfile.mkdtemp(prefix="hf-cache-")  # fresh: load_dataset would reuse its Arrow conversion
    try:
        raw = datasets.load_dataset("json", data_files={"train": str(corpus / "train.jsonl"),
                                                       "validation": str(corpus / "val.jsonl")}, cache_dir=cache)
        return _tokenize_and_pack(raw, tok, seq_len, num_proc)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _tokenize_and_pack(raw, tok, seq_len: int, num_proc: int) -> int:
    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [tok.eos_token_id] for x in ids]}

    def group_texts(batch):  # transformers/examples/pytorch/language-modeling/run_clm.py
        joined = [t for ids in batch["input_ids"] for t in ids]
        total = len(joined) // seq_len * seq_len
        return {"input_ids": [joined[i:i + seq_len] for i in range(0, total, seq_len)]}

    tokenized = raw.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"])
    packed = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    return sum(len(packed[s]) * seq_len for s in packed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=60000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    import datasets
    import ray

    from behemoth.data.text.synth_text import write_synth_text
    from behemoth.data.tokenizer import train_tokenizer

    datasets.disable_caching()
    datasets.disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="bench-tok-"))
    corpus = work / "corpus"
    write_synth_text(corpus, train_documents=args.documents, val_documents=args.documents // 20)
    tokenizer = str(work / "tokenizer")
    train_tokenizer([str(corpus / "train.jsonl")], tokenizer, vocab_size=2048)
    size_mb = sum(p.stat().st_size for p in corpus.iterdir()) / 1e6
    print(f"corpus: {args.documents} + {args.documents // 20} documents, {size_mb:.1f} MB of JSONL; "
          f"{args.cpus} CPUs, seq_len {args.seq_len}")
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="error")

    sides = {"behemoth": lambda: run_behemoth(corpus, tokenizer, args.seq_len, work, args.cpus),
             "datasets": lambda: run_datasets(corpus, tokenizer, args.seq_len, args.cpus)}
    for fn in sides.values():  # warm-up: imports, Ray worker processes
        fn()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            tokens = fn()
            seconds = time.perf_counter() - t0
            rates[name].append(tokens / seconds)
            print(f"  repeat {r}: {name:9s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds / 1e6:.3f} M tokens/s")
    ratios = [b / d for b, d in zip(rates["behemoth"], rates["datasets"])]
    for name, values in rates.items():
        print(f"{name:9s} median {statistics.median(values) / 1e6:.3f} M tokens/s "
              f"(min {min(values) / 1e6:.3f}, max {max(values) / 1e6:.3f})")
    print(f"ratio behemoth / datasets.map(num_proc={args.cpus}): median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {args.repeats} repeats)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
