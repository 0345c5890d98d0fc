"""The decoded image cache (behemoth/data/image/image_cache.py, image_cache_build.py): the same batches as decoding
every epoch, a damaged or stale cache never read, one build per node however many processes ask at once. No
Ray: the cache is built in-process here (workers=False); the runs in tests/integration/test_train_images.py
build it with Ray Data."""

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from behemoth.data.image import image_cache, image_cache_build
from behemoth.data.image.image_batches import cached_batches, decode_fitted, transform_batch
from behemoth.data.image.images import index_image_folder, index_parquet
from behemoth.errors import ConfigError, DataError
from behemoth.data.image.image_cache import decide_cache
from behemoth.tasks.image import ImageData

SIZE = 16


def cfg(**kw) -> ImageData:
    return ImageData(**{"root": "unused", "image_size": SIZE, "crop_padding": 2, **kw})


@pytest.fixture
def mixed_images(tmp_path) -> Path:
    """An ImageFolder whose images need resizing: non-square, larger and smaller than 16, RGB/L/RGBA, PNG and
    JPEG, and one file that is not an image."""
    rng = np.random.default_rng(0)
    root = tmp_path / "mixed"
    shapes = [(16, 16), (40, 23), (9, 30), (64, 64), (17, 50), (31, 12)]
    for split, per_class in (("train", 7), ("val", 3)):
        for c in ("cat", "dog"):
            folder = root / split / c
            folder.mkdir(parents=True)
            for i in range(per_class):
                w, h = shapes[(i + len(c)) % len(shapes)]
                mode, suffix = [("RGB", ".png"), ("L", ".jpg"), ("RGBA", ".png"), ("RGB", ".jpg")][i % 4]
                pixels = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
                Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode).save(folder / f"{i}{suffix}")
    (root / "train" / "dog" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    return root


def batch_of(table: pa.Table) -> dict:
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}


def build(table, root, **kw):
    plan = image_cache.plan(table, SIZE, str(root), "image")
    return plan, image_cache_build.open_or_build(plan, table, workers=False, log=lambda line: None, **kw)


@pytest.mark.parametrize("augment", ["crop_flip", "none"])
def test_cached_batches_are_the_decoded_batches_bit_for_bit(mixed_images, tmp_path, augment, monkeypatch):
    """Every epoch's batches from the cache equal transform_batch's on the same samples in the same order:
    images (float32, after the crop, flip and normalisation), labels, ids and the undecodable sample's flag.
    Shards of 5 rows, so that batches gather across shards."""
    monkeypatch.setattr(image_cache_build, "SHARD_BYTES", 5 * SIZE * SIZE * 3)
    index = index_image_folder(mixed_images)
    c = cfg(augment=augment, max_bad_samples=1)
    for split, train in (("train", True), ("train", False), ("val", False)):
        table = getattr(index, split)
        _, decoded = build(table, tmp_path / "cache")
        labels = table.column("label").to_numpy()
        order = np.random.default_rng(5).permutation(table.num_rows)
        for epoch in (0, 3):
            cached = list(cached_batches(decoded, labels, order, c, seed=7, epoch=epoch, train=train, batch_size=4))
            assert sum(len(b["sample_id"]) for b in cached) == table.num_rows
            for start, got in zip(range(0, len(order), 4), cached):
                want = transform_batch(batch_of(table.take(order[start:start + 4])), cfg=c, seed=7, epoch=epoch,
                                       train=train)
                for key in ("image", "label", "sample_id", "valid"):
                    assert got[key].dtype == want[key].dtype, key
                    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert len(decoded.shards) == -(-table.num_rows // 5)


def test_the_undecodable_image_is_recorded_with_the_message_a_run_shows(mixed_images, tmp_path):
    index = index_image_folder(mixed_images)
    _, decoded = build(index.train, tmp_path / "cache")
    bad = str(mixed_images / "train" / "dog" / "3.png")
    [(sample, message)] = decoded.errors.items()
    assert index.train.column("path")[sample].as_py() == bad and not decoded.valid[sample]
    assert message.startswith(f"cannot decode image {bad}: ") and "data.max_bad_samples" in message


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "remove the manifest", "remove valid.npy"])
def test_a_damaged_cache_is_detected_and_built_again(image_root, tmp_path, damage):
    index = index_image_folder(image_root)
    plan, decoded = build(index.train, tmp_path / "cache")
    want = decoded.rows(np.arange(plan.rows))[0].copy()
    folder = Path(plan.folder)
    shard = folder / "pixels-00000.npy"
    if damage == "flip a byte":
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "remove the manifest":
        (folder / "manifest.json").unlink()
    else:
        (folder / "valid.npy").unlink()
    assert image_cache.check(folder, plan) is not None
    said = []
    again = image_cache_build.open_or_build(plan, index.train, workers=False, log=said.append)
    assert image_cache.check(folder, plan) is None
    np.testing.assert_array_equal(again.rows(np.arange(plan.rows))[0], want)
    assert any("building it again" in line for line in said), said


