"""Training from the token shard files (data.token_store: files, each worker memory-maps them) against the
blocks in memory (token_store: memory, shipped through Ray's object store): the same LM job, alternating,
steady-state tokens/s of each (rank 0's clock from its first training report to its last).

    .venv/bin/python bench/token_store.py                 # 3 pairs, 2 workers, 80 steps
    .venv/bin/python bench/token_store.py --repeats 5 --steps 120

Prints each run's tokens/s, the medians and their ratio (files / memory). The corpus is small enough to sit
in the page cache after the first read, which is the steady state of a machine whose RAM holds the shards a
worker is reading; a corpus read from a cold disk adds the disk's read time (not measured here).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import lm_corpus, lm_job, run_behemoth, steady_steps_per_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    args = p.parse_args()
    corpus = lm_corpus()
    batch, seq_len = 16, 128
    rates: dict[str, list[float]] = {"memory": [], "files": []}
    with tempfile.TemporaryDirectory(prefix="bench-token-store-") as tmp:
        for i in range(args.repeats):
            for store in (("memory", "files") if i % 2 == 0 else ("files", "memory")):  # alternate who goes first
                job = lm_job(corpus, Path(tmp), f"{store}{i}", hidden=128, layers=2, seq_len=seq_len, batch=batch,
                             steps=args.steps, workers=2, threads=1, data={"token_store": store,
                                                                        "cache_dir": str(Path(tmp) / "cache")})
                tokens_per_s = steady_steps_per_s(run_behemoth(job), batch) * batch * seq_len
                rates[store].append(tokens_per_s)
                print(f"token_store {store:6s} run {i}: {tokens_per_s:,.0f} tokens/s", flush=True)
    files, memory = statistics.median(rates["files"]), statistics.median(rates["memory"])
    print(f"median tokens/s: files {files:,.0f}, memory {memory:,.0f}; ratio files/memory {files / memory:.3f} "
          f"(files: {sorted(round(r) for r in rates['files'])}, memory: {sorted(round(r) for r in rates['memory'])})")


if __name__ == "__main__":
    main()
