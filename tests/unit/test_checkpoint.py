"""Checkpoint round trip is exact; damage is detected and named."""

import io
import json
import pickle
import warnings

import pytest
import torch

from behemoth.storage import checkpoint
from behemoth.checkpoints import live_state
from behemoth.storage.checkpoint import CheckpointError, TrainState
from behemoth.storage.run_store import RunStore
from behemoth.config import TrainConfig
from behemoth.models.registry import build_model
from behemoth.worker.optim import build_optimizer, lr_schedule

CFG = TrainConfig(lr=0.1, warmup_steps=2, optimizer="sgd")


def make(seed=0):
    torch.manual_seed(seed)
    model = build_model("regnet_tiny_cifar", 4)
    opt = build_optimizer(model, CFG)
    return model, opt, lr_schedule(opt, CFG, total_steps=20)


def step(model, opt, sched, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_round_trip_restores_everything_exactly(tmp_path):
    model, opt, sched = make()
    for s in range(3):
        step(model, opt, sched, s)
    state = TrainState(step=3, epoch=0, step_in_epoch=3, samples_seen=12, world_size=2)
    live_state.save(tmp_path, model=model, optimizer=opt, scheduler=sched, state=state,
                       task_files={"classes.json": json.dumps(["a", "b"])}, job_yaml="x: 1\n")

    model2, opt2, sched2 = make(seed=99)  # different weights before the restore
    assert live_state.load(tmp_path, model=model2, optimizer=opt2, scheduler=sched2) == state
    assert_same_tensors(model.state_dict(), model2.state_dict())
    assert sched2.state_dict()["last_epoch"] == 3 and sched2.get_last_lr() == sched.get_last_lr()
    # continuing both gives identical weights: optimizer momentum came back too
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        step(m, o, s, seed=10)
    assert_same_tensors(model.state_dict(), model2.state_dict())


@pytest.mark.parametrize("sharded", [False, True])
def test_a_resume_keeps_the_optimizer_this_run_built(tmp_path, sharded):
    """A run stopped by a non-finite step (train.nonfinite: stop) and resumed with skip, as its error says: the
    load put back the saved param groups' fused=None, and skip's found_inf then failed every step on a CPU."""
    from types import SimpleNamespace

    from behemoth.worker.loop import train_step
    from behemoth.worker.precision import grad_scaler

    class Task:
        def loss_items(self, batch):
            return None

        def loss(self, model, batch):
            return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]), torch.tensor(4.0)

    def built(nonfinite):
        cfg = SimpleNamespace(train=TrainConfig(optimizer="adamw", lr=0.01, nonfinite=nonfinite, grad_clip=0.0))
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = build_optimizer(model, cfg.train)
        return cfg, model, opt, lr_schedule(opt, cfg.train, 10), grad_scaler(torch.device("cpu"), "fp32")

    batch = [{"x": torch.randn(4, 3), "y": torch.randn(4, 1)}]
    cfg, model, opt, sched, scaler = built("stop")
    train_step(model, opt, sched, scaler, batch, cfg, Task(), torch.device("cpu"))
    if sharded:
        from behemoth.checkpoints.sharded import ShardedWriter

        small = checkpoint.Snapshot(*live_state.extras(scheduler=sched, state=TrainState(step=1), task_files={},
                                                       job_yaml="x"), step=1)
        writer = ShardedWriter(rank=0)
        writer.commit(writer.start(model, opt, str(tmp_path))[0], str(tmp_path), small)
    else:
        live_state.save(tmp_path, model=model, optimizer=opt, scheduler=sched, state=TrainState(step=1),
                        task_files={}, job_yaml="x")
    cfg, model, opt, sched, scaler = built("skip")
    assert opt.param_groups[0]["fused"]
    live_state.load(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert all(group["fused"] for group in opt.param_groups)
    train_step(model, opt, sched, scaler, batch, cfg, Task(), torch.device("cpu"))


def test_a_resume_matches_the_optimizers_moments_to_parameters_by_name(tmp_path):
    """A model whose code now declares its layers in another order (same names, same shapes): the weights came
    back by name, Adam's moments by place, each to the other layer, silently. By name now; a parameter the
    checkpoint's optimizer never had is an error naming it."""

    class EncDec(torch.nn.Module):
        def __init__(self, dec_first=False):
            super().__init__()
            if dec_first:
                self.dec = torch.nn.Linear(8, 8)
            self.enc = torch.nn.Linear(8, 8)
            if not dec_first:
                self.dec = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.dec(torch.relu(self.enc(x)))

    torch.manual_seed(0)
    model = EncDec()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    (model(torch.randn(4, 8)) * 10).square().mean().backward()
    opt.step()
    live_state.save(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, state=TrainState(step=1),
                    task_files={}, job_yaml="x: 1\n")
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {names[id(p)]: opt.state[p]["exp_avg_sq"] for p in model.parameters()}
    reordered = EncDec(dec_first=True)
    opt2 = torch.optim.AdamW(reordered.parameters(), lr=0.1)
    live_state.load(tmp_path / "c", model=reordered, optimizer=opt2,
                    scheduler=torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0))
    for name, p in reordered.named_parameters():
        assert torch.equal(opt2.state[p]["exp_avg_sq"], moments[name]), name

    renamed = torch.nn.ModuleDict({"encoder": torch.nn.Linear(8, 8), "dec": torch.nn.Linear(8, 8)})
    with pytest.raises(CheckpointError, match=r"does not name this model's parameters \(lacks \['encoder.bias', "
                                              r"'encoder.weight'\], names \['enc.bias', 'enc.weight'\]\)"):
        live_state.load(tmp_path / "c", model=renamed, optimizer=torch.optim.AdamW(renamed.parameters()))


