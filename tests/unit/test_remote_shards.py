"""A sharded checkpoint in an object store is read where it is: a rank of a restore fetches only the bytes its
DCP load plan asks for, an export only the model's, each chunk checked against the manifest before use.
Measured on a real S3 API server (moto's, tests/s3_server.py) through a counting wrapper around pyarrow's S3
filesystem, with two real gloo processes running FSDP2 (fully_shard) on CPU."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

import pyarrow.fs
import pytest
import torch

from behemoth.storage import checkpoint, shard_reader, weights
from behemoth.storage.checkpoint import Snapshot, TrainState
from behemoth.errors import CheckpointError

BUCKET = "shards"
CHUNK = 64 << 10  # small chunks, so that each shard file spans many
WIDTH = 512


class CountingFS:
    """pyarrow's filesystem with the bytes read through it counted (what a rank or an export fetched)."""

    def __init__(self, fs):
        self.fs, self.bytes = fs, 0

    def open_input_file(self, path):
        return _Counted(self, self.fs.open_input_file(path))

    def open_input_stream(self, path):
        return _Counted(self, self.fs.open_input_stream(path))

    def __getattr__(self, name):
        return getattr(self.fs, name)


class _Counted:
    def __init__(self, owner: CountingFS, f):
        self.owner, self.f = owner, f

    def _counted(self, data):
        self.owner.bytes += len(data)
        return data

    def read_at(self, n, offset):
        return self._counted(self.f.read_at(n, offset))

    def read(self, n=None):
        return self._counted(self.f.read() if n is None else self.f.read(n))

    def size(self):
        return self.f.size()

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # 6 Linear(512, 512): ~6.3 MB of weights, twice that of Adam state
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(6)])