@pytest.mark.parametrize("name", ["../../../outside.npy", "absolute", "sub/pixels-00000.npy"])
def test_a_manifest_naming_a_file_outside_the_cache_is_damage(image_root, tmp_path, name):
    """A shard's name in manifest.json is joined onto the cache's folder and memory-mapped: one naming a file
    elsewhere (here a copy of the shard, its size and time the same, so only the name can tell) is damage,
    and the cache is built again, its own shard named."""
    index = index_image_folder(image_root)
    plan, _ = build(index.train, tmp_path / "cache")
    folder = Path(plan.folder)
    name = str(tmp_path / "outside.npy") if name == "absolute" else name
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(folder / "pixels-00000.npy", folder / name)  # (copy2: the same modification time)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shards"][0]["file"] = name
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert "not a file's plain name inside the cache's folder" in image_cache.check(folder, plan)
    said = []
    image_cache_build.open_or_build(plan, index.train, workers=False, log=said.append)
    assert image_cache.check(folder, plan) is None and any("building it again" in line for line in said), said
    assert json.loads((folder / "manifest.json").read_text())["shards"][0]["file"] == "pixels-00000.npy"


def test_an_untouched_cache_is_opened_not_built_and_a_copied_one_is_checked_by_hash(image_root, tmp_path):
    index = index_image_folder(image_root)
    plan, _ = build(index.train, tmp_path / "cache")
    said = []
    image_cache_build.open_or_build(plan, index.train, workers=False, log=said.append)
    assert said == []
    shard = Path(plan.folder) / "pixels-00000.npy"
    os.utime(shard, ns=(1, 1))  # same bytes, another time (a copy): the hash decides
    assert image_cache.check(Path(plan.folder), plan) is None


def test_a_changed_source_file_makes_another_cache(mixed_images, monkeypatch):
    import PIL

    index = index_image_folder(mixed_images)
    before = image_cache.cache_key(index.train, SIZE, "image")
    assert image_cache.cache_key(index.train, SIZE, "image") == before
    assert image_cache.cache_key(index.train, 32, "image") != before
    assert image_cache.cache_key(index.train, SIZE, "other") != before
    with monkeypatch.context() as m:
        m.setattr(PIL, "__version__", "0.0.1")  # another Pillow may decode or resample differently
        assert image_cache.cache_key(index.train, SIZE, "image") != before
    first = Path(index.train.column("path")[0].as_py())
    Image.new("RGB", (16, 16), (1, 2, 3)).save(first)
    changed = image_cache.cache_key(index_image_folder(mixed_images).train, SIZE, "image")
    assert changed != before
    # rewritten in place with the same size and its modification time put back (rsync -a, cp -p, tar x)
    data, st = bytearray(first.read_bytes()), first.stat()
    data[-20] ^= 0xFF
    first.write_bytes(bytes(data))
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert first.stat().st_size == st.st_size and first.stat().st_mtime_ns == st.st_mtime_ns
    assert image_cache.cache_key(index_image_folder(mixed_images).train, SIZE, "image") != changed


def test_a_node_with_another_pillow_refuses_the_drivers_cache_plan(image_root, tmp_path, monkeypatch):
    """Pillow's version is part of the cache key (it decodes and resamples), computed on the driver: a node whose
    Pillow differs would store other pixels under the same key. Its worker refuses, naming both versions."""
    import PIL

    index = index_image_folder(image_root)
    plan = image_cache.plan(index.train, SIZE, str(tmp_path / "cache"), "image")
    assert plan.pillow == PIL.__version__
    monkeypatch.setattr(PIL, "__version__", "0.0.1")  # the worker's node
    with pytest.raises(DataError, match=rf"planned with Pillow {re.escape(plan.pillow)} \(the driver's\), this node "
                                        r"\(.*\) has Pillow 0\.0\.1"):
        image_cache_build.open_or_build(plan, index.train, workers=False)
    assert not (tmp_path / "cache" / "images").exists() or not list((tmp_path / "cache" / "images").iterdir())


BUILDER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    from behemoth.data.image import image_batches, image_cache, image_cache_build

    folder = Path(sys.argv[3])
    slow = image_batches.decode_fitted
    def decode_fitted(batch, **kw):  # the builder decodes only once both processes have asked for the cache
        deadline = time.monotonic() + 60
        while len(list(folder.glob("asked-*"))) < 2:
            assert time.monotonic() < deadline, "the other process never asked"
            time.sleep(0.01)
        return slow(batch, **kw)
    image_batches.decode_fitted = decode_fitted
    table = pq.read_table(sys.argv[1])
    plan = image_cache.plan(table, 16, sys.argv[2], "image")
    print("ready", flush=True)
    while not (folder / "go").exists():
        time.sleep(0.01)
    (folder / f"asked-{os.getpid()}").touch()
    decoded = image_cache_build.open_or_build(plan, table, workers=False)
    print("rows", int(decoded.rows(range(plan.rows))[0].sum()))