def test_tied_weights_are_written_once_and_stay_tied(tmp_path):
    """An output layer tied to the embedding is one tensor under two keys: each key got a host buffer of its
    own, and model.pt held the embedding twice (a tied 1B model's: ~1 GB more in every checkpoint)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(2048, 256), "head": torch.nn.Linear(256, 2048,
                                                                                                 bias=False)})
    model["head"].weight = model["embed"].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    live_state.save(tmp_path / "c", model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0), state=TrainState(step=1), task_files={}, job_yaml="x: 1\n")
    embedding = 2048 * 256 * 4
    assert embedding < (tmp_path / "c" / "model.pt").stat().st_size < 1.1 * embedding
    saved = torch.load(tmp_path / "c" / "model.pt", weights_only=True)
    assert saved["embed.weight"].data_ptr() == saved["head.weight"].data_ptr()
    fresh = torch.nn.ModuleDict({"embed": torch.nn.Embedding(2048, 256), "head": torch.nn.Linear(256, 2048,
                                                                                                 bias=False)})
    fresh["head"].weight = fresh["embed"].weight
    live_state.load(tmp_path / "c", model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert torch.equal(fresh["head"].weight, model["embed"].weight) and fresh["head"].weight is fresh["embed"].weight


def test_manifest_lists_every_file_and_is_written_last(tmp_path):
    model, opt, sched = make()
    live_state.save(tmp_path, model=model, optimizer=opt, scheduler=sched, state=TrainState(), task_files={},
                    job_yaml="")
    manifest = checkpoint.verify(tmp_path)
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "scheduler.pt", "train_state.json", "job.yaml"}
    assert not list(tmp_path.glob("*.tmp"))


def test_damage_is_detected_and_named(tmp_path):
    model, opt, sched = make()
    live_state.save(tmp_path, model=model, optimizer=opt, scheduler=sched, state=TrainState(), task_files={},
                    job_yaml="")
    weights = tmp_path / "model.pt"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated, as by a crash mid-copy
    with pytest.raises(CheckpointError, match=f"{tmp_path}: model.pt does not match its manifest"):
        live_state.load(tmp_path, model=make()[0])
    weights.write_bytes(data)
    checkpoint.verify(tmp_path)
    (tmp_path / "manifest.json").unlink()  # never finished writing
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        checkpoint.verify(tmp_path)


def test_complete_checkpoints_lists_only_manifested_ones_newest_first(tmp_path):
    model = build_model("regnet_tiny_cifar", 4)
    opt = build_optimizer(model, CFG)
    sched = lr_schedule(opt, CFG, 10)
    for step in (3, 9, 6):
        live_state.save(tmp_path / f"checkpoint_{step}", model=model, optimizer=opt, scheduler=sched,
                        state=TrainState(step=step), task_files={}, job_yaml="")
    (tmp_path / "checkpoint_9" / "manifest.json").unlink()  # written but never completed
    assert [step for step, _ in checkpoint.complete_checkpoints(tmp_path)] == [6, 3]
    assert checkpoint.complete_checkpoints(tmp_path / "missing") == []
    # under a URI (file://, through the same pyarrow calls as s3://) the paths come back as URIs
    assert checkpoint.complete_checkpoints(f"file://{tmp_path}") == [(6, f"file://{tmp_path}/checkpoint_6"),
                                                                    (3, f"file://{tmp_path}/checkpoint_3")]


def test_snapshot_is_a_copy_and_reuses_its_buffers(tmp_path):
    """The asynchronous save copies the state into host buffers kept between checkpoints: the copy must not
    alias the live weights (training goes on while it is written), and the second snapshot must fill the
    same buffers instead of allocating the whole state again."""
    model, opt, sched = make()
    step(model, opt, sched, 0)
    buffers = {}
    parts = dict(model=model, optimizer=opt, scheduler=sched, task_files={}, job_yaml="")
    first = live_state.snapshot(state=TrainState(step=1), buffers=buffers, **parts)
    saved = {k: v.clone() for k, v in first.state_dicts["model.pt"].items()}
    held = {id(t) for t in buffers.values()}
    step(model, opt, sched, 1)  # training moves on: the snapshot keeps step 1's values
    assert_same_tensors(first.state_dicts["model.pt"], saved)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    checkpoint.write(tmp_path / "a", first)
    second = live_state.snapshot(state=TrainState(step=2), buffers=buffers, **parts)
    assert {id(t) for t in buffers.values()} == held  # same buffers, refilled
    assert_same_tensors(second.state_dicts["model.pt"], model.state_dict())
    model2, opt2, sched2 = make(seed=1)
    live_state.load(tmp_path / "a", model=model2, optimizer=opt2, scheduler=sched2)
    assert_same_tensors(model2.state_dict(), saved)


def test_overlapped_snapshot_holds_the_state_of_its_step(tmp_path, monkeypatch):
    """snapshot(overlap=True) copies parameters and optimizer state while the next step's forward and backward
    run, and must still hold exactly the state of the step it was taken at: the BatchNorm statistics that
    the next forward changes were copied before it returned, the weights that the next update changes are
    copied before that update (wait_sources_free), and write() waits for the copies. The background copy is
    held until the forward and backward are done, so a tensor wrongly left to it shows."""
    import threading

    backward_done, copy_all = threading.Event(), live_state.Copies._copy_all
    monkeypatch.setattr(live_state.Copies, "_copy_all",
                        lambda self, pairs: (backward_done.wait(), copy_all(self, pairs)))
    model, opt, sched = make()
    step(model, opt, sched, 0)
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    parts = dict(model=model, optimizer=opt, scheduler=sched, task_files={}, job_yaml="")
    snap = live_state.snapshot(state=TrainState(step=1), buffers={}, overlap=True, **parts)
    # The next step, as the loop runs it: forward + backward, then wait, then the update.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y).backward()  # changes the BN statistics
    assert not torch.equal(model.state_dict()["regnet.embedder.embedder.normalization.running_mean"],
                           expected_model["regnet.embedder.embedder.normalization.running_mean"])
    backward_done.set()
    snap.wait_sources_free()
    opt.step()
    checkpoint.write(tmp_path / "a", snap)
    assert_same_tensors(snap.state_dicts["model.pt"], expected_model)
    for i, s in snap.state_dicts["optimizer.pt"]["state"].items():
        assert_same_tensors(s, expected_opt[i])
    model2, opt2, sched2 = make(seed=1)
    live_state.load(tmp_path / "a", model=model2, optimizer=opt2, scheduler=sched2)
    assert_same_tensors(model2.state_dict(), expected_model)


@pytest.mark.gpu
def test_an_overlapped_snapshot_on_a_gpu_copies_on_a_side_stream_and_holds_its_step(tmp_path):
    """On a GPU the copies run on a side stream into pinned buffers: the compute stream waits for them on the
    device (the BatchNorm statistics before the next forward, the rest before the next update), the host never;
    the snapshot still holds exactly its step's state."""
    model, opt, sched = make()
    model.cuda()
    opt = build_optimizer(model, CFG)
    x, y = torch.randn(4, 3, 16, 16, device="cuda"), torch.randint(0, 4, (4,), device="cuda")
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y).backward()
        opt.step()
    torch.cuda.synchronize()
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    parts = dict(model=model, optimizer=opt, scheduler=sched, task_files={}, job_yaml="")
    snap = live_state.snapshot(state=TrainState(step=2), buffers={}, overlap=True, **parts)
    assert snap.copies.event is not None and all(t.is_pinned() for t in snap.state_dicts["model.pt"].values())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y).backward()  # changes the BN statistics
    snap.wait_sources_free()
    opt.step()
    checkpoint.write(tmp_path / "a", snap)
    assert_same_tensors(snap.state_dicts["model.pt"], expected)


def test_two_sets_of_host_buffers_one_write_waited_for_only_when_both_are_being_written():
    """The snapshots' host buffers (saver.HostBuffers): a checkpoint whose predecessor is still being written
    takes the other set; the third waits for the older write, then reuses its set; a checkpoint whose
    predecessor's write is done reuses that set (no second allocation: the GPU kit's stall figure is read on it)."""
    import threading
    import time

    from behemoth.checkpoints.saver import HostBuffers

    sets = HostBuffers()
    first, first_written = sets.take()
    second, second_written = sets.take()
    assert first is not second
    threading.Timer(0.3, first_written.set).start()
    t0 = time.perf_counter()
    third, _ = sets.take()
    assert third is first and time.perf_counter() - t0 >= 0.25
    second_written.set()
    assert sets.take()[0] is second  # free: no wait
    kept = HostBuffers()
    once, written = kept.take()
    written.set()
    again, written = kept.take()
    assert again is once  # the write kept up: the same set, never a fresh allocation
    other, _ = kept.take()
    assert other is not once  # the last one still being written: the other set
    # a write the host dropped never hands its set back: after wait_s, fresh buffers rather than a hang
    dropped = HostBuffers(wait_s=0.1)
    held = [dropped.take()[0], dropped.take()[0]]
    t0 = time.perf_counter()
    fresh, _ = dropped.take()
    assert all(fresh is not h for h in held) and 0.09 <= time.perf_counter() - t0 < 5


