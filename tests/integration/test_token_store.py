"""A corpus larger than Ray's object store trains from its shard files (data.token_store: files), exactly
resumable. Its own Ray instance: an object store of Ray's minimum, 75 MB, spilling off. (Ray would still take
a larger object, in a file-backed allocation beside the store: what the test asserts is that the object
store's use stays far below the corpus during the runs, as read from Ray's own accounting.)"""

import contextlib
import json
import re
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from behemoth.job import config_from_dict
from behemoth.data.text import text_packing
from behemoth.data.token_store import ShardWriter, TokenShards
from behemoth.driver.ray_cluster.session import LOCAL_RAY_SYSTEM_CONFIG
from behemoth.driver.run.trainer import train
from conftest import WORKER_PYTHONPATH, lm_job_dict, stop_local_ray

pytestmark = pytest.mark.integration

STORE_BYTES = 75 << 20  # Ray's minimum object store
CORPUS_BYTES = 4 * STORE_BYTES


@pytest.fixture(scope="module")
def small_object_store():
    import ray

    stop_local_ray()  # the shared instance; the next module starts it again
    ray.init(num_cpus=2, object_store_memory=STORE_BYTES, include_dashboard=False, logging_level="warning",
             _system_config={**LOCAL_RAY_SYSTEM_CONFIG, "automatic_object_spilling_enabled": False},
             _temp_dir=(temp_dir := tempfile.mkdtemp(prefix="rays-")),  # short: Ray's socket paths have a length limit
             runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def write_packed_corpus(cfg, blocks: int, val_blocks: int) -> Path:
    """The cache prepare_text would build for this job, filled with random tokens (tokenising 300 MB of text
    would take minutes here): the same shard files and meta.json, under the job's fingerprint."""
    units = text_packing.check_text_sources(cfg.data)
    cache = Path(cfg.data.cache_dir).absolute() / text_packing._fingerprint(cfg.data, units, cfg.train.seed)
    cache.mkdir(parents=True)
    rng = np.random.default_rng(0)
    meta = {"version": text_packing.CACHE_VERSION, "seq_len": cfg.data.seq_len, "tokenizer": cfg.data.tokenizer,
            "dtype": "uint16"}
    for split, n in (("train", blocks), ("val", val_blocks)):
        writer = ShardWriter(cache, split, cfg.data.seq_len, np.uint16)
        for start in range(0, n, 1 << 20):
            count = min(1 << 20, n - start)
            writer.add(rng.integers(0, 400, size=(count, cfg.data.seq_len), dtype=np.uint16))  # vocab 400
        meta[split] = {"documents": n, "tokens": n * cfg.data.seq_len, "blocks": n, "tail_tokens_dropped": 0,
                       "shards": writer.finish()}
    (cache / "meta.json").write_text(json.dumps(meta))
    return cache


@contextlib.contextmanager
def object_store_peak():
    """{"mib": the most the object store held (Ray's "Plasma memory usage", file-backed allocations
    included), sampled every 0.2 s while the block runs}."""
    import ray
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address  # this instance's (unnamed, Ray looks for one on the machine)

    peak, done = {"mib": 0, "samples": 0}, threading.Event()

    def sample():
        while not done.is_set():
            used = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(address, stats_only=True))
            peak["mib"], peak["samples"] = max(peak["mib"], int(used.group(1)) if used else 0), peak["samples"] + 1
            done.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


def test_a_corpus_four_times_the_object_store_trains_from_files_and_resumes_exactly(
        small_object_store, text_corpus, tmp_path):
    def job(run_name, max_steps):
        # a constant LR: a run's length (max_steps) does not change its schedule
        return config_from_dict(lm_job_dict(
            text_corpus, tmp_path, run_name=run_name, data={"token_store": "files"},
            train={"max_steps": max_steps, "warmup_steps": 0, "min_lr_ratio": 1.0},
            checkpoint={"every_n_steps": 4}, eval={"every_n_steps": 4}))

    cfg = job("split", 4)
    seq_bytes = cfg.data.seq_len * 2
    cache = write_packed_corpus(cfg, blocks=CORPUS_BYTES // seq_bytes, val_blocks=256)
    on_disk = sum(f.stat().st_size for f in cache.glob("train-*.npy"))
    assert on_disk > 4 * STORE_BYTES and len(list(cache.glob("train-*.npy"))) == 5  # ~64 MB shards

    index = text_packing.prepare_text(cfg.data, seed=0)  # the cache is found: nothing is tokenised
    assert isinstance(index.train, TokenShards) and len(index.train) == CORPUS_BYTES // seq_bytes

    with object_store_peak() as peak:
        first = train(cfg)
        assert first.metrics["step"] == 4
        resumed = train(job("split", 8))
        assert resumed.resumed_from_step == 4 and resumed.metrics["step"] == 8
        straight = train(job("straight", 8))
    assert peak["samples"] > 20 and peak["mib"] < 16, peak  # the corpus: 300 MiB
    a, b = (torch.load(f"{s.latest_checkpoint}/model.pt") for s in (resumed, straight))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.metrics["val_loss"] == straight.metrics["val_loss"]
