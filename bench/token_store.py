"""Training from the token shard files (data.token_store: files, each worker memory-maps them) against the
blocks in memory (token_store: memory, shipped through Ray's object store): the same LM job, alternating,
steady-state tokens/s of each (rank 0's clock from its first training report to its last).

    .venv/bin/python bench/token_store.py                 # 3 pairs, 2 workers, 80 steps
    .venv/bin/python bench/token_store.py --repeats 5 --steps 120
    .venv/bin/python bench/token_store.py --uri            # requests per batch from a bucket (issue 35)

Prints each run's tokens/s, the medians and their ratio (files / memory). The corpus is small enough to sit
in the page cache after the first read, which is the steady state of a machine whose RAM holds the shards a
worker is reading; a corpus read from a cold disk adds the disk's read time (not measured here).

--uri: a token store in a bucket of the S3 test server (moto's server; 8,192 generated blocks of 1,024 tokens
in 2 MB shards), read as the workers read it (TokenShards: prefetch of the next batch, then gather) for one
pass in a shuffled order (training) and one in order (evaluation), with nearby blocks in one request (now)
and with one request per block (before: REMOTE_HOLE_BYTES < 0). Prints requests per batch and ms per batch,
and the once-per-node check of every shard's sha256 (one full read of each) on its own line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import lm_corpus, lm_job, run_behemoth, steady_steps_per_s


def uri_requests(batch: int = 32, blocks: int = 8192, seq_len: int = 1024) -> None:
    import sys
    import time

    import numpy as np

    from _common import REPO
    from behemoth.data import token_store
    from behemoth.data.token_store import ShardWriter, TokenShards, upload

    sys.path.insert(0, str(REPO / "tests"))
    from s3_server import moto_s3

    with tempfile.TemporaryDirectory(prefix="bench-token-uri-") as tmp, moto_s3("tokens"):
        writer = ShardWriter(Path(tmp), "train", seq_len, np.uint16, shard_bytes=2 << 20)
        writer.add(np.random.default_rng(0).integers(0, 50_000, size=(blocks, seq_len), dtype=np.uint16))
        shards = writer.finish()
        (Path(tmp) / "meta.json").write_text("{}")
        upload(Path(tmp), "s3://tokens/cache")
        # Each shard's sha256 is checked once per node, on its first read (a full read of it): timed here, for
        # all shards; the passes below then find them checked (the node's markers, in this run's temp folder).
        tempfile.tempdir = tmp
        fs, root = token_store.filesystem("s3://tokens/cache")
        t = time.perf_counter()
        for shard in shards:
            token_store.verify_once(f"{root}/{shard['file']}", shard, "s3://tokens/cache", fs)
        print(f"shard check, once per node: {len(shards)} shards of {shards[0]['bytes'] / 1e6:.1f} MB, one full read "
              f"each, {(time.perf_counter() - t) * 1e3:.0f} ms in all", flush=True)
        orders = {"shuffled (training)": np.random.default_rng(1).permutation(blocks),
                  "in order (evaluation)": np.arange(blocks)}
        for hole, name in ((-1, "one request per block (before)"), (token_store.REMOTE_HOLE_BYTES, "nearby blocks "
                                                                    "in one request (now)")):
            for order, ids in orders.items():
                token_store.REMOTE_HOLE_BYTES = hole
                store = TokenShards("s3://tokens/cache", shards, seq_len, np.uint16)
                batches = [ids[i:i + batch] for i in range(0, len(ids), batch)]
                t = time.perf_counter()
                for k, b in enumerate(batches):
                    if k + 1 < len(batches):
                        store.prefetch(batches[k + 1])
                    store.gather(b)
                ms = (time.perf_counter() - t) / len(batches) * 1e3
                print(f"{name:32s} {order:22s}: {store._reader().requests / len(batches):5.1f} requests per "
                      f"batch of {batch}, {ms:6.1f} ms per batch", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--uri", action="store_true", help="requests per batch from a bucket, instead of training")
    args = p.parse_args()
    if args.uri:
        uri_requests()
        return
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