''')


def test_two_processes_asking_at_once_build_the_cache_once(image_root, tmp_path):
    """Two trials (processes) on one node ask for the same cache at once: one builds it, the other waits for
    the node's lock and opens what was built. The overlap is made sure of, not hoped for: both start asking
    once both have imported, and the builder decodes only after the other has asked (so the other asks while
    the build holds the lock)."""
    import pyarrow.parquet as pq

    index = index_image_folder(image_root)
    pq.write_table(index.train, tmp_path / "index.parquet")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "platform")}
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "index.parquet"),
                               str(tmp_path / "cache"), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(out.count("[behemoth] decoded 96 images once") for out in outs) == 1, outs
    assert len({out.splitlines()[-1] for out in outs}) == 1  # the same pixels for both
    assert not list((tmp_path / "cache" / "images").glob("*.tmp-*"))


def test_auto_decides_by_room_and_augmentation_and_says_why(image_root, tmp_path, monkeypatch):
    index = index_image_folder(image_root)
    plans, line = decide_cache(cfg(cache_dir=str(tmp_path / "c")), index)
    assert set(plans) == {"train", "val"} and line.startswith("decoded (0.1 MB for 120 images at 16x16")
    assert "built on first use" in line
    plans, line = decide_cache(cfg(augment="random_resized_crop", cache_dir=str(tmp_path / "c")), index)
    assert plans is None and "random_resized_crop" in line
    plans, line = decide_cache(cfg(cache="none"), index)
    assert plans is None and "data.cache=none" in line
    monkeypatch.setattr(image_cache, "node_memory", lambda: 100_000)  # 0.5 x 100 kB < 92 kB of pixels
    plans, line = decide_cache(cfg(cache_dir=str(tmp_path / "c")), index)
    assert plans is None and "would take more than data.cache_max_share=0.5 of this node's RAM" in line
    plans, _ = decide_cache(cfg(cache="decoded", cache_dir=str(tmp_path / "c")), index)
    assert plans is not None  # asked for: no room check
    for plan in plans.values():  # built: auto uses it whatever the room
        image_cache_build.open_or_build(plan, getattr(index, "train" if plan.rows == 96 else "val"),
                                        workers=False, log=lambda line: None)
    plans, line = decide_cache(cfg(cache_dir=str(tmp_path / "c")), index)
    assert plans is not None and "built already" in line


def test_decoded_is_refused_where_it_cannot_hold(tmp_path):
    with pytest.raises(ConfigError, match="random_resized_crop crops the original"):
        cfg(cache="decoded", augment="random_resized_crop").validate()
    with pytest.raises(ConfigError, match="is a URI: the decoded cache is a folder on each node"):
        cfg(cache="decoded", cache_dir="s3://bucket/cache").validate()
    with pytest.raises(ConfigError, match="data.cache_max_share must be in"):
        cfg(cache_max_share=0).validate()


def test_the_manifest_lists_every_file_it_checks(image_root, tmp_path):
    index = index_image_folder(image_root)
    plan, decoded = build(index.val, tmp_path / "cache")
    manifest = json.loads((Path(plan.folder) / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["pixels-00000.npy"] and manifest["rows"] == 24
    assert manifest["bytes"] == os.path.getsize(Path(plan.folder) / "pixels-00000.npy")


def test_no_decode_process_is_warmed_up_for_a_cache_that_is_built(image_root, tmp_path):
    """The driver starts decode processes before `fit` only for tasks that will run (driver/ray_cluster/warmup.py): with
    every split's decoded cache built, nothing decodes."""
    from behemoth.tasks.image import ImageClassification

    index = index_image_folder(image_root)
    c = cfg(cache_dir=str(tmp_path / "c"))
    index.cache, _ = decide_cache(c, index)
    job = types.SimpleNamespace(data=c)  # the job config: only its data section is read
    assert ImageClassification.data_modules(job, index) == ("ray.data", "behemoth.data.image.image_batches")
    build(index.train, tmp_path / "c")
    assert ImageClassification.data_modules(job, index) != ()  # val still to decode
    build(index.val, tmp_path / "c")
    assert ImageClassification.data_modules(job, index) == ()
    index.cache = None  # data.cache none: decoded every epoch
    assert ImageClassification.data_modules(job, index) == ("ray.data", "behemoth.data.image.image_batches")
    # random_resized_crop's decode tasks resize with torch: their processes import it ahead too
    rrc = types.SimpleNamespace(data=cfg(cache="none", augment="random_resized_crop"))
    assert ImageClassification.data_modules(rrc, index) == ("ray.data", "behemoth.data.image.image_batches", "torch")


@pytest.mark.parametrize("depth", [2, 0])
def test_the_task_makes_cached_batches_ahead_of_the_step_in_a_thread(image_root, tmp_path, monkeypatch, depth):
    """data.prefetch_batches > 0: the image task's batches from the cache (rows gathered, cropped, flipped,
    normalised) are made in the prefetch thread, not in the training thread; the same batches either way; an
    epoch left after one batch stops its thread when closed."""
    import threading

    import ray.train.torch
    import torch

    from behemoth.job import config_from_dict
    from behemoth.tasks.image import ImageClassification

    monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device("cpu"))  # no Ray Train session here
    job = config_from_dict({"data": {"root": str(image_root), "image_size": SIZE, "cache": "decoded",
                                     "cache_dir": str(tmp_path / "c"), "prefetch_batches": depth},
                            "checkpoint": {"storage_path": str(tmp_path), "run_name": "r"}})
    index = ImageClassification.prepare(job, ImageClassification.check(job))
    for split, plan in index.cache.items():  # built in-process (a run's first worker builds it with Ray Data)
        image_cache_build.open_or_build(plan, getattr(index, split), workers=False, log=lambda line: None)
    task = ImageClassification(job, index)
    decoded, labels = task._decoded("train")
    made_in, rows = [], image_cache.DecodedImages.rows
    monkeypatch.setattr(image_cache.DecodedImages, "rows",
                        lambda self, ids: (made_in.append(threading.current_thread().name), rows(self, ids))[1])
    order = np.random.default_rng(1).permutation(index.train.num_rows)
    got = list(task.train_batches(order, 2, 8))
    assert set(made_in) == ({"behemoth-prefetch"} if depth else {threading.current_thread().name})
    want = cached_batches(decoded, labels, order, job.data, seed=job.train.seed, epoch=2, train=True, batch_size=8)
    for g, w in zip(got, want, strict=True):
        for key in ("image", "label", "sample_id", "valid"):
            np.testing.assert_array_equal(g[key].numpy(), w[key], err_msg=key)
    before = set(threading.enumerate())  # an epoch left after one batch: its thread stops when it is closed
    batches = task.train_batches(order, 3, 8)
    next(batches)
    batches.close()
    assert not [t for t in threading.enumerate() if t not in before and t.name == "behemoth-prefetch"]


def png(pixels: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_each_image_column_of_a_parquet_set_has_its_own_cache(tmp_path):
    """A parquet set with two image columns, run with one data.image_column and then the other: each column's
    cache is its own and serves that column's pixels (the key once left the column out: the second run opened
    the first column's cache and trained on its pixels)."""
    rng = np.random.default_rng(3)
    photos = [rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for _ in range(6)]
    pq.write_table(pa.table({"photo": [png(p) for p in photos], "mask": [png(255 - p) for p in photos],
                             "label": [i % 2 for i in range(6)]}), tmp_path / "set.parquet")
    served = {}
    for column in ("photo", "mask"):
        table = index_parquet([str(tmp_path / "set.parquet")], [str(tmp_path / "set.parquet")], column, "label").train
        plan = image_cache.plan(table, SIZE, str(tmp_path / "cache"), column)
        decoded = image_cache_build.open_or_build(plan, table, workers=False, log=lambda line: None)
        served[column] = (plan.folder, decoded.rows(np.arange(6))[0].copy())
        want = decode_fitted(batch_of(table), size=SIZE, image_column=column)["pixels"]
        np.testing.assert_array_equal(served[column][1], want, err_msg=column)
    assert served["photo"][0] != served["mask"][0]
    np.testing.assert_array_equal(served["mask"][1], 255 - served["photo"][1])


FULL_DISK_BUILDER = textwrap.dedent('''
    import sys
    import pyarrow.parquet as pq
    from behemoth.data.image import image_cache, image_cache_build
    from behemoth.errors import user_facing_error

    table = pq.read_table(sys.argv[1])
    plan = image_cache.plan(table, int(sys.argv[3]), sys.argv[2], "image")
    try:
        image_cache_build.open_or_build(plan, table, workers=False, log=lambda line: None)
    except Exception as e:
        print(type(e).__name__, user_facing_error(e))
        sys.exit(1)