def test_a_failed_background_copy_fails_the_checkpoint():
    """A copy that fails in the snapshot thread must surface (before the update, and before any file is
    written), never leave a half-copied snapshot to be written under a valid manifest."""
    copies = live_state.Copies([], [(torch.empty(3), torch.ones(4))])  # shapes differ: the copy raises
    with pytest.raises(CheckpointError, match="copying the training state for a checkpoint failed"):
        copies.wait_done()


class _RunsCode:
    """A pickle payload: unpickling it calls a function (here: writes a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_compression_state_loads_without_unpickling_code(tmp_path):
    """comm_hook.pt (PowerSGD's per-rank state) is read with weights_only=True: a checkpoint whose file was
    replaced by one that runs code on load (its manifest rewritten to match: a checksum proves integrity, not
    authorship) is refused, and the code never runs."""
    import io
    import pickle

    import pytest
    import torch

    from behemoth.worker.parallel import PowerSGD

    payload = io.BytesIO()
    torch.save({"state": {"rng_state": _RunsCode(tmp_path / "ran")}, "pieces": {}}, payload)
    hook = object.__new__(PowerSGD)
    with pytest.raises(pickle.UnpicklingError):
        hook.load_bytes(payload.getvalue(), device="cpu")
    assert not (tmp_path / "ran").exists()


def test_a_full_disk_fails_the_checkpoint_cleanly_on_a_real_filesystem(small_disk, tmp_path):
    """The saver's write (what Ray Train's upload function calls, with the run's storage) on a real, full
    filesystem: torch.save's error is recognised as a full disk; what the checkpoint wrote and its staging
    folder are removed; one message names the folder and the space needed; the earlier checkpoint is
    untouched and verifies. The whole run under Ray: tests/integration/test_train_images.py."""
    import pyarrow.fs
    import ray.train

    from behemoth.errors import StorageFullError
    from behemoth.checkpoints import saver

    run = small_disk / "run"
    state = '{"step": %d}'
    earlier = checkpoint.write(run / "checkpoint_1", checkpoint.Snapshot(
        state_dicts={"model.pt": {"w": torch.zeros(1000)}}, texts={"train_state.json": state % 1}, step=1))
    staging = tmp_path / "staging"
    staging.mkdir()
    big = checkpoint.Snapshot(state_dicts={"model.pt": {"w": torch.zeros(500_000)}},
                              texts={"train_state.json": state % 2}, step=2)
    assert checkpoint.snapshot_bytes(big) == 2_000_000 + len(state % 2)
    with pytest.raises(StorageFullError, match=rf"the checkpoint of step 2 did not fit: no space left on the "
                                               rf"device of {run}; it needs about 2.0 MB, \d\.\d MB is free"):
        saver.store(big, ray.train.Checkpoint.from_directory(str(staging)), "checkpoint_2",
                    RunStore(pyarrow.fs.LocalFileSystem(), str(run)))
    assert not (run / "checkpoint_2").exists() and not staging.exists()
    assert checkpoint.complete_checkpoints(run) == [(1, str(earlier))]
    checkpoint.verify(earlier)


def test_a_full_disk_fails_a_sharded_checkpoint_cleanly_on_a_real_filesystem(small_disk):
    """The same for a sharded checkpoint (what the upload function runs on every rank): DCP's write fails
    ("unexpected pos ..." from torch.save, over the file's ENOSPC, inside DCP's CheckpointException), which is
    recognised as a full disk; the folder is removed; one message names it and this rank's size; the earlier
    checkpoint is untouched. (Without recognising it the run failed with the bare "unexpected pos 704 vs 598".)"""
    import pyarrow.fs

    from behemoth.errors import StorageFullError
    from behemoth.checkpoints import saver
    from behemoth.checkpoints.sharded import ShardedWriter

    run = small_disk / "run"
    earlier = checkpoint.write(run / "checkpoint_1", checkpoint.Snapshot(
        state_dicts={"model.pt": {"w": torch.zeros(1000)}}, texts={"train_state.json": '{"step": 1}'}, step=1))
    model = torch.nn.Linear(1000, 500)  # 2.0 MB of weights, 2.0 MB of momentum after a step
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1000)).sum().backward()
    opt.step()
    writer = ShardedWriter(rank=0)
    target = RunStore(pyarrow.fs.LocalFileSystem(), str(run)).writing("checkpoint_2")
    assert target.folder == str(run / "checkpoint_2")  # (a local run folder: written in place)
    written, _ = writer.start(model, opt, target.folder)
    assert writer.last_bytes == 2 * 500_500 * 4  # weights and momentum
    small = checkpoint.Snapshot({}, {"train_state.json": '{"step": 2}'}, 2)
    with pytest.raises(StorageFullError, match=rf"the checkpoint of step 2 did not fit: no space left on the "
                                               rf"device of {run}; it needs about 4.0 MB for this rank's shards"):
        saver.commit_sharded(writer, written, target, small, 2, writer.last_bytes)
    assert not (run / "checkpoint_2").exists()
    assert checkpoint.complete_checkpoints(run) == [(1, str(earlier))]
    checkpoint.verify(earlier)


def _save_at(run, steps: dict[str, int]) -> None:
    """A tiny model's full checkpoint under each name in `run`, at its step."""
    model = build_model("regnet_tiny_cifar", 4)
    opt = build_optimizer(model, CFG)
    sched = lr_schedule(opt, CFG, 10)
    for name, step in steps.items():
        live_state.save(run / name, model=model, optimizer=opt, scheduler=sched, state=TrainState(step=step),
                        task_files={}, job_yaml="")


def test_retention_reaches_checkpoints_ray_train_never_registered(tmp_path):
    """A run resumed from a checkpoint Ray Train never registered (its driver died between the upload and the
    registration): at the end, checkpoint.keep applies to it too. Complete checkpoints older than every one Ray
    Train keeps are removed; the kept ones, a newer unregistered one and an incomplete one are not touched."""
    from types import SimpleNamespace

    from behemoth.job import config_from_dict
    from behemoth.checkpoints.retention import retire_unregistered
    from behemoth.driver.run.resume import run_place

    cfg = config_from_dict({"data": {"root": "x"}, "checkpoint": {"storage_path": str(tmp_path), "run_name": "r",
                                                                   "keep": 2}})
    run = tmp_path / "r"
    _save_at(run, {f"checkpoint_{s:02d}": s for s in (3, 6, 9, 12, 15)})
    (run / "checkpoint_15" / "manifest.json").unlink()  # an upload cut short: not this function's business
    kept = [(SimpleNamespace(path=str(run / f"checkpoint_{s:02d}")), {}) for s in (9, 12)]
    removed = retire_unregistered(run_place(cfg), kept)
    assert sorted(removed) == [str(run / "checkpoint_03"), str(run / "checkpoint_06")]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_09", "checkpoint_12", "checkpoint_15"]
    assert [s for s, _ in checkpoint.complete_checkpoints(run)] == [12, 9]
    assert retire_unregistered(run_place(cfg), []) == []  # nothing kept (no checkpoint registered): nothing removed
    kept_with_newer = [(SimpleNamespace(path=str(run / "checkpoint_09")), {})]
    assert retire_unregistered(run_place(cfg), kept_with_newer) == []  # 12 is newer than what Ray keeps: left alone


def test_a_users_folders_in_a_run_folder_and_an_unreadable_state_are_never_removed(tmp_path):
    """Only folders under the names Ray Train and the rescue write are a run's checkpoints. A user's export into
    the run folder (runs/r/checkpoint_best_hf: no manifest) was removed at the next resume as an upload cut
    short, and a copy of a checkpoint kept there (with its manifest) was retired as one Ray Train never
    registered. A checkpoint whose train state cannot be read now (a network error on a bucket) is not judged
    older than the kept ones: it stays."""
    import pyarrow.fs
    from types import SimpleNamespace

    from behemoth.checkpoints.restore import remove_partial_uploads
    from behemoth.checkpoints.retention import retire_unregistered
    from behemoth.driver.run.resume import run_place
    from behemoth.job import config_from_dict

    cfg = config_from_dict({"data": {"root": "x"}, "checkpoint": {"storage_path": str(tmp_path), "run_name": "r",
                                                                   "keep": 1}})
    run = tmp_path / "r"
    _save_at(run, {"checkpoint_2026-01-01_00-00-03.000000": 3, "checkpoint_2026-01-01_00-00-06.000000": 6,
                   "checkpoint_2026-01-01_00-00-09.000000": 9,
                   "checkpoint_best_copy": 3})  # (the user's copy of the step-3 checkpoint, manifest and all)
    (run / "checkpoint_2026-01-01_00-00-06.000000" / "train_state.json").write_text("{not json")  # unreadable
    (run / "checkpoint_best_hf").mkdir()  # the user's export, written there
    (run / "checkpoint_best_hf" / "config.json").write_text("{}")
    (run / "checkpoint_2026-01-01_00-00-12.000000").mkdir()  # an upload cut short
    (run / "checkpoint_rescue_step000000011").mkdir()  # a rescue cut short

    assert [path.rsplit("/", 1)[1] for _, path in checkpoint.complete_checkpoints(run)] == [
        "checkpoint_2026-01-01_00-00-09.000000", "checkpoint_2026-01-01_00-00-03.000000",
        "checkpoint_2026-01-01_00-00-06.000000"]  # (9, 3, then the unreadable one's -1)
    removed = remove_partial_uploads(RunStore(pyarrow.fs.LocalFileSystem(), str(run)), set())
    assert sorted(p.rsplit("/", 1)[1] for p in removed) == ["checkpoint_2026-01-01_00-00-12.000000",
                                                            "checkpoint_rescue_step000000011"]
    kept = [(SimpleNamespace(path=str(run / "checkpoint_2026-01-01_00-00-09.000000")), {})]
    assert retire_unregistered(run_place(cfg), kept) == [str(run / "checkpoint_2026-01-01_00-00-03.000000")]
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint_2026-01-01_00-00-06.000000", "checkpoint_2026-01-01_00-00-09.000000", "checkpoint_best_copy",
        "checkpoint_best_hf"]


