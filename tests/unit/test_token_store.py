"""Packed token blocks in shard files: written as the packer fills them, read back by global block index."""

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from behemoth.data.text.text_packing import Packer
from behemoth.data.token_store import ShardWriter, TokenShards, block_records, load_blocks
from behemoth.errors import DataError

SEQ = 8


def write_store(folder, blocks: np.ndarray, shard_bytes: int, chunks: list[int]) -> list[dict]:
    """`blocks` through a ShardWriter, added in chunks of the given sizes."""
    writer = ShardWriter(folder, "train", SEQ, blocks.dtype, shard_bytes=shard_bytes)
    at = 0
    for n in chunks:
        writer.add(blocks[at:at + n])
        at += n
    assert at == len(blocks)
    return writer.finish()


def test_blocks_read_back_by_global_index_across_shards(tmp_path):
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 50_000, size=(1000, SEQ), dtype=np.uint16)
    # 7 blocks of 16 bytes per 112-byte shard; chunks that straddle shard boundaries
    shards = write_store(tmp_path, blocks, shard_bytes=7 * SEQ * 2, chunks=[3, 10, 1, 500, 486])
    assert [s["blocks"] for s in shards] == [7] * 142 + [6] and sum(s["blocks"] for s in shards) == 1000
    assert all(s["bytes"] == (tmp_path / s["file"]).stat().st_size for s in shards)

    store = TokenShards(tmp_path, shards, SEQ, np.uint16)
    assert len(store) == 1000 and store.shape == (1000, SEQ)
    for ids in (rng.permutation(1000)[:64], np.array([999, 0, 6, 7, 7]), np.arange(1000), np.array([], np.int64)):
        store.prefetch(ids)
        got = store[ids]
        assert got.dtype == np.uint16 and np.array_equal(got, blocks[ids])
    with pytest.raises(IndexError):
        store[np.array([1000])]
    assert np.array_equal(load_blocks(tmp_path, shards, SEQ, np.uint16), blocks)


def test_what_travels_to_a_worker_is_the_table_not_the_tokens(tmp_path):
    """Pickled (as Ray ships it to each worker), a store is its folder and shard table: its size does not grow
    with the corpus, and the copy opens the files itself."""
    rng = np.random.default_rng(1)
    small = rng.integers(0, 1000, size=(100, SEQ), dtype=np.int32)
    big = rng.integers(0, 1000, size=(200_000, SEQ), dtype=np.int32)  # 6.4 MB
    (tmp_path / "s").mkdir(), (tmp_path / "b").mkdir()
    shards_small = write_store(tmp_path / "s", small, 1 << 20, [100])
    shards_big = write_store(tmp_path / "b", big, 1 << 20, [200_000])
    store = TokenShards(tmp_path / "b", shards_big, SEQ, np.int32)
    store[np.array([5])]  # opened here: the maps must not travel
    shipped = pickle.dumps(store)
    assert len(shipped) < 4096 < big.nbytes // 1000
    assert len(shipped) - len(pickle.dumps(TokenShards(tmp_path / "s", shards_small, SEQ, np.int32))) < 1024
    copy = pickle.loads(shipped)
    assert copy._maps == {} and np.array_equal(copy[np.array([199_999, 3])], big[[199_999, 3]])


def test_a_damaged_or_unreachable_shard_is_named(tmp_path):
    blocks = np.arange(40 * SEQ, dtype=np.uint16).reshape(40, SEQ)
    shards = write_store(tmp_path, blocks, shard_bytes=10 * SEQ * 2, chunks=[40])
    path = tmp_path / shards[2]["file"]
    path.write_bytes(path.read_bytes()[:-SEQ])  # truncated
    store = TokenShards(tmp_path, shards, SEQ, np.uint16)
    assert np.array_equal(store[np.array([0, 19])], blocks[[0, 19]])  # other shards still read
    with pytest.raises(DataError, match=f"token shard {path} has .* bytes, its cache's meta.json says"):
        store[np.array([25])]
    path.unlink()
    with pytest.raises(DataError, match=f"token shard {path} does not exist on this node: .*shared filesystem"):
        TokenShards(tmp_path, shards, SEQ, np.uint16)[np.array([25])]