''')


def full_disk_line(cache_dir: Path, needs: str) -> str:
    return (rf"the decoded image cache did not fit: no space left on the device of "
            rf"{re.escape(str(cache_dir / 'images'))}; it needs about {needs}, \d+\.\d MB is free\. What it had "
            rf"written is removed\. Free space there, or point data\.cache_dir at a larger disk \(or set "
            rf"data\.cache: none\), then rerun the same command")


def nothing_left_but_locks(cache_dir: Path) -> list[str]:
    return [p.name for p in (cache_dir / "images").iterdir() if p.suffix != ".lock"]


@pytest.mark.parametrize("room", ["less than the rows", "the rows, not the header"])
def test_a_full_disk_ends_the_build_in_one_line_on_a_real_filesystem(image_root, small_disk, tmp_path, room):
    """A split built on a real 1 MB filesystem, in a process of its own: one StorageFullError (not retried)
    naming the folder and the space, and nothing left that a later run would open. Its rows take more than the
    free space (refused before anything is written), or just fit it and the shard's .npy header does not (the
    kernel's posix_fallocate says ENOSPC). Before, the rows were written through a memory map of a sparse file
    and the first page without room killed the builder with SIGBUS (and a run's retries, each the same way)."""
    train = index_image_folder(image_root).train
    free = shutil.disk_usage(small_disk).free
    if room == "less than the rows":
        size, rows = 64, train.num_rows  # 1.2 MB
    else:  # rows * 3 * size^2 <= free < that + the 128-byte header
        size = next(s for s in range(4, 64) if free % (3 * s * s) < 128)
        rows = free // (3 * size * size)
    table = train.take(np.arange(rows) % train.num_rows).set_column(0, "sample_id", pa.array(np.arange(rows)))
    pq.write_table(table, tmp_path / "index.parquet")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "platform")}
    done = subprocess.run([sys.executable, "-c", FULL_DISK_BUILDER, str(tmp_path / "index.parquet"),
                           str(small_disk), str(size)], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    [line] = done.stdout.splitlines()
    needs = f"{rows * 3 * size * size / 1e6:.1f} MB"
    assert re.fullmatch("StorageFullError " + full_disk_line(small_disk, needs), line), line
    assert nothing_left_but_locks(small_disk) == []


@pytest.mark.parametrize("where", ["the reservation", "the free space"])
def test_a_full_disk_at_the_build_is_one_error_and_leaves_nothing(image_root, tmp_path, monkeypatch, where):
    """ENOSPC where the build reserves its shards' space (posix_fallocate), or too little free space before it:
    one StorageFullError naming the folder, before any row is decoded; no cache or temporary folder is left; the
    next build (with room) is complete and right."""
    import errno

    from behemoth.errors import StorageFullError

    index = index_image_folder(image_root)
    decoding, decode = [], image_cache_build._decoded_batches
    monkeypatch.setattr(image_cache_build, "_decoded_batches", lambda *a: decoding.append(a) or decode(*a))
    with monkeypatch.context() as m:
        if where == "the reservation":
            def no_room(fd, offset, length):
                raise OSError(errno.ENOSPC, "No space left on device")
            m.setattr(os, "posix_fallocate", no_room)
        else:
            m.setattr(image_cache_build, "free_disk", lambda folder: 1000)
        with pytest.raises(StorageFullError) as raised:
            build(index.train, tmp_path / "cache")
    assert re.fullmatch(full_disk_line(tmp_path / "cache", "0.1 MB"), str(raised.value)), str(raised.value)
    assert decoding == [] and nothing_left_but_locks(tmp_path / "cache") == []
    monkeypatch.undo()
    plan, decoded = build(index.train, tmp_path / "cache")
    assert image_cache.check(Path(plan.folder), plan) is None and decoded.valid.all()


# A builder on `host` (argv[4]) whose pid reads 4242, paused mid-build (its temporary folder made and its
# decoding begun) until the file argv[3] exists: what another node's builder finds beside it.
PAUSED_BUILDER = textwrap.dedent('''
    import os, socket, sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    from behemoth.data.image import image_batches, image_cache, image_cache_build

    socket.gethostname = lambda: sys.argv[4]
    os.getpid = lambda: 4242
    decode = image_batches.decode_fitted
    def decode_fitted(batch, **kw):
        Path(sys.argv[3] + ".building").touch()
        while not Path(sys.argv[3]).exists():
            time.sleep(0.01)
        return decode(batch, **kw)
    image_batches.decode_fitted = decode_fitted
    table = pq.read_table(sys.argv[1])
    plan = image_cache.plan(table, 16, sys.argv[2], "image")
    decoded = image_cache_build.open_or_build(plan, table, workers=False)
    print("rows", int(decoded.rows(range(plan.rows))[0].sum()))