def test_a_sharded_checkpoint_round_trips_and_names_a_damaged_shard(tmp_path):
    """checkpoint.format sharded in one process (no process group; the 2-rank and 2 -> 1 cases are the
    integration tests'): the DCP files and the small files under one manifest (format 3; that it comes last is
    the integration test's kill); a restore gives back weights, BatchNorm statistics, optimizer state and schedule exactly (continuing both
    ends equal); export's reader gets the weights whole; a flipped byte in the shard file is named by the
    pre-flight check, by the reader and by the restore."""
    from behemoth.storage import weights
    from behemoth.checkpoints.sharded import ShardedWriter

    model, opt, sched = make()
    for s in range(3):
        step(model, opt, sched, s)
    state = TrainState(step=3, step_in_epoch=3, samples_seen=12)
    writer = ShardedWriter(rank=0)
    small = checkpoint.Snapshot(*live_state.extras(scheduler=sched, state=state, task_files={}, job_yaml="x: 1\n"),
                                step=3)
    folder = tmp_path / "checkpoint_a"
    written, staging = writer.start(model, opt, str(folder))  # (not overlapped: copied before it returns)
    assert staging is None
    step(model, opt, sched, 7)  # the copy was taken when start returned: training on does not reach the files
    writer.commit(written, str(folder), small)
    manifest = checkpoint.verify(folder)
    assert manifest["format_version"] == checkpoint.SHARDED_FORMAT
    assert set(manifest["files"]) == {"state/.metadata", "state/__0_0.distcp", "state_values.json", "scheduler.pt",
                                      "train_state.json", "job.yaml"}

    model2, opt2, sched2 = make(seed=99)
    assert live_state.load(folder, model=model2, optimizer=opt2, scheduler=sched2) == state
    model3, opt3, sched3 = make()
    for s in range(3):
        step(model3, opt3, sched3, s)  # the state at step 3, as saved
    assert_same_tensors(model3.state_dict(), model2.state_dict())
    assert_same_tensors(weights.read_state_dict(folder), model3.state_dict())
    for m, o, s in ((model3, opt3, sched3), (model2, opt2, sched2)):
        step(m, o, s, seed=10)
    assert_same_tensors(model3.state_dict(), model2.state_dict())  # momentum and schedule came back too

    shard = folder / "state" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    for attempt in (lambda: weights.check(str(folder)), lambda: weights.read_state_dict(folder),
                    lambda: live_state.load(folder, model=model2, optimizer=opt2, scheduler=sched2)):
        with pytest.raises(CheckpointError, match=r"state/__0_0.distcp does not match its manifest"):
            attempt()


def test_a_sharded_checkpoint_of_a_batchnorm_model_copied_in_the_background_holds_its_step(tmp_path, monkeypatch):
    """The copy to host memory runs in DCP's staging thread while the next forward and backward run, for a
    model with BatchNorm statistics too (that forward changes them: they are copied on the device first); the
    files hold the checkpoint's step, statistics included. The staging thread is held until the forward and
    backward are done, so a statistic wrongly left to it shows."""
    import threading

    from torch.distributed.checkpoint.staging import DefaultStager

    from behemoth.storage.shard_reader import read_sharded_weights
    from behemoth.checkpoints.sharded import ShardedWriter

    backward_done, stage = threading.Event(), DefaultStager._stage
    monkeypatch.setattr(DefaultStager, "_stage", lambda self, sd, **kw: (backward_done.wait(), stage(self, sd, **kw))[1])
    model, opt, sched = make()
    step(model, opt, sched, 0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writer = ShardedWriter(rank=0)
    written, staging = writer.start(model, opt, str(tmp_path / "c"), overlap=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y).backward()  # changes the BN statistics
    backward_done.set()
    staging.wait_sources_free()
    opt.step()
    writer.commit(written, str(tmp_path / "c"), checkpoint.Snapshot({}, {"train_state.json": '{"step": 1}'}, 1))
    assert_same_tensors(read_sharded_weights(tmp_path / "c"), expected)
    running = "regnet.embedder.embedder.normalization.running_mean"
    assert not torch.equal(model.state_dict()[running], expected[running])  # training did go on


def test_a_sharded_checkpoint_copied_in_the_background_holds_its_step(tmp_path):
    """A language model's copy to host memory runs in DCP's staging thread while the next forward and backward
    run; the optimizer update waits for it (`wait_sources_free`, the saver's before_update). The files hold the
    state of the checkpoint's step."""
    from behemoth.storage.shard_reader import read_sharded_weights
    from behemoth.checkpoints.sharded import ShardedWriter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)

    def train_step(update=True):
        model(x).square().mean().backward()
        if update:
            opt.step()
            opt.zero_grad()

    train_step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writer = ShardedWriter(rank=0)
    written, staging = writer.start(model, opt, str(tmp_path / "c"), overlap=True)
    train_step(update=False)  # the next step's forward and backward, while the copy may still run
    staging.wait_sources_free()
    opt.step()
    writer.commit(written, str(tmp_path / "c"), checkpoint.Snapshot({}, {"train_state.json": '{"step": 1}'}, 1))
    assert_same_tensors(read_sharded_weights(tmp_path / "c"), expected)
    assert not torch.equal(model[0].weight, expected["0.weight"])  # training did go on