def test_the_packer_streams_the_same_blocks_into_shards(tmp_path):
    """With a sink, the packer keeps no blocks itself: the shards hold exactly the blocks it would have kept."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 300, size=rng.integers(1, 40)) for _ in range(200)]
    kept = Packer(SEQ, np.uint16)
    writer = ShardWriter(tmp_path, "train", SEQ, np.uint16, shard_bytes=5 * SEQ * 2)
    streamed = Packer(SEQ, np.uint16, sink=writer.add)
    for d in docs:
        kept.add(d, 1)
        streamed.add(d, 1)
    blocks, counts = kept.finish()
    nothing, streamed_counts = streamed.finish()
    assert len(nothing) == 0 and streamed.blocks == [] and counts == streamed_counts
    assert np.array_equal(load_blocks(tmp_path, writer.finish(), SEQ, np.uint16), blocks)


def test_a_uri_folder_is_read_by_ranged_requests_and_uploaded_meta_last(tmp_path, monkeypatch):
    """A cache under a URI (here file://, through the same pyarrow calls as s3://): upload() writes the shards
    then meta.json; the workers' reads are one ranged request per block, fetched ahead by prefetch, with the
    last blocks kept; a truncated shard is named."""
    from behemoth.data.token_store import upload
    from behemoth.storage import store as storage_store

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 60_000, size=(300, SEQ), dtype=np.uint16)
    local = tmp_path / "built"
    local.mkdir()
    shards = write_store(local, blocks, shard_bytes=64 * SEQ * 2, chunks=[300])
    (local / "meta.json").write_text("{}")
    order = []
    real_copy = storage_store.shutil.copyfileobj  # the upload streams through the storage room's handle
    monkeypatch.setattr(storage_store.shutil, "copyfileobj", lambda src, dst, n: (order.append(Path(src.name).name),
                                                                                real_copy(src, dst, n)))
    uri = f"file://{tmp_path}/bucket/cache"
    (tmp_path / "bucket" / "cache").mkdir(parents=True)
    upload(local, uri)
    assert order[-1] == "meta.json" and sorted(order[:-1]) == sorted(s["file"] for s in shards)

    store = pickle.loads(pickle.dumps(TokenShards(uri, shards, SEQ, np.uint16)))
    ids = rng.permutation(300)[:40]
    store.prefetch(ids)
    assert np.array_equal(store[ids], blocks[ids]) and np.array_equal(store[np.arange(300)], blocks)
    assert np.array_equal(load_blocks(uri, shards, SEQ, np.uint16), blocks)
    reader = store._reader()
    asked = reader.requests
    store[ids]  # kept: no request
    assert reader.requests == asked

    ahead = TokenShards(uri, shards, SEQ, np.uint16)  # a fresh reader: each block read once, by prefetch
    fresh = ahead._reader()
    more = np.array([5, 250, 5, 77])
    ahead.prefetch(more)
    assert len(fresh.pending) == 3 and fresh.requests == 3  # started (far apart: a request each) before the gather
    assert np.array_equal(ahead[more], blocks[more]) and fresh.requests == 3

    path = tmp_path / "bucket" / "cache" / shards[1]["file"]
    path.write_bytes(path.read_bytes()[:-SEQ])
    fresh = TokenShards(uri, shards, SEQ, np.uint16)
    with pytest.raises(DataError, match=f"token shard {uri}/{shards[1]['file']} has {path.stat().st_size} bytes, "
                                        f"its cache's meta.json says {shards[1]['bytes']}: the cache is damaged"):
        fresh[np.array([127])]


def test_nearby_blocks_of_a_uri_are_read_by_one_request(tmp_path, monkeypatch):
    """Blocks a prefetch asks for that lie close together in one shard are read by one ranged request (the gap
    with them), never across shards nor past the size cap; each block still comes back as itself."""
    from behemoth.data import token_store

    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 60_000, size=(300, SEQ), dtype=np.uint16)
    root = tmp_path / "bucket" / "cache"
    root.mkdir(parents=True)
    shards = write_store(root, blocks, shard_bytes=100 * SEQ * 2, chunks=[300])  # 3 shards of 100 blocks
    uri = f"file://{root}"
    row = block_records(SEQ, np.uint16).itemsize

    def requests(ids) -> int:
        store = TokenShards(uri, shards, SEQ, np.uint16)
        assert np.array_equal(store[ids], blocks[ids])
        return store._reader().requests

    assert requests(np.arange(300)) == 3  # a sequential pass: one request per shard
    assert requests(np.array([0, 1, 2, 99, 100, 101])) == 2  # a shard boundary splits a run
    monkeypatch.setattr(token_store, "REMOTE_HOLE_BYTES", 5 * row)
    assert requests(np.array([10, 16])) == 1 and requests(np.array([10, 17])) == 2  # a gap of 5 blocks, of 6
    monkeypatch.setattr(token_store, "REMOTE_RANGE_BYTES", 10 * row)
    assert requests(np.arange(100)) == 10  # capped at 10 blocks a request
    assert requests(rng.permutation(300)) == 30  # any order: the same runs


def test_a_batch_reports_the_blocks_it_read_so_a_wrong_gather_fails_the_ledger_audit(tmp_path):
    """A text batch's sample ids are the ids stored with the blocks, read by the same gather as the tokens:
    the ledger of a real gather passes the audit; a gather that reads the wrong rows (here: each shard's
    neighbour) reports the blocks it read, and the audit names the step."""
    from behemoth.storage.checkpoint import TrainState
    from behemoth.tasks.causal_lm import gather_batch
    from behemoth.worker.ledger import SampleLedger
    from integration.ledger_audit import audit, planned_batches

    blocks = np.arange(64 * SEQ, dtype=np.uint16).reshape(64, SEQ)  # block i holds i*SEQ .. i*SEQ + SEQ-1
    (tmp_path / "store").mkdir()
    shards = write_store(tmp_path / "store", blocks, shard_bytes=16 * SEQ * 2, chunks=[64])
    plan = planned_batches(64, 8, 3)

    def ledger(store, name: str):
        writer = SampleLedger(str(tmp_path / name), rank=0, world=1)
        for step, ids in plan.items():
            batch = gather_batch(store, ids)
            read = batch["sample_id"].numpy()
            assert np.array_equal(batch["input_ids"].numpy(), blocks[read])  # the ids name the tokens delivered
            writer.record(TrainState(step=step - 1), [batch], loss_sum=1.0, samples=8)
        writer.file.close()
        return tmp_path / name

    store = TokenShards(tmp_path / "store", shards, SEQ, np.uint16)
    audit(ledger(store, "right"), 64, steps=3, batch=8)
    audit(ledger(load_blocks(tmp_path / "store", shards, SEQ, np.uint16), "memory"), 64, steps=3, batch=8)

    real_array = TokenShards._array
    wrong = TokenShards(tmp_path / "store", shards, SEQ, np.uint16)
    wrong._array = lambda s: real_array(wrong, (s + 1) % len(shards))
    folder = ledger(wrong, "wrong")
    got = [r["ids"] for r in map(json.loads, (folder / "rank0.jsonl").read_text().splitlines())]
    assert got == [[(i + 16) % 64 for i in ids] for ids in plan.values()]
    foreign = sorted(set(got[0]) - set(plan[1].tolist()))
    with pytest.raises(AssertionError) as e:
        audit(folder, 64, steps=3, batch=8)
    assert str(e.value).startswith("the ledger differs from the planned order: step 1 trained samples outside "
                                   f"its planned batch: {foreign[:8]}; step 2 ")


@pytest.fixture(autouse=True)
def node_temp(tmp_path, monkeypatch):
    """The node's temp folder (where shards checked once leave their markers): this test's own."""
    import tempfile

    (tmp_path / "node-tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))


@pytest.mark.parametrize("where", ["local", "uri"])
def test_a_shard_changed_in_place_is_named_and_each_is_hashed_once_per_node(tmp_path, monkeypatch, where):
    """Each shard's sha256 is in the cache's meta.json; a worker checks a shard the first time it reads it, and
    the node remembers (a marker in its temp folder) so other workers, epochs and runs over the unchanged file
    read it once. A byte changed in place (same size) is a DataError naming the shard; the shards that pass
    still read. A file modified in the last seconds is not remembered (a change within its timestamp's
    resolution would keep the marker's name). Local files and a URI (file://, through pyarrow's filesystem as
    s3://) alike."""
    import os
    import time

    from behemoth.data import token_store

    RACY_S = token_store.RACY_S
    hashed = []
    real = token_store.stream_sha256
    monkeypatch.setattr(token_store, "stream_sha256", lambda f: hashed.append(1) or real(f))
    blocks = np.arange(40 * SEQ, dtype=np.uint16).reshape(40, SEQ)
    (tmp_path / "s").mkdir()
    shards = write_store(tmp_path / "s", blocks, shard_bytes=10 * SEQ * 2, chunks=[40])
    folder = f"file://{tmp_path}/s" if where == "uri" else tmp_path / "s"

    def workers(n: int) -> None:  # n workers of the node, one after the other, each reading every block
        hashed.clear()
        for _ in range(n):
            assert np.array_equal(TokenShards(folder, shards, SEQ, np.uint16)[np.arange(40)], blocks)

    # Just written: within RACY_S of its change however slowly this machine got here (the window is made wide
    # for this part; an hour's age below is beyond the real one).
    monkeypatch.setattr(token_store, "RACY_S", 10**9)
    workers(2)
    assert len(hashed) == 8  # checked by each worker, remembered by none
    monkeypatch.setattr(token_store, "RACY_S", RACY_S)
    hour_ago = time.time() - 3600
    for shard in shards:
        os.utime(tmp_path / "s" / shard["file"], (hour_ago, hour_ago))
    workers(3)
    assert len(hashed) == 4  # each shard once

    path = tmp_path / "s" / shards[2]["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one byte of block 29's tokens, in place
    path.write_bytes(bytes(data))
    os.utime(path, (hour_ago + 1, hour_ago + 1))
    store = TokenShards(folder, shards, SEQ, np.uint16)
    assert np.array_equal(store[np.array([0, 19, 35])], blocks[[0, 19, 35]])  # the other shards still read
    with pytest.raises(DataError, match=f"token shard {folder}/{shards[2]['file']} does not hold what its cache's "
                                        f"meta.json says \\(its sha256 differs\\): the cache is damaged; delete"):
        store[np.array([25])]
    with pytest.raises(DataError, match="its sha256 differs"):
        load_blocks(folder, shards, SEQ, np.uint16)  # (token_store: memory, the driver reads every shard)
    if where == "uri":
        path.unlink()
        with pytest.raises(DataError, match=f"token shard {folder}/{shards[2]['file']}: cannot read blocks 25-25 "
                                            f".*does not exist"):
            TokenShards(folder, shards, SEQ, np.uint16)[np.array([25])]


@pytest.mark.parametrize("name", ["../train-00000.npy", "/etc/hostname", "sub/train-00000.npy", ".."])
def test_a_cache_meta_naming_a_shard_outside_its_folder_is_refused(tmp_path, name):
    """Issue 72 item 1's rule for every name that data gives: a token cache's meta.json whose shard table names a
    file outside the cache's folder (the workers read and memory-map each name joined onto it) is a damaged cache,
    said in one line naming the shard; a plain name is read as before."""
    from behemoth.data.text import text_packing

    shard = {"file": name, "blocks": 1, "bytes": 1, "sha256": "0" * 64}
    (tmp_path / "meta.json").write_text(json.dumps({"train": {"shards": [shard]}, "val": {"shards": []}}))
    said = rf"^token cache {tmp_path}: its meta.json names the shard {re.escape(repr(name))}, not a file of the cache's"
    with pytest.raises(DataError, match=said + " folder: the cache is damaged; delete"):
        text_packing._cache_meta(str(tmp_path))
    shard["file"] = "train-00000.npy"
    (tmp_path / "meta.json").write_text(json.dumps({"train": {"shards": [shard]}, "val": {"shards": []}}))
    assert text_packing._cache_meta(str(tmp_path))["train"]["shards"] == [shard]
