"""A rank's image batches: the samples of the index (data/image/images.py) read, decoded and augmented, in the order
`behemoth.data.order` decides.

Decoding and augmentation run in Ray Data `map_batches` tasks on the cluster's CPUs (`transform_batch`), one
Ray Dataset per window of a rank's samples (`rank_windows`); from the decoded cache (data/image/image_cache.py) only
the random part runs, on the worker (`cached_batches`). Normalisation runs on the worker's device
(`normalise`). Every path makes its pixels with the same functions (decode_rgb, center_fit, and the generator
sample_rng draws each sample's augmentation from), so a run reads the same images however they reach it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps

from behemoth.data.image import image_shards
from behemoth.data.image.decode import (MAX_IMAGE_PIXELS, crop_from_view, one_torch_thread, open_bounded,
                                        random_resized_crop)
from behemoth.data.image.images import ImageData
from behemoth.data.pipeline import ordered_data_context
from behemoth.errors import BadSampleError

# ---------------------------------------------------------------------------------------------------------
# Decode + augment (runs inside Ray Data map_batches tasks); normalise (on the training device)


def transform_batch(batch: dict, *, cfg: ImageData, seed: int, epoch: int, train: bool) -> dict:
    """Index rows -> {"image": uint8 [n,S,S,3], "label", "sample_id", "valid"}.

    Images leave the decode tasks as uint8 (a quarter of float32's bytes through the object store, the pinned
    copy and the copy to the device); the worker normalises them on its device (`normalise`). Augmentation
    draws from a generator seeded by (seed, epoch, sample_id): the same sample gets the same crop and flip in
    the same epoch whichever worker or task decodes it, so resumed runs are exact.
    """
    size = cfg.image_size
    raw = _load_bytes(batch, cfg.image_column)
    pixels = task_output(len(raw), size)
    valid = np.ones(len(raw), dtype=bool)
    with one_torch_thread() if train and cfg.augment == "random_resized_crop" else contextlib.nullcontext():
        for i, (data, sample_id) in enumerate(zip(raw, batch["sample_id"])):
            rng, row = sample_rng(seed, epoch, sample_id), pixels[i]
            out, error = decode_sample(data, batch, i, lambda d: _transformed(d, size, cfg, rng, train, row))
            if out is None and cfg.max_bad_samples == 0:
                raise BadSampleError(error)
            if out is None:
                row[:], valid[i] = 0, False
    return {"image": pixels, "label": batch["label"], "sample_id": batch["sample_id"], "valid": valid}


# The pixels of this process's last decode task, filled again by its next one where nothing holds them any more
# (the lock: two threads of one process never both take it between the check and the view that holds it).
_kept_output: list[np.ndarray] = []
_kept_lock = threading.Lock()


def task_output(n: int, size: int) -> np.ndarray:
    """uint8 [n, size, size, 3] for a decode task's images, its contents undefined: the array the process's last
    task returned where nothing holds it now (Ray has copied that task's output into its object store), else a
    new one kept for the next task. Memory that stays with the process costs nothing to write again; a fresh
    77 MB array (512 images at 224 px) cost 0.3-0.5 s of page faults a task on a VM whose host takes back the
    pages a guest frees (BENCHMARKS.md, the pipeline on fast cores), about half the task's decoding."""
    with _kept_lock:
        # held by the list and getrefcount's argument alone: no block or view refers to it
        if _kept_output and sys.getrefcount(_kept_output[0]) == 2:
            kept = _kept_output[0]
            if kept.shape[1] == size and kept.shape[0] >= n:
                return kept[:n]
        _kept_output[:] = [np.empty((n, size, size, 3), dtype=np.uint8)]
        return _kept_output[0]


def _transformed(data: bytes, size: int, cfg: ImageData, rng: np.random.Generator, train: bool,
                 row: np.ndarray) -> np.ndarray:
    """One sample's uint8 [S,S,3], written into `row`: centre-fitted (evaluation), or augmented from its
    generator."""
    decode = functools.partial(decode_rgb, max_pixels=cfg.max_image_pixels)
    if not train:
        row[:] = center_fit(decode(data), size, cfg.eval_fit())
    elif cfg.augment != "random_resized_crop":
        row[:] = augment_fitted(center_fit(decode(data), size), cfg, rng)
    else:
        random_resized_crop(data, size, rng, decode, cfg.max_image_pixels, out=row)
    return row


def decode_fitted(batch: dict, *, size: int, image_column: str, max_pixels: int = MAX_IMAGE_PIXELS,
                  fit: int = 0) -> dict:
    """Index rows -> {"sample_id", "pixels": uint8 [n,S,S,3] centre-fitted (center_fit: from the shorter side at
    `fit`, default S), "valid", "error"}: the rows of the
    decoded cache (data/image/image_cache.py), the deterministic part of transform_batch. An undecodable image is a
    row of zeros, not valid, with its error (the run decides with data.max_bad_samples when it reads it)."""
    return _decoded_rows(batch, size, image_column, max_pixels, views=False, fit=fit)


def decode_views(batch: dict, *, size: int, image_column: str, max_pixels: int = MAX_IMAGE_PIXELS) -> dict:
    """Index rows -> decode_fitted's rows, but each image whole, resized to size x size (bilinear, its aspect
    ratio given up), and "sizes" [n, 2]: its upright (width, height), on which crops are drawn (crop_from_view):
    the decoded cache's rows for random_resized_crop (data.cache_side)."""
    return _decoded_rows(batch, size, image_column, max_pixels, views=True)


def _decoded_rows(batch: dict, size: int, image_column: str, max_pixels: int, views: bool, fit: int = 0) -> dict:
    raw = _load_bytes(batch, image_column)
    pixels = np.zeros((len(raw), size, size, 3), dtype=np.uint8)
    sizes = np.zeros((len(raw), 2), dtype=np.int32)
    valid = np.ones(len(raw), dtype=bool)
    errors = [""] * len(raw)
    for i, data in enumerate(raw):
        img, errors[i] = decode_sample(data, batch, i, functools.partial(decode_rgb, max_pixels=max_pixels))
        if img is None:
            valid[i] = False
            continue
        sizes[i] = img.size
        pixels[i] = np.asarray(img.resize((size, size), Image.BILINEAR)) if views else center_fit(img, size, fit)
    rows = {"sample_id": batch["sample_id"], "pixels": pixels, "valid": valid, "error": np.array(errors, dtype=object)}
    return {**rows, "sizes": sizes} if views else rows


def cached_batches(images, labels: np.ndarray, indices: np.ndarray, cfg: ImageData, *, seed: int, epoch: int,
                   train: bool, batch_size: int):
    """transform_batch's batches of `indices`, in order, from decoded rows (image_cache.DecodedImages): only the
    random part (augment_fitted, from the same per-sample generator) runs here."""
    indices = np.asarray(indices, dtype=np.int64)
    for start in range(0, len(indices), batch_size):
        ids = indices[start:start + batch_size]
        pixels, valid = images.rows(ids)
        if train and cfg.augment == "random_resized_crop":  # rows are views of the whole image (decode_views)
            # (torch's thread count is left as it is: this runs beside the training step, in its process)
            views, pixels = pixels, np.empty((len(ids), cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
            for view, (w, h), s, row in zip(views, images.sizes[ids], ids, pixels):
                crop_from_view(view, w, h, cfg.image_size, sample_rng(seed, epoch, s), out=row)
        elif train and cfg.augment != "none":
            draws = np.array([crop_flip_draws(sample_rng(seed, epoch, s), cfg.crop_padding) for s in ids])
            pixels = crop_flip_batch(pixels, draws, cfg.crop_padding)
        yield {"image": pixels, "label": labels[ids], "sample_id": ids, "valid": valid}


def decode_sample(data: bytes, batch: dict, i: int, decode=None):
    """`decode(data)` of row `i` of a batch of index rows (default: decode_rgb), or (None, the message naming
    it) where its bytes are not a decodable image: the one place that decides what a bad sample is, for
    decoding every epoch and for the decoded cache (which stores it as bad for every later run)."""
    try:
        return (decode or decode_rgb)(data), ""
    except Exception as e:
        where = _describe(batch["path"][i], batch["row"][i], batch["size"][i])
        if not is_the_images_fault(e):
            e.add_note(f"(while decoding image {where}: not counted as an undecodable image)")
            raise
        return None, decode_error(where, e)


def is_the_images_fault(e: Exception) -> bool:
    """Whether a failure to decode bytes held in memory says the bytes are not an image PIL can decode (the
    same bytes fail the same way every time) rather than something of the machine's (out of memory, a failed
    system call: errno set), which a retry may not meet. PIL raises OSError without an errno for undecodable
    data (UnidentifiedImageError, truncated files, its decoders' errors but "out of memory"), SyntaxError and
    ValueError for broken structures, DecompressionBombError, and, from some plugins, EOFError, struct.error
    and IndexError."""
    import struct
    import zlib

    if isinstance(e, OSError):
        return e.errno is None and "out of memory" not in str(e)
    return isinstance(e, (ValueError, SyntaxError, EOFError, struct.error, IndexError, zlib.error,
                          Image.DecompressionBombError))


def decode_error(where: str, e: Exception) -> str:
    return (f"cannot decode image {where}: {e}. Fix or remove the file, or set data.max_bad_samples to drop up "
            f"to that many undecodable images")


def sample_rng(seed: int, epoch: int, sample_id) -> np.random.Generator:
    """The generator a sample's augmentation draws from in an epoch, wherever it is decoded or read."""
    return np.random.default_rng([seed, epoch, int(sample_id)])


def normalise(images, valid, mean, std, channels_last: bool = False):
    """uint8 [n,S,S,3] -> float32 [n,3,S,S] (contiguous, or channels_last: the NHWC bytes as they came, the
    layout a GPU's convolutions want): /255, then mean/std per channel; samples not valid are all 0. torch
    tensors on the training device, `mean` and `std` float32 [1,3,1,1] there: run by the worker on its
    device, inside the step (no copy from the host, no synchronisation)."""
    images = images.permute(0, 3, 1, 2)
    images = (images if channels_last else images.contiguous()).float()  # a layout change on uint8: 1/4 the bytes
    # in place: the same values as out of place, a quarter of the time on a CPU (64 x 224 px: 25 vs 95 ms)
    return images.div_(255.0).sub_(mean).div_(std).mul_(valid.view(-1, 1, 1, 1))


def decode_rgb(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """An encoded image as transformers' pipeline loads one (transformers.image_utils.load_image): turned
    upright by its EXIF orientation, then converted to RGB (alpha dropped, not composited), so that an exported
    model is handed the pixels it was trained on. One declaring more than `max_pixels` pixels is refused from
    its header (decode.open_bounded)."""
    img = open_bounded(data, max_pixels)
    if img.mode.startswith(("I", "F")):
        # PIL's convert clips 16-bit and float pixels to 0/255 (a 16-bit ramp came out black, then white), as
        # transformers' load_image does: refused, a bad sample, rather than trained on (or scaled here and
        # handed otherwise to the exported model)
        raise ValueError(f"a {img.mode} image (16-bit or floating-point pixels): behemoth reads 8-bit images; "
                         f"convert the dataset to 8 bits per channel")
    ImageOps.exif_transpose(img, in_place=True)
    return img.convert("RGB")


def fit_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after resizing the shorter side to `size`: the longer side is size * long / short,
    truncated, as transformers computes it (image_transforms.get_resize_output_image_size, used by both of its
    image-processor backends), so that an exported model's processor resizes to the same pixel grid."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (size, new_long) if width <= height else (new_long, size)


def center_fit(img: Image.Image, size: int, fit: int = 0) -> np.ndarray:
    """Resize the shorter side to `fit` (default `size`; bilinear, fit_size), centre-crop to size x size
    (crop_flip's base; evaluation, its `fit` ImageData.eval_fit). The exported image processor (tasks/image.py:
    save_for_transformers) repeats it."""
    fit = fit or size
    if img.size != (size, size) or fit != size:
        img = img.resize(fit_size(*img.size, fit), Image.BILINEAR)
        # the top-left corner transformers' center_crop picks: (dimension - crop) // 2
        left, top = (img.width - size) // 2, (img.height - size) // 2
        img = img.crop((left, top, left + size, top + size))
    return np.asarray(img, dtype=np.uint8)


def augment_fitted(pixels: np.ndarray, cfg: ImageData, rng: np.random.Generator) -> np.ndarray:
    """crop_flip's and none's random part, on the centre-fitted image (what the decoded cache stores)."""
    if cfg.augment == "none":
        return pixels
    top, left, flip = crop_flip_draws(rng, cfg.crop_padding)
    pad, size = cfg.crop_padding, pixels.shape[0]
    if pad:
        pixels = np.pad(pixels, ((pad, pad), (pad, pad), (0, 0)), mode="constant")[top:top + size, left:left + size]
    return pixels[:, ::-1] if flip else pixels


def crop_flip_draws(rng: np.random.Generator, pad: int) -> tuple[int, int, bool]:
    """A sample's crop offsets in its padded image and whether it is flipped, in the order drawn."""
    top, left = rng.integers(0, 2 * pad + 1, size=2) if pad else (0, 0)
    return int(top), int(left), bool(rng.random() < 0.5)


def crop_flip_batch(pixels: np.ndarray, draws: np.ndarray, pad: int) -> np.ndarray:
    """augment_fitted over a batch [n,S,S,3] at once: `draws` [n,3] of crop_flip_draws; one gather."""
    n, size = pixels.shape[:2]
    padded = np.pad(pixels, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="constant") if pad else pixels
    rows = draws[:, 0, None] + np.arange(size)
    cols = draws[:, 1, None] + np.arange(size)
    cols = np.where(draws[:, 2, None].astype(bool), cols[:, ::-1], cols)
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _load_bytes(batch: dict, image_col: str) -> list[bytes]:
    """Raw encoded bytes per sample of a batch of index rows: file contents, a tar member's bytes, or the image
    cell of a parquet row."""
    paths, rows, sizes = batch["path"], batch["row"], batch["size"]
    out: list[bytes | None] = [None] * len(paths)
    parquet_rows: dict[str, list[int]] = {}
    members: dict[str, list[int]] = {}
    for i, (path, row, size) in enumerate(zip(paths, rows, sizes)):
        if size >= 0:
            members.setdefault(str(path), []).append(i)
        elif row < 0:
            out[i] = Path(path).read_bytes()
        else:
            parquet_rows.setdefault(str(path), []).append(i)
    for path, positions in members.items():
        for i, data in zip(positions, image_shards.read_members(path, [(int(rows[i]), int(sizes[i])) for i in positions])):
            out[i] = data
    for path, positions in parquet_rows.items():
        cells = read_parquet_rows(path, [int(rows[i]) for i in positions], image_col)
        for i, cell in zip(positions, cells):
            out[i] = cell
    return out


def read_parquet_rows(path: str, rows: list[int], column: str) -> list[bytes]:
    """Read only the row groups that hold `rows`, not the whole file."""
    f = pq.ParquetFile(path)
    sizes = [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
    starts = np.cumsum([0] + sizes)
    group_of = np.searchsorted(starts, rows, side="right") - 1
    groups = sorted(set(int(g) for g in group_of))
    table = f.read_row_groups(groups, columns=[column])
    read_start = dict(zip(groups, np.cumsum([0] + [sizes[g] for g in groups[:-1]])))
    positions = [int(read_start[g] + r - starts[g]) for r, g in zip(rows, group_of)]
    cells = table.column(column).take(pa.array(positions)).to_pylist()
    return [c["bytes"] if isinstance(c, dict) else c for c in cells]


def _describe(path: str, row: int, size: int) -> str:
    if size >= 0:
        return image_shards.member_name(str(path), int(row))
    return str(path) if row < 0 else f"{path} (row {row})"


def describe_samples(table: pa.Table, sample_ids) -> list[str]:
    paths, rows, sizes = (table.column(c).to_pylist() for c in ("path", "row", "size"))
    return [_describe(paths[i], rows[i], sizes[i]) for i in sorted(int(s) for s in sample_ids)]


# ---------------------------------------------------------------------------------------------------------
# Ray Data pipelines (built on the training workers, one per rank and epoch)

# A task costs Ray ~0.2 s beyond its decoding (its output stored and its end noticed): a task of at least
# BLOCK_ROWS images keeps that to ~20 % of a 224-px task. A rank's epoch runs as windows of WINDOW_BLOCKS blocks
# (BENCHMARKS.md, the image pipeline).
BLOCK_ROWS = 512
WINDOW_BLOCKS = 4  # at least; more where the cluster has more CPUs per rank than a window of tasks would use


def rank_batches(index_table: pa.Table, indices: np.ndarray, cfg: ImageData, *, seed: int, epoch: int,
                 train: bool, batch_size: int, prefetch_batches: int = 2, device="cpu", pin_memory: bool = False,
                 world: int = 1):
    """Torch batches of index rows `indices`, in that order, decoded and augmented by Ray Data CPU tasks: one
    Ray Dataset per window of the rows (rank_windows), the next window's tasks running while this one's batches
    are taken (a prefetch.Chain: its `all_opened` says when the last window has been opened). On GPU, batches
    are pinned and copied to the device in Ray Data's iterator threads."""
    from behemoth.data.prefetch import Chain

    windows = rank_windows(index_table, indices, cfg, seed=seed, epoch=epoch, train=train, batch_size=batch_size,
                           window_blocks=window_blocks(cfg, world))
    return Chain([window_opener(ds, batch_size, prefetch_batches, device, pin_memory) for ds in windows])


def window_opener(ds, batch_size: int, prefetch_batches: int, device, pin_memory: bool):
    return lambda: iter(ds.iter_torch_batches(batch_size=batch_size, prefetch_batches=prefetch_batches,
                                              device=device, pin_memory=pin_memory))


def window_blocks(cfg: ImageData, world: int) -> int:
    """Blocks per window: enough that each rank's share of the cluster's CPUs has a task to run (ranks x
    window blocks x cpus_per_task >= the cluster's CPUs), at least WINDOW_BLOCKS."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 0) if ray.is_initialized() else 0
    return max(WINDOW_BLOCKS, math.ceil(cpus / max(world, 1) / cfg.cpus_per_task))


def rank_windows(index_table: pa.Table, indices: np.ndarray, cfg: ImageData, *, seed: int, epoch: int,
                 train: bool, batch_size: int, window_blocks: int = WINDOW_BLOCKS) -> list:
    """Ray Datasets over consecutive windows of index rows `indices`, in that order, decoded by CPU tasks.

    Each window is `window_blocks` blocks of BLOCK_ROWS rows or more (a whole number of batches), whose tasks are
    submitted at once and run as the CPUs allow; `preserve_order` keeps their output in the order given, which
    exact resume depends on. Ray Data's per-operator CPU reservation is off for them: it held a pipeline of
    one operator to about one running task on 2 CPUs (one decode task every 0.8 s at an epoch's start), and
    what bounds the memory is the window instead (per open epoch pipeline at most two windows of decoded
    images: the one read and the one opened ahead). The first window is one block of one batch, so that the
    epoch's first step waits for as little as it can: Ray Data's iterator (with prefetch_batches > 0) yields a
    block only once the next block of its dataset is done, so in a window of its own that block is not held
    back for a BLOCK_ROWS-image task (it was: ~2 s of each epoch's start on 2 cores, BENCHMARKS.md).
    """
    import ray.data

    ordered_data_context(logging.WARNING)
    rows = index_table.take(pa.array(indices, type=pa.int64()))
    first = max(batch_size, 1)
    block = first * max(4, -(-BLOCK_ROWS // first))
    # block boundaries: one batch, then whole blocks; that first block a window of its own, then windows of
    # window_blocks blocks
    edges = [0, *range(first, rows.num_rows, block), rows.num_rows]
    blocks = [rows.slice(a, b - a) for a, b in zip(edges, edges[1:])] or [rows]
    windows = []
    for part in [blocks[:1], *(blocks[w:w + window_blocks] for w in range(1, len(blocks), window_blocks))]:
        # from_blocks, not from_arrow: from_arrow reads each block's metadata in a remote task that asks for a
        # whole CPU, which never runs while the training workers hold all but a fraction of every node's CPUs
        # (a sweep's fractional-CPU trials), so the pipeline would hang. from_blocks computes it here, and
        # keeps the blocks as given.
        ds = ray.data.from_blocks(part).map_batches(
            transform_batch, batch_format="numpy", batch_size=None, num_cpus=cfg.cpus_per_task,
            fn_kwargs=dict(cfg=cfg, seed=seed, epoch=epoch, train=train))
        ds.context.op_resource_reservation_enabled = False  # the dataset's own copy of the context
        windows.append(ds)
    return windows