class _OpensFile:
    """What a crafted checkpoint file holds: unpickling it opens (creates) `path` for writing."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _write_sharded(folder, legacy=False):
    """A single-process sharded checkpoint at step 2 (SGD with momentum, a schedule); returns its state.
    `legacy`: as the previous behemoth wrote it (format 2: the whole state through DCP, param_groups pickled)."""
    import torch.distributed.checkpoint as dcp

    from behemoth.checkpoints.sharded import ShardedWriter, _state_dicts

    model, opt, sched = make()
    for s in range(2):
        step(model, opt, sched, s)
    state = TrainState(step=2, step_in_epoch=2, samples_seen=8)
    small = checkpoint.Snapshot(*live_state.extras(scheduler=sched, state=state, task_files={}, job_yaml="x: 1\n"),
                                step=2)
    if legacy:
        with warnings.catch_warnings():  # one process, on purpose
            warnings.filterwarnings("ignore", message=checkpoint.SINGLE_PROCESS_WARNING)
            dcp.save(_state_dicts(model, opt), checkpoint_id=str(folder / "state"), no_dist=True)
        checkpoint.write_files(folder, small)
        names = ["state/.metadata", "state/__0_0.distcp", *small.state_dicts, *small.texts]
        checkpoint.commit(folder, checkpoint.hash_files(folder, names), checkpoint.LEGACY_SHARDED_FORMAT)
        return model, opt, sched, state
    writer = ShardedWriter(rank=0)
    writer.commit(writer.start(model, opt, str(folder))[0], str(folder), small)
    return model, opt, sched, state


@pytest.mark.parametrize("device,overlap", [("cpu", False), ("cpu", True),
                                            pytest.param("cuda", False, marks=pytest.mark.gpu),
                                            pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_one_writer_writes_sharded_checkpoint_after_checkpoint(tmp_path, device, overlap):
    """A worker's ShardedWriter keeps DCP's stager (its host buffers) from one checkpoint to the next: every
    checkpoint is written and loads back exactly. (torch 2.11's async_save closed the stager it was given, and
    the next checkpoint of an FSDP run on a GPU failed with KeyError: <class 'type'>.)"""
    from behemoth.checkpoints.sharded import ShardedWriter

    model, opt, sched = make()
    model.to(device)
    writer = ShardedWriter(rank=0)
    saved = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(pixel_values=x.to(device)).logits, y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        folder = tmp_path / f"c{s}"
        small = checkpoint.Snapshot(*live_state.extras(scheduler=sched, state=TrainState(step=s + 1),
                                                          task_files={}, job_yaml="x: 1\n"), step=s + 1)
        written, staging = writer.start(model, opt, str(folder), overlap=overlap)
        if staging is not None:
            staging.wait_sources_free()
        saved.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        writer.commit(written, str(folder), small)
    for s, weights in enumerate(saved):
        restored, opt2, sched2 = make(seed=7)
        live_state.load(tmp_path / f"c{s}", model=restored, optimizer=opt2, scheduler=sched2)
        assert_same_tensors(restored.state_dict(), weights)


def _rehash(folder):
    """The manifest fixed up over the crafted files, as anyone who can write the folder can: its sha256 proves
    integrity, not who wrote the files."""
    manifest = checkpoint.verify(folder, only=())
    checkpoint.commit(folder, checkpoint.hash_files(folder, list(manifest["files"])), manifest["format_version"])


def _craft_index(folder, change):
    """The checkpoint's DCP index changed by `change(index)`, the manifest fixed up."""
    index_file = folder / "state" / ".metadata"
    with open(index_file, "rb") as f:
        index = pickle.load(f)  # the test's own file, just written
    change(index)
    index_file.write_bytes(pickle.dumps(index))
    _rehash(folder)


def _append_payload(folder, marker):
    """A torch.save'd object whose unpickling creates `marker`, appended to the shard file: its DCP storage."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    payload = io.BytesIO()
    torch.save(_OpensFile(marker), payload)
    shard = folder / "state" / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    return _StorageInfo("__0_0.distcp", offset, len(payload.getvalue()))


def _readers(folder):
    """Every way a sharded checkpoint is read: export, eval and init_from read its weights with
    weights.read_state_dict; a resume restores everything with live_state.load."""
    from behemoth.storage import weights

    model, opt, sched = make(seed=5)
    return {"export/eval/init_from": lambda: weights.read_state_dict(folder),
            "resume": lambda: live_state.load(folder, model=model, optimizer=opt, scheduler=sched)}


def test_a_crafted_shard_index_is_refused_and_never_run(tmp_path):
    """A sharded checkpoint's DCP index (state/.metadata) is a pickle: read with a restricted unpickler (DCP's
    metadata classes, torch sizes and dtypes only), one whose loading would call anything else is refused by
    every reader, naming the file and what it names, and the code never runs. An index naming a file outside
    state/ (or one its manifest does not list) is refused too."""
    folder = tmp_path / "c"
    _write_sharded(folder)
    index = (folder / "state" / ".metadata").read_bytes()
    marker = tmp_path / "ran"
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(_OpensFile(marker)))
    _rehash(folder)
    for use, read in _readers(folder).items():
        with pytest.raises(CheckpointError, match=r"state/\.metadata is not DCP's index.* names _?io\.open"):
            read()
        assert not marker.exists(), use

    (folder / "state" / ".metadata").write_bytes(index)
    _craft_index(folder, lambda index: setattr(next(iter(index.storage_data.values())), "relative_path",
                                               "../train_state.json"))
    for use, read in _readers(folder).items():
        with pytest.raises(CheckpointError, match=r"state/\.metadata names \.\./train_state\.json, which is not a "
                                                  r"shard file its manifest lists"):
            read()


class _Calls:
    """What a crafted index holds: unpickling it calls `func(*args)` (pickling it calls nothing)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _dag(depth: int):
    """A tuple holding its inner tuple twice, `depth` deep: 2**depth paths through 2 * depth pickled bytes (hashing
    it, as a dict key, walks every path)."""
    t = ()
    for _ in range(depth):
        t = (t, t)
    return t


