"""The run store (issue 77 item 1): one object, made from a run's place, through which a checkpoint is written,
found, opened and deleted, on a local folder and in an object store (moto's S3 API server, tests/s3_server.py).
The callers (saver, rescue, live_state, retention, a lane's host) never ask which kind of place it is:
tests/unit/test_platform.py checks that; here, that each kind does what its place needs."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest
import torch

from behemoth.storage import checkpoint
from behemoth.storage.checkpoint import Snapshot
from behemoth.storage.run_store import RunStore

BUCKET = "runstore"


@pytest.fixture(scope="module")
def s3():
    from s3_server import moto_s3

    with moto_s3(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """A run folder as a user names it: a local path, or a bucket's URI."""
    if request.param == "local":
        return str(tmp_path / "runs" / "r")
    request.getfixturevalue("s3")  # (its server's address is in the environment: AWS_ENDPOINT_URL)
    return f"s3://{BUCKET}/{tmp_path.name}/r"


def _snap(step: int) -> Snapshot:
    return Snapshot(state_dicts={"model.pt": {"w": torch.full((100,), float(step))}},
                    texts={"train_state.json": '{"step": %d}' % step}, step=step)


def _host(store: RunStore):
    """A host's two checkpoint functions, as Ray Train's host has them (checkpoint values: .path, .filesystem)."""
    def at(path, fs):
        return SimpleNamespace(path=path, filesystem=fs)
    return (lambda folder, name: at(store.put_folder(folder, name), store.fs)), at


def test_a_checkpoint_is_written_found_opened_and_deleted_through_the_store(place):
    store = RunStore.at(place)
    in_place = not place.startswith("s3://")
    persist, at = _host(store)
    seen = []

    def before_manifest():  # (where a worker killed mid-upload dies: its files are there, the manifest not)
        listed = store.fs.get_file_info(pyarrow.fs.FileSelector(store.folder("checkpoint_1")))
        seen.append(sorted(i.base_name for i in listed))

    write = store.writing("checkpoint_1", before_manifest=before_manifest)
    assert (write.folder == write.dest) == in_place  # in place, or staged in a local folder of its own
    assert write.upload is None if in_place else callable(write.upload)
    write.write(_snap(1))
    ckpt = write.finish(persist, at)
    write.clean()
    assert seen == [["model.pt", "train_state.json"]]  # the hook ran once, before the manifest, either way
    assert ckpt.path == write.dest and (in_place or not os.path.exists(write.folder))  # staging removed
    [(step, found)] = store.complete()
    assert step == 1 and found.startswith(place) and found.rstrip("/").endswith("checkpoint_1")
    assert store.complete(as_named=False) == [(1, write.dest)]
    with store.opened(ckpt.path) as (folder, remote, copied):
        assert copied != in_place and remote is None
        assert checkpoint.read_state(str(folder)).step == 1
        checkpoint.verify(folder)
    store.delete(found)
    assert store.complete() == []


def test_a_failed_write_leaves_nothing_and_the_earlier_checkpoint_stays(place):
    store = RunStore.at(place)
    persist, at = _host(store)
    first = store.writing("checkpoint_1")
    first.write(_snap(1))
    first.finish(persist, at)
    first.clean()
    broken = store.writing("checkpoint_2")
    checkpoint.write_files(broken.folder, _snap(2), lambda name: None)  # (files, no manifest: cut short)
    broken.abandon()
    broken.clean()
    assert not os.path.exists(broken.folder)
    assert [step for step, _ in store.complete()] == [1]


def test_a_name_is_claimed_by_one_writer_where_the_place_can_say_and_never_pretended_where_it_cannot(place):
    store = RunStore.at(place)
    if place.startswith("s3://"):
        assert store.claim("checkpoint_rescue_step000000003") is None  # no atomic folder in an object store
        return
    assert store.claim("checkpoint_rescue_step000000003") is True
    assert store.claim("checkpoint_rescue_step000000003") is False  # the other live worker's try
    store.release("checkpoint_rescue_step000000003")
    assert not Path(store.folder("checkpoint_rescue_step000000003")).exists()


def test_a_checkpoints_store_is_its_run_folder():
    ckpt = SimpleNamespace(path="bucket/runs/r/checkpoint_7/", filesystem=object())
    store = RunStore.of_checkpoint(ckpt)
    assert store.path == "bucket/runs/r" and store.fs is ckpt.filesystem