''')


def start_paused_builder(table: pa.Table, tmp_path: Path, host: str):
    pq.write_table(table, tmp_path / "index.parquet")
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "platform")}
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_BUILDER, str(tmp_path / "index.parquet"),
                             str(tmp_path / "cache"), str(go), host], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120  # a bound on a start-up that takes ~2 s, not a synchronisation
    while not Path(f"{go}.building").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the paused builder did not start building"
        time.sleep(0.01)
    return proc, go


@pytest.mark.parametrize("hosts", [("node-a", "node-b"), ("node-a", "node-a")])
def test_builders_with_one_pid_on_two_hosts_keep_their_own_temporary_folders(image_root, tmp_path, monkeypatch,
                                                                              hosts):
    """A cache folder on a shared filesystem, whose lock does not reach across nodes: a builder on host A (pid
    4242) is half-way when one on host B, also pid 4242 (containers), builds the same cache. B neither reuses nor
    removes A's temporary folder (before, both were `<key>.tmp-4242` and B's clean-up deleted A's build); A then
    finds B's complete cache and keeps it. On one host, the live builder's folder is left alone too."""
    from contextlib import nullcontext

    index = index_image_folder(image_root)
    a, go = start_paused_builder(index.train, tmp_path, hosts[0])
    try:
        [a_temp] = (tmp_path / "cache" / "images").glob("*.tmp-*")
        a_files = sorted(p.name for p in a_temp.iterdir())
        said = []
        with monkeypatch.context() as m:  # builder B
            m.setattr(image_cache_build, "exclusive", lambda path: nullcontext())  # the other node's lock
            m.setattr(socket, "gethostname", lambda: hosts[1])
            m.setattr(os, "getpid", lambda: 4242)
            plan = image_cache.plan(index.train, SIZE, str(tmp_path / "cache"), "image")
            b = image_cache_build.open_or_build(plan, index.train, workers=False, log=said.append)
        assert a_temp.is_dir() and sorted(p.name for p in a_temp.iterdir()) == a_files
        if hosts[0] != hosts[1]:
            assert any(f"{a_temp.name}: another host's build" in line for line in said), said
    finally:
        go.touch()
        out = a.communicate(timeout=120)[0]
    assert a.returncode == 0, out
    assert out.splitlines()[-1] == f"rows {int(b.rows(range(plan.rows))[0].sum())}"
    assert image_cache.check(Path(plan.folder), plan) is None
    assert not list((tmp_path / "cache" / "images").glob("*.tmp-*"))


def test_a_dead_builders_temporary_folder_is_removed_by_the_next_build(image_root, tmp_path):
    """A builder killed half-way (SIGKILL: no clean-up of its own) leaves its temporary folder; the next build
    on that host proves it dead (its lock is free) and removes it."""
    index = index_image_folder(image_root)
    a, _ = start_paused_builder(index.train, tmp_path, socket.gethostname())
    a.kill()
    a.communicate(timeout=120)
    assert len(list((tmp_path / "cache" / "images").glob("*.tmp-*"))) == 1
    plan, _ = build(index.train, tmp_path / "cache")
    assert image_cache.check(Path(plan.folder), plan) is None
    assert not list((tmp_path / "cache" / "images").glob("*.tmp-*"))


MOUNTS = """\
overlay / overlay rw,relatime,lowerdir=/l,upperdir=/u,workdir=/w 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
fs1:/export/home /home nfs4 rw,relatime,vers=4.2,rsize=1048576 0 0
/dev/nvme0n1p1 /home/alice/scratch ext4 rw,relatime 0 0
//filer/share /mnt/team\\040data cifs rw,relatime 0 0
alice@box:/data /home/alice/remote fuse.sshfs rw,nosuid,nodev 0 0
10.0.0.1@tcp:/lfs /lustre lustre rw 0 0
portal /run/user/1000/doc fuse.portal rw,nosuid,nodev 0 0
"""


@pytest.mark.parametrize("folder, kind", [
    ("/home/alice/proj/data_cache", "nfs4"), ("/home", "nfs4"), ("/homework/data_cache", None),
    ("/home/alice/scratch/data_cache", None), ("/mnt/team data/cache", "cifs"),
    ("/home/alice/remote/c", "fuse.sshfs"), ("/lustre/alice/c", "lustre"), ("/run/user/1000/doc/c", None),
    ("/tmp/data_cache", None),
])
def test_a_cache_folder_on_a_network_filesystem_is_recognised(folder, kind):
    """By the mount that holds it (the longest mount point above it, /proc/mounts' escapes read)."""
    assert image_cache.network_filesystem(folder, MOUNTS) == kind


def test_the_run_says_once_that_its_cache_folder_is_on_a_network_filesystem(image_root, tmp_path, monkeypatch,
                                                                             capsys):
    from behemoth.job import config_from_dict
    from behemoth.tasks.image import ImageClassification

    monkeypatch.setattr(image_cache, "mount_table", lambda: f"fs1:/export {tmp_path} nfs rw 0 0\n")
    job = config_from_dict({"data": {"root": str(image_root), "image_size": SIZE, "cache": "decoded",
                                     "cache_dir": str(tmp_path / "c")},
                            "checkpoint": {"storage_path": str(tmp_path), "run_name": "r"}})
    ImageClassification.prepare(job, ImageClassification.check(job))
    said = [line for line in capsys.readouterr().out.splitlines() if "network filesystem" in line]
    assert said == [(f"[behemoth] warning: the decoded image cache's folder {tmp_path / 'c' / 'images'} is on a "
                     f"network filesystem (nfs): its rows are read over the network, and the nodes share it (one "
                     f"node's lock may not keep another's builder out); set data.cache_dir to a folder on each "
                     f"node's own disk (a local SSD, /tmp)")]


def corrupt_images() -> dict[str, bytes]:
    """Bytes that are the image's fault, each failing in PIL its own way."""
    import struct
    import zlib

    good = png(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))  # ~3 kB of IDAT
    ihdr = struct.pack(">II", 30_000, 30_000) + good[24:29]  # 900 M pixels: over PIL's bomb limit
    bomb = good[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + good[33:]
    return {"not an image": b"GIF89a but not really", "truncated": good[:len(good) // 2],
            "a decompression bomb": bomb}


def test_a_failure_that_is_not_the_images_fault_fails_the_build_and_is_not_stored(image_root, tmp_path,
                                                                                    monkeypatch):
    """A MemoryError while one image is decoded (a transient fault of the machine, not of the image) ends the
    build, naming the image, and nothing is committed: before, it was stored as an undecodable image, for every
    later run. The next build decodes it. Bytes that are really not an image are still stored as bad."""
    from behemoth.data.image import image_batches

    index = index_image_folder(image_root)
    victim = Path(index.train.column("path")[5].as_py()).read_bytes()
    decode = image_batches.decode_rgb
    with monkeypatch.context() as m:
        m.setattr(image_batches, "decode_rgb", lambda data, **kw: (_ for _ in ()).throw(MemoryError())
                  if data == victim else decode(data, **kw))
        with pytest.raises(MemoryError) as raised:
            build(index.train, tmp_path / "cache")
    assert any(index.train.column("path")[5].as_py() in note for note in raised.value.__notes__)
    plan = image_cache.plan(index.train, SIZE, str(tmp_path / "cache"), "image")
    assert image_cache.check(Path(plan.folder), plan) == "absent"
    assert nothing_left_but_locks(tmp_path / "cache") == []
    _, decoded = build(index.train, tmp_path / "cache")
    assert decoded.valid.all() and decoded.errors == {}

    for kind, data in corrupt_images().items():
        (tmp_path / "bad.png").write_bytes(data)
        table = index.train.slice(0, 3).set_column(1, "path", pa.array([str(tmp_path / "bad.png")] * 3))
        _, decoded = build(table, tmp_path / kind)
        assert not decoded.valid.any() and set(decoded.errors) == {0, 1, 2}, kind


@pytest.mark.parametrize("fault", ["MemoryError", "an OSError of a system call"])
def test_decoding_every_epoch_raises_a_failure_that_is_not_the_images_fault(image_root, tmp_path, monkeypatch,
                                                                            fault):
    """The same rule without the cache (transform_batch, one place: image_batches.decode_sample): a MemoryError,
    or an OSError with an errno (a failed system call), is raised, naming the image; it is neither dropped as a
    bad sample nor a BadSampleError (which ends a run without a retry). Corrupt bytes are bad samples."""
    import errno

    from behemoth.data.image import image_batches
    from behemoth.errors import BadSampleError

    index = index_image_folder(image_root)
    batch = batch_of(index.train.slice(0, 8))
    victim = Path(batch["path"][5]).read_bytes()
    error = MemoryError() if fault == "MemoryError" else OSError(errno.EIO, "Input/output error")
    decode = image_batches.decode_rgb
    monkeypatch.setattr(image_batches, "decode_rgb", lambda data, **kw: (_ for _ in ()).throw(error)
                        if data == victim else decode(data, **kw))
    for budget in (0, 5):
        with pytest.raises(type(error)) as raised:
            transform_batch(batch, cfg=cfg(max_bad_samples=budget), seed=0, epoch=0, train=True)
        assert any(batch["path"][5] in note for note in raised.value.__notes__)
    monkeypatch.undo()
    batch["path"][5] = str(tmp_path / "bad.png")
    for kind, data in corrupt_images().items():
        (tmp_path / "bad.png").write_bytes(data)
        got = transform_batch(batch, cfg=cfg(max_bad_samples=5), seed=0, epoch=0, train=True)
        assert list(np.flatnonzero(~got["valid"])) == [5], kind
        with pytest.raises(BadSampleError, match=f"cannot decode image {batch['path'][5]}"):
            transform_batch(batch, cfg=cfg(max_bad_samples=0), seed=0, epoch=0, train=True)


@pytest.fixture
def photo_jpegs(tmp_path) -> Path:
    """A few photograph-like JPEGs, landscape, portrait and larger (behemoth data synth-images --format jpeg)."""
    from behemoth.data.image.synth import write_synth_images

    root = tmp_path / "jpegs"
    write_synth_images(root, classes=2, per_class=6, val_per_class=2, size=(96, 72), seed=1, image_format="jpeg")
    return root


def test_random_resized_crop_from_kept_views_draws_the_crops_decoding_every_epoch_draws(photo_jpegs, tmp_path):
    """data.cache_side: the training split is kept as whole-image views at cache_side x cache_side with each
    image's upright size; every epoch's crops come from them with the same draws as decoding every epoch (the
    same window of each image, resampled from the view: close, not equal), the same batches on every read;
    evaluation rows stay centre-fitted at image_size."""
    c = cfg(augment="random_resized_crop", cache_side=48, image_size=24, cache_dir=str(tmp_path / "c"))
    index = index_image_folder(photo_jpegs)
    plans, line = decide_cache(c, index)
    assert plans["train"].views and plans["train"].size == 48 and not plans["val"].views and plans["val"].size == 24
    assert "views at 48x48" in line
    assert image_cache.plan(index.train, 48, str(tmp_path / "c"), "image").folder != plans["train"].folder
    decoded = image_cache_build.open_or_build(plans["train"], index.train, workers=False, log=lambda line: None)
    assert decoded.shards[0].shape[1:] == (48, 48, 3)
    paths = index.train.column("path").to_pylist()
    assert [tuple(s) for s in decoded.sizes] == [Image.open(p).size for p in paths]
    assert {tuple(s) for s in decoded.sizes} >= {(96, 72), (72, 96)}
    assert image_cache.check(Path(plans["train"].folder), plans["train"]) is None  # complete, reopened as is

    labels = index.train.column("label").to_numpy()
    order = np.random.default_rng(0).permutation(index.train.num_rows)
    got = [b["image"] for b in cached_batches(decoded, labels, order, c, seed=3, epoch=1, train=True, batch_size=4)]
    again = [b["image"] for b in cached_batches(decoded, labels, order, c, seed=3, epoch=1, train=True, batch_size=4)]
    assert all(np.array_equal(a, b) for a, b in zip(got, again))
    every_epoch = [transform_batch(batch_of(index.train.take(order[i:i + 4])), cfg=c, seed=3, epoch=1,
                                   train=True)["image"] for i in range(0, len(order), 4)]
    diff = np.mean([np.abs(a.astype(int) - b.astype(int)).mean() for a, b in zip(got, every_epoch)])
    other = [transform_batch(batch_of(index.train.take(order[i:i + 4])), cfg=c, seed=4, epoch=1,
                             train=True)["image"] for i in range(0, len(order), 4)]
    unrelated = np.mean([np.abs(a.astype(int) - b.astype(int)).mean() for a, b in zip(got, other)])
    assert diff < 0.25 * unrelated, (diff, unrelated)  # the same windows: far closer than other crops


def test_cache_side_is_checked():
    with pytest.raises(ConfigError, match="data.cache_side 48 is for augment random_resized_crop"):
        cfg(augment="crop_flip", cache_side=48).validate()
    with pytest.raises(ConfigError, match="smaller than data.image_size"):
        cfg(augment="random_resized_crop", cache_side=8).validate()
    with pytest.raises(ConfigError, match="or set data.cache_side"):
        cfg(augment="random_resized_crop", cache="decoded").validate()
    cfg(augment="random_resized_crop", cache="decoded", cache_side=32).validate()


def test_evaluation_with_eval_crop_pct_reads_its_own_rows(mixed_images, tmp_path, monkeypatch):
    """data.eval_crop_pct < 1 (ImageNet's 0.875: the shorter side resized to image_size / 0.875, the centre kept):
    the validation cache stores evaluation's pixels (transform_batch's, bit for bit) under a key of its own; the
    training rows stay crop_flip's base (the shorter side at image_size), so evaluating the train split decodes
    again rather than reading them; at 1 (the shorter side at image_size) the plan and key are those without a
    fit."""
    import torch

    from behemoth import hosts
    from behemoth.job import config_from_dict
    from behemoth.tasks import image as image_task

    index = index_image_folder(mixed_images)
    c = cfg(eval_crop_pct=0.875, max_bad_samples=1)
    assert c.eval_fit() == 18 and cfg(eval_crop_pct=1.0).eval_fit() == SIZE == cfg().eval_fit()
    plans, _ = decide_cache(dataclasses.replace(c, cache_dir=str(tmp_path / "c")), index)
    assert (plans["val"].fit, plans["train"].fit) == (18, 0)
    before, _ = decide_cache(cfg(cache_dir=str(tmp_path / "c")), index)
    assert before["val"].folder != plans["val"].folder and before["train"] == plans["train"]
    assert image_cache.plan(index.val, SIZE, str(tmp_path / "c"), "image", fit=SIZE) == before["val"]
    decoded = image_cache_build.open_or_build(plans["val"], index.val, workers=False, log=lambda line: None)
    labels, order = index.val.column("label").to_numpy(), np.arange(index.val.num_rows)
    got = next(cached_batches(decoded, labels, order, c, seed=0, epoch=0, train=False, batch_size=len(order)))
    want = transform_batch(batch_of(index.val), cfg=c, seed=0, epoch=0, train=False)
    np.testing.assert_array_equal(got["image"], want["image"])
    plain = transform_batch(batch_of(index.val), cfg=cfg(max_bad_samples=1), seed=0, epoch=0, train=False)
    assert not np.array_equal(plain["image"], want["image"])  # (the crop is a real one)

    job = config_from_dict({"data": {"root": str(mixed_images), "image_size": SIZE, "cache": "decoded",
                                     "cache_dir": str(tmp_path / "c"), "eval_crop_pct": 0.875,
                                     "max_bad_samples": 1},
                            "checkpoint": {"storage_path": str(tmp_path), "run_name": "r"}})
    index = image_task.ImageClassification.prepare(job, image_task.ImageClassification.check(job))
    decoded_again = []
    monkeypatch.setattr(image_task, "rank_batches", lambda table, *a, **k: decoded_again.append(table) or iter(()))
    task = image_task.ImageClassification(job, index)
    with hosts.hosted(types.SimpleNamespace(world=1, device=torch.device("cpu"))):  # (no Ray Train session here)
        list(task.eval_batches(np.arange(4), 4, split="train"))
        assert decoded_again == [index.train]
        list(task.eval_batches(np.arange(4), 4, split="val"))  # read from its cache (built on first use)
        assert decoded_again == [index.train]