def _index_refused(folder, data: bytes, match: str):
    """Every reader refuses a checkpoint whose index is `data`, with a message matching `match`."""
    (folder / "state" / ".metadata").write_bytes(data)
    _rehash(folder)
    for read in _readers(folder).values():
        with pytest.raises(CheckpointError, match=match):
            read()


def test_a_shard_index_that_would_allocate_from_a_small_file_is_refused(tmp_path):
    """The index's unpickler builds nothing that a small file can make large: bytearray (bytearray(n) fills n
    bytes: a 40-byte index could have the process OOM-killed) is refused like any other call; a pickle's memo
    index does not size an array (CPython's C unpickler: 9 bytes of LONG_BINPUT 2**24 took 256 MiB, 2**31 would
    take 32 GiB); no list, tuple or dict is used twice (one list of 1000 made into 1000 torch.Sizes: quadratic;
    a tuple holding its inner one twice, 20 deep, hashed as a key: 2**20 steps from 40 bytes). Safe to run
    against a reader without these checks: bytearray's first size fails at once (CPython refuses sys.maxsize),
    and the 10**12 one runs only once that one was refused."""
    import struct
    import sys
    import tracemalloc

    from behemoth.storage import dcp_index

    folder = tmp_path / "c"
    _write_sharded(folder)
    for size in (sys.maxsize, 10**12):
        _index_refused(folder, pickle.dumps(_Calls(bytearray, size)),
                       r"state/\.metadata is not DCP's index.* names builtins\.bytearray, which DCP's index never holds")

    (folder / "state" / ".metadata").write_bytes(b"\x80\x04N" + b"r" + struct.pack("<I", 2**24) + b".")
    _rehash(folder)
    manifest = checkpoint.verify(folder)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="is not DCP's index of the shards"):
            dcp_index.read_index(folder, manifest)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()

    shared = list(range(1000))
    _index_refused(folder, pickle.dumps([_Calls(torch.Size, shared) for _ in range(1000)]),
                   r"state/\.metadata is not DCP's index.* uses one list in two places")
    _index_refused(folder, pickle.dumps({_dag(20): 1}),
                   r"state/\.metadata is not DCP's index.* uses one tuple in two places")


@pytest.mark.timeout(60)
def test_a_shard_index_is_bounded_in_time_too(tmp_path):
    """Bounded in memory is not enough: a dict of ints that all hash alike takes n**2 steps to build (0.28 s at
    8,000 keys, an hour at 13 MB), multiplying huge ints in the size check took seconds (80 ints of 8 KiB: 3 s).
    DCP keys its dicts by name only and needs no int over 8 bytes: both are refused, in well under a second."""
    import time

    folder = tmp_path / "c"
    _write_sharded(folder)
    index = (folder / "state" / ".metadata").read_bytes()
    colliding = {k * (2**61 - 1): 0 for k in range(1, 1000)}  # every key hashes to 0
    t0 = time.perf_counter()
    # (ints over 8 bytes are refused first: within 8 bytes Python's int hash has almost no collisions)
    _index_refused(folder, pickle.dumps(colliding), r"state/\.metadata is not DCP's index.* an int of 9 bytes")
    _index_refused(folder, pickle.dumps({(1, 2): 0}), r"is not DCP's index.* keys a dict by tuple")
    _index_refused(folder, pickle.dumps({1.5: 0}), r"is not DCP's index.* keys a dict by float")
    key = "model.classifier.1.weight"
    (folder / "state" / ".metadata").write_bytes(index)
    _craft_index(folder, lambda index: setattr(index.state_dict_metadata[key], "size", (2**65536,) * 80))
    for read in _readers(folder).values():
        with pytest.raises(CheckpointError, match=r"is not DCP's index.* an LONG4 opcode|bytes, more than the shard"):
            read()
    _index_refused(folder, b"I" + b"9" * 4000 + b"\n.", r"is not DCP's index.* an int of 4000 digits")
    assert time.perf_counter() - t0 < 5  # (two readers each, hashing the files included)


def test_a_shard_index_asking_for_transforms_is_refused(tmp_path):
    """DCP applies an entry's transform descriptors (stream.zstd: the whole piece decompressed into memory,
    where zstandard is installed) before any tensor check: behemoth writes none, and refuses any."""
    folder = tmp_path / "c"
    _write_sharded(folder)
    _craft_index(folder, lambda index: setattr(next(iter(index.storage_data.values())), "transform_descriptors",
                                               ["stream.zstd/1"]))
    for read in _readers(folder).values():
        with pytest.raises(CheckpointError, match=r"state/\.metadata asks for transforms of its stored bytes "
                                                  r"\(\['stream\.zstd/1'\]\), which behemoth never writes"):
            read()


def test_a_shard_index_never_changes_a_class_it_may_name(tmp_path):
    """BUILD sets attributes of the object before it: on one of the allowed classes (DCP's, shared by the whole
    process) they would outlast the load; only objects the index itself made are built."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    folder = tmp_path / "c"
    _write_sharded(folder)
    state = pickle.dumps((None, {"behemoth_crafted": 1}), protocol=0)[:-1]  # without its STOP
    _index_refused(folder, b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n" + state + b"b.",
                   r"state/\.metadata is not DCP's index.* sets attributes of type")
    assert not hasattr(ChunkStorageMetadata, "behemoth_crafted")


def test_a_shard_index_larger_than_its_shards_or_claiming_more_than_they_hold_is_refused(tmp_path):
    """An index is refused before it is read where it is larger than the shard files it indexes (DCP's holds
    about a hundred bytes for each stored piece of a tensor, which takes a kilobyte or more in its shard file),
    and after it is read where it places a piece beyond its shard file's size, or declares tensors of more
    bytes than the shard files hold (an export allocates each model tensor from its declared size)."""
    folder = tmp_path / "c"
    _write_sharded(folder)
    index = (folder / "state" / ".metadata").read_bytes()
    shards = (folder / "state" / "__0_0.distcp").stat().st_size
    _index_refused(folder, index + b"\0" * shards,  # unpickling stops at the end of the index: never read
                   rf"state/\.metadata is {len(index) + shards} bytes, more than the shard files it indexes")

    (folder / "state" / ".metadata").write_bytes(index)
    _craft_index(folder, lambda index: setattr(next(iter(index.storage_data.values())), "length", shards + 1))
    for read in _readers(folder).values():
        with pytest.raises(CheckpointError, match=rf"state/\.metadata places .* of __0_0\.distcp beyond its "
                                                  rf"{shards} bytes"):
            read()

    (folder / "state" / ".metadata").write_bytes(index)
    key = "model.classifier.1.weight"
    _craft_index(folder, lambda index: setattr(index.state_dict_metadata[key], "size", torch.Size([2**20] * 2)))
    for read in _readers(folder).values():
        with pytest.raises(CheckpointError, match=r"state/\.metadata declares tensors of \d+ bytes in all, more "
                                                  rf"than its shard files hold \({shards} bytes\)"):
            read()


def test_a_crafted_non_tensor_entry_is_refused_and_never_run(tmp_path):
    """No non-tensor entry of a sharded checkpoint is unpickled freely. The current format keeps none in DCP
    (the optimizer's settings are in state_values.json): an index declaring one is refused by every reader. A
    format-2 checkpoint's (the previous behemoth's: its param_groups in DCP) load with weights_only, so one
    crafted to run code is refused."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    folder, marker, key = tmp_path / "c", tmp_path / "ran", "model.classifier.1.weight"
    _write_sharded(folder)
    storage = _append_payload(folder, marker)

    def declare_bytes(index):
        index.state_dict_metadata[key] = BytesStorageMetadata()
        index.storage_data[MetadataIndex(key)] = storage

    _craft_index(folder, declare_bytes)
    for use, read in _readers(folder).items():
        with pytest.raises(CheckpointError, match=rf"state/\.metadata declares {key} as non-tensor data"):
            read()
        assert not marker.exists(), use

    legacy, lr = tmp_path / "legacy", "optimizer.param_groups.0.lr"
    _write_sharded(legacy, legacy=True)
    storage = _append_payload(legacy, marker)
    _craft_index(legacy, lambda index: index.storage_data.__setitem__(MetadataIndex(lr), storage))
    with pytest.raises(CheckpointError, match=rf"checkpoint {legacy}: {lr} in the shards is not plain data, refused"):
        _readers(legacy)["resume"]()
    assert not marker.exists()