def _sharded(seed: int):
    from behemoth.worker import parallel

    model = parallel.shard(_model(seed), reshard_after_forward=True)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _local_state(model, optimizer) -> dict:
    """This rank's shards of the model and optimizer state, as plain tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat = shard_reader.split_state({"model": model_sd, "optimizer": optim_sd})[0]
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in flat.items()}


def _rank(rank: int, port: int, folder: str, uri: str, endpoint: str, out: str) -> None:
    """One of 2 gloo ranks: FSDP2 on CPU, one step, a sharded checkpoint written and uploaded; then a fresh
    model restored from the bucket by range. Writes what it saw to out/rank{rank}.json."""
    import os

    import torch.distributed as dist

    from behemoth.checkpoints import live_state
    from behemoth.checkpoints.sharded import ShardedWriter

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    checkpoint.CHUNK_BYTES = CHUNK
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt = _sharded(0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    saved = _local_state(model, opt)
    writer = ShardedWriter(rank)
    small = Snapshot(*live_state.extras(scheduler=sched, state=TrainState(step=1), task_files={}, job_yaml="x: 1\n"),
                     step=1) if rank == 0 else None
    written, _ = writer.start(model, opt, folder)
    writer.commit(written, folder, small)
    dist.barrier()
    if rank == 0:
        fs, where = pyarrow.fs.FileSystem.from_uri(uri)
        pyarrow.fs.copy_files(folder, where, destination_filesystem=fs)
    dist.barrier()

    seen = {}
    fs, where = pyarrow.fs.FileSystem.from_uri(uri)
    for attempt in ("whole", "damaged"):
        counting = CountingFS(fs)
        fresh, opt2 = _sharded(1)
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
        remote = shard_reader.remote_shards(counting, where, uri)
        with tempfile.TemporaryDirectory() as d:
            remote.download_rest(d)
            try:
                state = live_state.load(d, model=fresh, optimizer=opt2, scheduler=sched2, remote=remote)
                got = _local_state(fresh, opt2)
                seen[attempt] = {"step": state.step, "bytes": counting.bytes, "counted": remote.fetched,
                                 "equal": sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k])
                                                                               for k in saved)}
            except CheckpointError as e:
                seen[attempt] = {"error": str(e), "kind": type(e).__name__}
        dist.barrier()
        if attempt == "whole" and rank == 0:  # one byte of rank 1's shard file changed in the bucket (same size)
            name = f"{where}/state/__1_0.distcp"
            with fs.open_input_stream(name) as f:
                data = bytearray(f.read())
            data[len(data) // 2] ^= 0xFF
            with fs.open_output_stream(name) as f:
                f.write(bytes(data))
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def s3():
    from s3_server import moto_s3

    with moto_s3(BUCKET) as endpoint:
        yield endpoint


def test_each_rank_of_a_restore_from_a_bucket_fetches_its_own_shards_and_a_damaged_one_fails_both(s3, tmp_path):
    """2 FSDP ranks restore a 2-rank checkpoint from S3: each fetches <= 0.6x the checkpoint's bytes (its own
    shard file, the index and the small files), restores exactly its shards, and the reader's own count agrees
    with the wrapper's. One byte changed in rank 1's shard file: both ranks fail, naming it (rank 0 never
    reads that file: DCP's read step fails every rank together), as a load that may have left part of the
    checkpoint in the model."""
    import torch.multiprocessing as mp

    uri = f"s3://{BUCKET}/run/checkpoint_1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path / "ckpt"), uri, s3, str(tmp_path)), nprocs=2)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    total = sum(entry["size"] for entry in manifest["files"].values())
    shard = manifest["files"]["state/__1_0.distcp"]
    assert len(shard["chunks"]) == -(-shard["size"] // CHUNK) > 4 and shard["chunk_bytes"] == CHUNK
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        whole = seen["whole"]
        print(f"rank {rank}: fetched {whole['bytes']} of the checkpoint's {total} bytes "
              f"({whole['bytes'] / total:.2f}x)")
        assert whole["equal"] and whole["step"] == 1
        assert whole["bytes"] == whole["counted"] <= 0.6 * total
        assert "state/__1_0.distcp does not match its manifest" in seen["damaged"].get("error", ""), seen
        assert seen["damaged"]["kind"] == "PartlyLoadedError"  # a fresh start may not follow it (restore_latest)


def _one_process_checkpoint(folder: Path):
    """A sharded checkpoint written by one process (no process group), its model's state kept."""
    from behemoth.checkpoints import live_state
    from behemoth.checkpoints.sharded import ShardedWriter

    model = _model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    small = Snapshot(*live_state.extras(scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                                           state=TrainState(step=1), task_files={}, job_yaml="x: 1\n"), step=1)
    writer = ShardedWriter(rank=0)
    written, _ = writer.start(model, opt, str(folder))
    writer.commit(written, str(folder), small)
    return model.state_dict()


def test_an_export_from_a_bucket_fetches_the_models_bytes_only(s3, tmp_path, monkeypatch):
    """weights.read_state_dict (export, eval, init_from) of a sharded checkpoint in S3 fetches its manifest,
    its index and the model's bytes of the shard file (<= 1.1x the model's bytes; the optimizer's Adam state,
    twice as large, stays in the bucket), and gets the model's exact weights. A checkpoint without chunk
    hashes (written before) is still read, whole."""
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", CHUNK)
    expected = _one_process_checkpoint(tmp_path / "ckpt")
    fs, where = pyarrow.fs.FileSystem.from_uri(f"s3://{BUCKET}/export/checkpoint_1")
    pyarrow.fs.copy_files(str(tmp_path / "ckpt"), where, destination_filesystem=fs)
    counting = CountingFS(fs)
    monkeypatch.setattr(weights, "filesystem", lambda path, fs=None: (fs, path) if fs is not None else
                        (counting, pyarrow.fs.FileSystem.from_uri(str(path))[1]))
    got = weights.read_state_dict(f"s3://{BUCKET}/export/checkpoint_1")
    model_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    total = sum(e["size"] for e in json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"].values())
    print(f"export: fetched {counting.bytes} bytes for {model_bytes} of weights (checkpoint: {total})")
    assert counting.bytes <= 1.1 * model_bytes < 0.5 * total
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)

    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    for entry in manifest["files"].values():  # as written before chunk hashes were recorded
        entry.pop("chunks", None)
        entry.pop("chunk_bytes", None)
    with fs.open_output_stream(f"{where}/manifest.json") as f:
        f.write(json.dumps(manifest).encode())
    assert shard_reader.remote_shards(fs, where, "x") is None
    monkeypatch.undo()
    got = weights.read_state_dict(f"s3://{BUCKET}/export/checkpoint_1")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_restore_opens_a_bucket_checkpoint_by_range_and_an_older_one_whole(s3, tmp_path, monkeypatch):
    """live_state.opened (what restore_latest loads through) on a Ray Train checkpoint in S3: a sharded one
    with chunk hashes gives its small files in a local folder and its shards by range, and loads exactly; one
    without chunk hashes is downloaded whole (once per node: node_copy), as before."""
    import ray.train

    from behemoth.checkpoints import live_state

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", CHUNK)
    expected = _one_process_checkpoint(tmp_path / "ckpt")
    fs, where = pyarrow.fs.FileSystem.from_uri(f"s3://{BUCKET}/opened/checkpoint_1")
    pyarrow.fs.copy_files(str(tmp_path / "ckpt"), where, destination_filesystem=fs)
    ckpt = ray.train.Checkpoint(where, filesystem=fs)
    with live_state.opened(ckpt) as (d, remote, _):
        assert remote is not None and not any(d.glob("state/*.distcp"))
        assert {p.name for p in d.iterdir()} >= {"manifest.json", "train_state.json", "state"}
        model = _model(9)
        state = live_state.load(d, model=model, remote=remote)
    assert state.step == 1 and all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
    assert not d.exists()  # the small files' copy is gone

    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    for entry in manifest["files"].values():
        entry.pop("chunks", None)
    with fs.open_output_stream(f"{where}/manifest.json") as f:
        f.write(json.dumps(manifest).encode())
    with live_state.opened(ckpt) as (d, remote, node_copy):
        assert remote is None and node_copy and (d / "state" / "__0_0.distcp").is_file()
        model = _model(9)
        live_state.load(d, model=model)
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


class _ShortReads(CountingFS):
    """A store whose ranged reads come back cut short the first `short` times (S3's read returns what came)."""

    def __init__(self, fs, short: int):
        super().__init__(fs)
        self.short = short

    def open_input_file(self, path):
        owner, f = self, self.fs.open_input_file(path)

        class Cut(_Counted):
            def read_at(self, n, offset):
                data = f.read_at(n, offset)
                if owner.short > 0:
                    owner.short -= 1
                    return data[: n // 2]
                return data

        return Cut(self, f)


def test_a_read_cut_short_is_retried_once_then_an_io_error_not_damage(tmp_path, monkeypatch):
    """A ranged read that comes back short is read again; short twice, it is an OSError (the store's failure:
    the worker fails and Ray retries), never a CheckpointError that would skip a good checkpoint."""
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", CHUNK)
    expected = _one_process_checkpoint(tmp_path / "ckpt")
    local = pyarrow.fs.LocalFileSystem()
    for short, outcome in ((1, "loads"), (2, OSError)):
        remote = shard_reader.remote_shards(_ShortReads(local, short), str(tmp_path / "ckpt"), "ckpt")
        d = tmp_path / f"small-{short}"
        d.mkdir()
        remote.download_rest(d, only=(shard_reader.INDEX_FILE,))
        if outcome == "loads":
            got = shard_reader.read_sharded_weights(d, remote)
            assert all(torch.equal(got[k], expected[k]) for k in expected)
        else:
            with pytest.raises(OSError, match="bytes came back"):
                shard_reader.read_sharded_weights(d, remote)


def _open_on_node(i: int, uri: str, endpoint: str, turns, out: str, die: bool = False) -> None:
    """A process of the node opening the checkpoint (node_copy) with its reads counted. `turns`: (a barrier
    both pass inside, an event set once the first closed): process 0 closes first, process 1 then checks every file of the copy is
    still there and whole before it closes. `die`: ends inside, never closing (a killed rank)."""
    import os

    from behemoth.storage.node_copy import node_copy

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    fs, where = pyarrow.fs.FileSystem.from_uri(uri)
    counting = CountingFS(fs)
    with node_copy(counting, where, uri) as d:
        files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        seen = {"folder": str(d), "bytes": counting.bytes, "files": files}
        if turns is not None:
            inside, first_closed = turns
            inside.wait(timeout=60)
            if i == 1:
                assert first_closed.wait(timeout=60)
                seen["intact_after_first_closed"] = checkpoint.verify(d) is not None
        Path(out, f"p{i}.json").write_text(json.dumps(seen))
        if die:
            os._exit(0)
    if turns is not None and i == 0:
        turns[1].set()


def _node_processes(ctx, args_of, n):
    procs = [ctx.Process(target=_open_on_node, args=args_of(i), daemon=True) for i in range(n)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.pid is not None:
                p.kill()


def test_a_whole_checkpoint_is_downloaded_once_per_node_and_its_copy_goes_with_the_last_user(s3, tmp_path,
                                                                                          monkeypatch):
    """Two processes of a node open the same checkpoint in S3 at once (node_copy: what a restore of a full
    checkpoint, or of a sharded one without chunk hashes, uses; the format does not matter to it): one
    downloads it, both read the same folder, the bytes fetched in all are the checkpoint's once (plus each
    process's read of the manifest); the first to close leaves it whole for the other, and it goes with the
    last. A process that dies inside leaves its copy to the next user, who reads it without downloading and
    removes it; a dead user's copy of another checkpoint goes when any is opened. A download that fails (a
    file the manifest lists is missing) leaves nothing."""
    import multiprocessing

    monkeypatch.setenv("TMPDIR", str(tmp_path / "node-tmp"))  # the node's temp folder: this test's own
    (tmp_path / "node-tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))
    _one_process_checkpoint(tmp_path / "ckpt")
    uri = f"s3://{BUCKET}/node/checkpoint_1"
    fs, where = pyarrow.fs.FileSystem.from_uri(uri)
    for prefix in ("node/checkpoint_1", "other/checkpoint_1"):
        pyarrow.fs.copy_files(str(tmp_path / "ckpt"), f"{BUCKET}/{prefix}", destination_filesystem=fs)
    sizes = {name: e["size"] for name, e in json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"].items()}
    manifest = (tmp_path / "ckpt" / "manifest.json").stat().st_size

    ctx = multiprocessing.get_context("spawn")
    turns = (ctx.Barrier(2), ctx.Event())
    assert _node_processes(ctx, lambda i: (i, uri, s3, turns, str(tmp_path)), 2) == [0, 0]
    seen = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    assert seen[0]["folder"] == seen[1]["folder"] and seen[0]["files"] == sorted([*sizes, "manifest.json"])
    assert sum(s["bytes"] for s in seen) == sum(sizes.values()) + 2 * manifest
    assert seen[1]["intact_after_first_closed"] and not Path(seen[0]["folder"]).exists()

    assert _node_processes(ctx, lambda i: (2, uri, s3, None, str(tmp_path), True), 1) == [0]
    left = Path(json.loads((tmp_path / "p2.json").read_text())["folder"])
    assert left.is_dir()  # its user died inside
    _open_on_node(3, uri, s3, None, str(tmp_path))
    after = json.loads((tmp_path / "p3.json").read_text())
    assert after["folder"] == str(left) and after["bytes"] == manifest  # the dead process's copy, not downloaded
    assert not left.exists()

    assert _node_processes(ctx, lambda i: (4, uri, s3, None, str(tmp_path), True), 1) == [0]
    left = Path(json.loads((tmp_path / "p4.json").read_text())["folder"])
    _open_on_node(5, f"s3://{BUCKET}/other/checkpoint_1", s3, None, str(tmp_path))
    assert left.parent.is_dir() and not left.exists()  # swept when another checkpoint was opened

    fs.delete_file(f"{BUCKET}/other/checkpoint_1/train_state.json")
    from behemoth.storage.node_copy import node_copy

    with pytest.raises(CheckpointError, match="train_state.json is missing"):
        with node_copy(fs, f"{BUCKET}/other/checkpoint_1", "other"):
            pass
    assert list(left.parent.iterdir()) == []


@pytest.mark.parametrize("name", ["../x", "/etc/x", "state/../../x", "a//b", "./a", "", "a\0b", "a\\b", "x" * 256,
                                  "\ud800"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(name):
    """Copies of a checkpoint write each listed file under its name: one that leaves the folder, or cannot be one
    file in it (a NUL, a part over 255 bytes, a lone surrogate: issue 72 item 1, one rule with a bucket's
    listing), is refused before anything is written."""
    text = json.dumps({"format_version": 1, "files": {name: {"size": 1, "sha256": "0" * 64}}})
    with pytest.raises(CheckpointError, match="outside the checkpoint's folder"):
        checkpoint.read_manifest(text, "c")
    checkpoint.read_manifest(json.dumps({"format_version": 1, "files": {"state/a.distcp": {}}}), "c")


class _CutStreams:
    """A local store whose whole-file reads of `name` end after half its bytes the first `cuts` times, without
    an error (a download cut short: what shutil.copyfileobj took for the whole file)."""

    def __init__(self, name: str, cuts: int):
        self.fs, self.name, self.cuts = pyarrow.fs.LocalFileSystem(), name, cuts

    def open_input_stream(self, path):
        stream = self.fs.open_input_stream(path)
        if not path.endswith(f"/{self.name}") or self.cuts == 0:
            return stream
        self.cuts -= 1
        return pyarrow.BufferReader(stream.read()[: self.fs.get_file_info(path).size // 2])

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_a_node_copy_is_committed_only_when_every_file_matches_its_manifest(tmp_path, monkeypatch):
    """node_copy checks each file's size and sha256 as it downloads it. A download cut short once is fetched
    again and the copy is whole; cut short twice it is the store's failure (OSError: the worker fails and Ray
    retries), not taken for damage; a file that is shorter in the store than its manifest says (truncated after
    the manifest was written) or has other bytes is the checkpoint's damage (CheckpointError naming it). No
    failed copy is committed: the node's copies folder is left empty."""
    from behemoth.storage.node_copy import node_copy, own_temp_folder
    from behemoth.checkpoints import live_state

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = live_state.save(tmp_path / "ckpt", model=model, optimizer=opt, state=TrainState(step=1),
                              scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), task_files={},
                              job_yaml="x: 1\n")
    copies = own_temp_folder("behemoth-checkpoints")  # this node's copies, under the test's temp folder

    with node_copy(_CutStreams("model.pt", cuts=1), str(ckpt), "ckpt") as d:
        assert checkpoint.verify(d)  # fetched again: whole
    with pytest.raises(OSError, match="model.pt"), node_copy(_CutStreams("model.pt", cuts=2), str(ckpt), "ckpt"):
        pass
    assert list(copies.iterdir()) == []

    data = (ckpt / "model.pt").read_bytes()
    for damaged in (data[: len(data) // 2], data[:-1] + bytes([data[-1] ^ 1])):
        (ckpt / "model.pt").write_bytes(damaged)
        with (pytest.raises(CheckpointError, match="checkpoint ckpt: model.pt does not match its manifest"),
              node_copy(pyarrow.fs.LocalFileSystem(), str(ckpt), "ckpt")):
            pass
        assert list(copies.iterdir()) == []