def test_a_format_2_sharded_checkpoint_still_restores_exactly(tmp_path):
    """A sharded checkpoint the previous behemoth wrote (format 2: param_groups pickled inside DCP) restores
    everything (its plain entries through weights_only) and reads whole for export; continuing both ends equal."""
    from behemoth.storage import weights

    model, opt, sched, state = _write_sharded(tmp_path / "c", legacy=True)
    model2, opt2, sched2 = make(seed=99)
    assert live_state.load(tmp_path / "c", model=model2, optimizer=opt2, scheduler=sched2) == state
    assert_same_tensors(weights.read_state_dict(tmp_path / "c"), model.state_dict())
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        step(m, o, s, seed=10)
    assert_same_tensors(model.state_dict(), model2.state_dict())


@pytest.mark.parametrize("name", ["model.pt", "manifest.json", "job.yaml", "state/__0_0.distcp"])
def test_a_task_file_never_replaces_one_of_behemoths_own(name):
    model, opt, sched = make()
    with pytest.raises(ValueError, match="would replace behemoth's own"):
        live_state.extras(scheduler=sched, state=TrainState(), task_files={name: "x"}, job_yaml="")


def test_a_checkpoint_report_leaves_no_folder_behind_whether_its_upload_succeeds_or_fails(tmp_path, monkeypatch):
    """Ray Train wants a local folder with each checkpoint report and deletes it only after a successful upload,
    and an object store's upload stages the checkpoint's files in it (saver.store): a failed upload left the
    folder, staged files and all, in the temp directory. Each report's folder is its own and goes when its
    upload ends, synchronous or not, failed or not. (ray.train.report is stubbed: it calls the upload function
    with the folder, in a thread where asynchronous, and raises what it raises, as Ray Train 2.60 does.)"""
    import tempfile
    import threading
    from pathlib import Path

    import ray.train

    from behemoth.checkpoints import saver

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    handed, errors = [], []

    def report(metrics, checkpoint=None, checkpoint_upload_fn=None, checkpoint_upload_mode=None,
               delete_local_checkpoint_after_upload=None, checkpoint_dir_name=None):
        handed.append((checkpoint.path, delete_local_checkpoint_after_upload))
        if checkpoint_upload_mode == ray.train.CheckpointUploadMode.SYNC:
            checkpoint_upload_fn(checkpoint, checkpoint_dir_name)
            return

        def upload():
            try:
                checkpoint_upload_fn(checkpoint, checkpoint_dir_name)
            except Exception as e:  # noqa: BLE001 - Ray Train's upload thread reports it at the next report
                errors.append(e)
        thread = threading.Thread(target=upload)
        thread.start()
        thread.join()

    def staging_upload(fails):
        def upload(ckpt, name):
            (Path(ckpt.path) / "model.pt").write_bytes(b"x" * 1000)  # staged, as store() does for a URI
            if fails:
                raise OSError("the upload failed")
            return "uploaded"
        return upload

    monkeypatch.setattr(ray.train, "report", report)
    for async_upload in (False, True):
        for fails in (False, True):
            try:
                saver.send_report({"step": 1}, staging_upload(fails), async_upload=async_upload, dir_name="c")
            except OSError:
                assert fails and not async_upload
    assert len(errors) == 1 and len(handed) == 4 and all(delete is False for _, delete in handed)
    assert len({path for path, _ in handed}) == 4  # a folder per report
    assert list(tmp_path.iterdir()) == []
    # An asynchronous upload Ray Train drops (the run failed before it ran: a fenced run's queued checkpoints)
    # leaves no folder either: it exists only while its upload runs.
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None, **kw: handed.append((checkpoint.path, 0)))
    saver.send_report({"step": 2}, staging_upload(False), async_upload=True, dir_name="d")
    assert len(handed) == 5 and list(tmp_path.iterdir()) == []


def test_a_received_checkpoints_job_yaml_is_checked_against_its_manifest_before_it_is_read(tmp_path):
    """export builds the config from the checkpoint's job.yaml: an edited one (its manifest not rewritten) is a
    damaged checkpoint, refused before it is parsed, never a config to build."""
    from behemoth.driver.commands.export import TrustedCode, _job_of

    model, opt, sched = make()
    parts = dict(model=model, optimizer=opt, scheduler=sched, task_files={},
                 job_yaml="data: {kind: image_folder, root: .}\nmodel: {name: regnet_tiny_cifar}\n")
    folder = checkpoint.write(tmp_path / "c", live_state.snapshot(state=TrainState(step=1), **parts))
    assert _job_of(str(folder), TrustedCode()).model.name == "regnet_tiny_cifar"
    (folder / "job.yaml").write_text("data: {kind: image_folder, root: .}\nmodel: {name: regnet_cifar}\n")
    with pytest.raises(CheckpointError, match=r"job.yaml does not match its manifest"):
        _job_of(str(folder), TrustedCode())


def test_the_weight_average_is_kept_restored_exactly_and_what_eval_and_export_read(tmp_path):
    """train.ema_decay (issue 58, worker/ema.py): the average of the weights (and of BatchNorm's statistics)
    after each step; in the checkpoint as ema.pt, restored exactly (a resumed run averages on to the same
    values), read by eval/export/init_from (weights.read_state_dict) instead of model.pt; a checkpoint written
    without one starts the average at the restored weights."""
    from behemoth.storage import weights
    from behemoth.worker.ema import WeightAverage

    model, opt, sched = make()
    ema = WeightAverage(model, decay=0.9)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    step(model, opt, sched, 0)
    ema.update()
    after = model.state_dict()
    for k, v in ema.state_dict().items():
        expected = first[k] * 0.9 + after[k] * 0.1 if v.is_floating_point() else after[k]
        assert torch.allclose(v, expected, atol=1e-6), k
    for s in range(1, 3):
        step(model, opt, sched, s)
        ema.update()
    state = TrainState(step=3, samples_seen=12)
    live_state.save(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, state=state, task_files={},
                       job_yaml="x: 1\n", ema=ema)
    assert "ema.pt" in json.loads((tmp_path / "c" / "manifest.json").read_text())["files"]
    assert_same_tensors(weights.read_state_dict(tmp_path / "c"), ema.state_dict())  # what eval and export load

    model2, opt2, sched2 = make(seed=99)
    ema2 = WeightAverage(model2, decay=0.9)
    live_state.load(tmp_path / "c", model=model2, optimizer=opt2, scheduler=sched2, ema=ema2)
    assert_same_tensors(ema.state_dict(), ema2.state_dict())
    for m, o, s, e in ((model, opt, sched, ema), (model2, opt2, sched2, ema2)):
        step(m, o, s, seed=10)
        e.update()
    assert_same_tensors(ema.state_dict(), ema2.state_dict())  # resumed: the same average

    live_state.save(tmp_path / "plain", model=model, optimizer=opt, scheduler=sched, state=state,
                       task_files={}, job_yaml="x: 1\n")
    model3, opt3, sched3 = make(seed=5)
    ema3 = WeightAverage(model3, decay=0.9)
    live_state.load(tmp_path / "plain", model=model3, optimizer=opt3, scheduler=sched3, ema=ema3)
    assert_same_tensors(ema3.state_dict(), model.state_dict())
    assert_same_tensors(weights.read_state_dict(tmp_path / "plain"), model.state_dict())


def test_the_weight_average_of_a_bf16_model_moves_as_an_fp32_one_does():
    """model.dtype bfloat16 with train.ema_decay: the average was a bf16 copy, whose update, (1 - decay) x the
    change, rounds to nothing: after the weights moved by 0.05 and 2,000 updates at 0.999 it had moved 0.002
    of the 0.043 it should. The average is kept in fp32."""
    from behemoth.worker.ema import WeightAverage

    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).to(dtype)
        ema = WeightAverage(model, decay=0.999)
        start = ema.module[0].weight.detach().double().clone()
        with torch.no_grad():
            model[0].weight += 0.05
        for _ in range(2000):
            ema.update()
        assert {p.dtype for p in ema.module.parameters()} == {torch.float32}
        moved[dtype] = float((ema.module[0].weight.double() - start).mean())
    exact = 0.05 * (1 - 0.999 ** 2000)
    assert moved[torch.float32] == pytest.approx(exact, rel=1e-3)
    assert moved[torch.bfloat16] == pytest.approx(exact, rel=2e-2)  # (the weights' own bf16 rounding)


def test_the_weight_average_needs_ddp_and_full_checkpoints(tmp_path):
    from behemoth.errors import ConfigError
    from behemoth.job import config_from_dict

    job = {"data": {"kind": "image_folder", "root": str(tmp_path)}, "model": {"name": "regnet_tiny_cifar"}}
    for sections, message in (({"train": {"ema_decay": 1.0}}, r"train.ema_decay must be in \(0, 1\)"),
                              ({"train": {"ema_decay": 0.99}, "scaling": {"strategy": "fsdp_full"}},
                               "train.ema_decay keeps a full copy of the model on every worker"),
                              ({"train": {"ema_decay": 0.99}, "checkpoint": {"format": "sharded"}},
                               "it needs scaling.strategy ddp and checkpoint.format full")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**job, **sections})


def test_a_background_write_records_the_cpu_seconds_it_spent(tmp_path, monkeypatch):
    """checkpoint.every_n_steps auto counts a background write's CPU seconds on a CPU worker (issue 73): the write
    (saver.store) sets them on its buffers' event before handing the buffers back, and HostBuffers sums them."""
    import types

    import pyarrow.fs
    import ray.train

    from behemoth.checkpoints import saver

    monkeypatch.setattr(saver.hosts, "current", lambda: types.SimpleNamespace(checkpoint_at=lambda dest, fs: dest,
                                                                               persist=None))
    sets = saver.HostBuffers()
    _, written = sets.take()
    snap = checkpoint.Snapshot(state_dicts={"model.pt": {"w": torch.randn(2_000_000)}},
                               texts={"train_state.json": '{"step": 1}'}, step=1)
    staging = tmp_path / "staging"
    staging.mkdir()
    saver.store(snap, ray.train.Checkpoint.from_directory(str(staging)), "checkpoint_1",
                RunStore(pyarrow.fs.LocalFileSystem(), str(tmp_path / "run")), written)
    assert written.is_set() and written.cpu_s > 0  # (8 MB written and hashed: milliseconds of CPU)
    assert sets.last_write_cpu_s() == written.cpu_s == sets.totals["cpu_s"]
    checkpoint.verify(tmp_path / "run" / "checkpoint_1")


def test_a_memory_copy_restores_everything_exactly_without_pickling_a_tensor():
    """checkpoint.memory_copy (issue 73): a lone worker's state goes to the driver's memory as flat bytes and a
    skeleton (no tensor pickled: bf16, 0-d and non-contiguous tensors, tuples kept), and loading it back
    continues training exactly as the live run does (the weights bit for bit), as from a checkpoint."""
    import pickle

    from behemoth.checkpoints.memory_copy import MemoryCopy, flatten, pack, restore_newer, unflatten
    from behemoth.checkpoints.trainables import Trainables

    tree = {"a": torch.randn(3, 4).t(), "b": torch.tensor(2.0), "c": torch.randn(5, dtype=torch.bfloat16),
            "betas": (0.9, 0.999), "params": [0, 1], 7: {"step": torch.tensor(3)}}
    tensors = []
    skeleton = pickle.dumps(flatten(tree, tensors))
    assert b"torch" not in skeleton and len(tensors) == 4  # (the tensors are the flat buffer's alone)
    flat = pack(tensors, None)
    assert flat.numel() == 12 * 4 + 4 + 5 * 2 + 8 and pack(tensors, flat) is flat  # (reused)
    back = unflatten(pickle.loads(skeleton), flat.numpy().copy())
    assert back["betas"] == (0.9, 0.999) and back["params"] == [0, 1] and back[7]["step"].dtype == torch.int64
    for key in ("a", "b", "c"):
        assert back[key].dtype == tree[key].dtype and torch.equal(back[key], tree[key]), key

    class Link:  # the keeper's link, in this process (hosts/state_keeper.py's actor is Ray's)
        copies, busy = {}, staticmethod(lambda: False)

        def send(self, step, skeleton, arrays):
            self.copies[step] = (skeleton, [a.copy() for a in arrays])

        def newest(self):
            return max(self.copies, default=-1)

        def fetch(self, step):
            return self.copies.get(step)

    model, opt, sched = make()
    for s in range(3):
        step(model, opt, sched, s)
    run, link = Trainables(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False)), Link()
    assert MemoryCopy(link, run).fits() and MemoryCopy(link, run).send(TrainState(step=3, samples_seen=12))
    model2, opt2, sched2 = make(seed=99)
    run2 = Trainables(model2, opt2, sched2, run.scaler)
    assert restore_newer(link, run2, than_step=3) is None  # (not newer than the checkpoint restored)
    assert restore_newer(link, run2, than_step=2) == TrainState(step=3, samples_seen=12)
    assert_same_tensors(model.state_dict(), model2.state_dict())
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        step(m, o, s, seed=10)
    assert_same_tensors(model.state_dict(), model2.state_dict())
