"""The random-resized-crop at the per-core limit (data/image/decode.py): libjpeg-turbo's decode, scaled decoding for
large crops, EXIF orientation, and PIL's verdict for everything else, against PIL's own reading of the file."""

import io
import re

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, ImageOps

from behemoth.data.image import decode
from behemoth.data.image.image_batches import decode_rgb, transform_batch
from behemoth.data.image.images import ImageData
from behemoth.errors import BadSampleError


def photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth colour gradients plus noise: content whose resized crops differ where the crop is wrong."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], axis=-1)
    img += 40 * np.sin(x[..., None] / 40 + np.arange(3)) + rng.normal(0, 6, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, orientation: int = 1, mode: str = "RGB") -> bytes:
    img = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(out, "JPEG", quality=95, exif=exif.tobytes() if orientation != 1 else b"")
    return out.getvalue()


def reference(data: bytes, size: int, seed: int) -> np.ndarray:
    """The same draws applied to PIL's full-size upright RGB decode (no DCT scaling)."""
    upright = np.asarray(decode_rgb(data))
    rng = np.random.default_rng(seed)
    box = decode._crop_box(upright.shape[1], upright.shape[0], rng)
    return decode._resize_flip(upright, box, 1, size, rng)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_the_image_as_pil_does(orientation):
    pixels = photo(48, 32)
    data = jpeg(pixels, orientation)
    assert decode._orientation(data) == orientation
    stored = decode._decode_jpeg(data, 48, 32, 1)
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    np.testing.assert_array_equal(decode._upright(stored, orientation), want)
    # the whole crop: equal to PIL's upright decode with the same draws
    for seed in range(5):
        got = decode.random_resized_crop(data, 16, np.random.default_rng(seed), decode_rgb)
        np.testing.assert_array_equal(got, reference(data, 16, seed))


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_full_scale_crops_equal_pils_decode_with_the_same_draws(mode):
    """A crop under twice the output is decoded at full scale: libjpeg-turbo's pixels are PIL's, bit for bit."""
    data = jpeg(photo(120, 90), mode=mode)
    for seed in range(20):
        got = decode.random_resized_crop(data, 64, np.random.default_rng(seed), decode_rgb)
        assert got.shape == (64, 64, 3) and got.dtype == np.uint8
        np.testing.assert_array_equal(got, reference(data, 64, seed))


def test_large_crops_decode_at_reduced_scale_and_stay_close():
    """A crop at least twice the output on both sides is decoded at 1/2, 1/4 or 1/8 scale: the same view,
    resampled from fewer pixels (close to the full-scale crop, not equal)."""
    data = jpeg(photo(640, 480))
    scales, diffs = [], []
    for seed in range(30):
        size = (40, 64, 100)[seed % 3]
        scales.append(decode._dct_scale(decode._crop_box(640, 480, np.random.default_rng(seed)), size))
        got = decode.random_resized_crop(data, size, np.random.default_rng(seed), decode_rgb)
        diffs.append(np.abs(got.astype(int) - reference(data, size, seed).astype(int)).mean())
    assert {2, 4, 8} <= set(scales)
    assert max(diffs) < 3.0, diffs  # mean absolute difference in levels of 255 (measured: at most ~2)


def test_a_crop_decoded_at_reduced_scale_keeps_the_windows_edges():
    """The box's sides were each rounded onto the reduced grid, so its far edges moved by up to `scale` pixels of
    the full image (a window of 14..1185 read as 16..1188 at 1/4). Its edges are rounded now: on a grid where a
    pixel holds its own column, the crop (at its own size: no resampling) starts and ends at the rounded edges."""
    columns = np.arange(400)
    pixels = np.stack(np.broadcast_arrays(columns % 256, columns // 256, 0 * columns), -1)[None].repeat(400, 0)
    box = (14, 14, 1171, 1171)  # full-scale pixels: columns 14..1184, on the 1/4 grid 3.5..296.25
    size = round(1185 / 4) - round(14 / 4)
    out = decode._resize_flip(pixels.astype(np.uint8), box, 4, size, np.random.default_rng(0))
    seen = out[0, :, 0].astype(int) + 256 * out[0, :, 1].astype(int)
    assert sorted([seen[0], seen[-1]]) == [round(14 / 4), round(1185 / 4) - 1]


def test_an_orientation_given_in_xmp_alone_turns_the_training_crop_as_it_turns_evaluation():
    """PIL reads the orientation from XMP's tiff:Orientation where the JPEG has no Exif segment (evaluation,
    the cache, the export): the fast path looked for Exif only, and drew training crops on the image lying on
    its side."""
    xmp = (b'<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?><x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF '
           b'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description rdf:about="" '
           b'xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
           b'<?xpacket end="w"?>')
    out = io.BytesIO()
    Image.fromarray(photo(120, 80)).save(out, "JPEG", quality=95, xmp=xmp)
    data = out.getvalue()
    assert decode_rgb(data).size == (80, 120) and decode._jpeg_header(data) == (120, 80, 6)
    for seed in range(5):
        np.testing.assert_array_equal(decode.random_resized_crop(data, 64, np.random.default_rng(seed), decode_rgb),
                                      reference(data, 64, seed))  # (crops under 2 x 64: decoded at full scale)


@pytest.mark.parametrize("mode", ["I;16", "F"])
def test_a_16_bit_or_float_image_is_a_bad_sample_not_pixels_clipped_to_black_and_white(mode):
    """PIL's convert("RGB") clips 16-bit and float pixels to 0 or 255 (a 16-bit ramp decoded as 0, 255, 255,
    ...; 0.5 as black), silently, on every path: refused as undecodable, naming the mode."""
    from behemoth.data.image.image_batches import is_the_images_fault

    ramp = np.linspace(0, 65535 if mode == "I;16" else 1.0, 64 * 8).reshape(8, 64)
    img = Image.fromarray(ramp.astype(np.uint16 if mode == "I;16" else np.float32))
    out = io.BytesIO()
    img.save(out, "PNG" if mode == "I;16" else "TIFF")
    with pytest.raises(ValueError, match=f"a {re.escape(img.mode)} image .* convert the dataset to 8 bits") as raised:
        decode_rgb(out.getvalue())
    assert is_the_images_fault(raised.value)  # (a bad sample under data.max_bad_samples)


def test_after_ten_missed_draws_the_crop_is_torchvisions_fallback():
    """No crop fitted in 10 draws (likely on a 4:1 image): torchvision takes the largest centred crop whose
    ratio is the image's clamped to 3/4-4/3 and squashes it to the output; behemoth centre-fitted a square (a
    4:1 image's middle quarter, not its middle third). Now torchvision's box, on every path (the fast path,
    PIL's, a decoded cache's views)."""
    def missed_ten(w, h):
        for seed in range(1000):
            rng = np.random.default_rng(seed)
            for _ in range(10):
                area, ratio = w * h * rng.uniform(0.08, 1.0), np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
                if 0 < round(np.sqrt(area * ratio)) <= w and 0 < round(np.sqrt(area / ratio)) <= h:
                    break
            else:
                return seed
        raise AssertionError("every seed fitted a crop")

    for (w, h), box in (((1000, 250), (333, 0, 333, 250)), ((250, 1000), (0, 333, 250, 333))):
        seed = missed_ten(w, h)
        assert decode._crop_box(w, h, np.random.default_rng(seed)) == box
        data = jpeg(photo(w, h))
        # (at 128 px the fallback's 250-px side is under twice the output: decoded at full scale, bit for bit)
        np.testing.assert_array_equal(decode.random_resized_crop(data, 128, np.random.default_rng(seed), decode_rgb),
                                      reference(data, 128, seed))


def test_what_libjpeg_turbo_leaves_goes_to_pil():
    """PNG and CMYK JPEGs are PIL's to decode; a damaged JPEG is PIL's to refuse (a bad sample), a JPEG that
    PIL reads is never dropped because libjpeg-turbo was strict."""
    pixels = photo(40, 30)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    cmyk = jpeg(pixels, mode="CMYK")
    for data in (png.getvalue(), cmyk):
        for seed in range(5):
            got = decode.random_resized_crop(data, 16, np.random.default_rng(seed), decode_rgb)
            np.testing.assert_array_equal(got, reference(data, 16, seed))
    good = jpeg(pixels)
    table = pa.table({"sample_id": [0, 1], "path": ["a.jpg", "b.jpg"], "row": [-1, -1], "label": [0, 0],
                      "size": [-1, -1]})
    batch = {k: np.asarray(v) for k, v in table.to_pydict().items()}
    cfg = ImageData(root="unused", image_size=16, augment="random_resized_crop")
    from behemoth.data.image import image_batches

    raw = {"a.jpg": good, "b.jpg": good[: len(good) // 2]}  # b: cut in half
    original = image_batches._load_bytes
    image_batches._load_bytes = lambda b, col: [raw[p] for p in b["path"]]
    try:
        with pytest.raises(BadSampleError, match="cannot decode image b.jpg"):
            transform_batch(batch, cfg=cfg, seed=0, epoch=0, train=True)
    finally:
        image_batches._load_bytes = original


def test_a_plain_jpeg_never_reaches_pil():
    """The fast path is the one taken for an ordinary JPEG (no Exif): PIL's decoder is never asked."""
    data = jpeg(photo(200, 150))

    def no_pil(_):
        raise AssertionError("PIL decoded a plain JPEG")

    for seed in range(10):
        assert decode.random_resized_crop(data, 32, np.random.default_rng(seed), no_pil).shape == (32, 32, 3)


def test_read_only_pixels_reach_torch_without_its_not_writable_warning(tmp_path):
    """Issue 65 item 10: every decode task of a random-resized-crop run printed torch's "The given NumPy array is
    not writable" (torch.from_numpy over PIL's read-only array, or the decoded cache's memory map, where the crop
    spans the image's width). torch warns once per process: a fresh interpreter, warnings as errors, runs the
    PIL path, the cache's view path and a full-width crop of read-only pixels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import io, numpy as np
from PIL import Image
from behemoth.data.image import decode
from behemoth.data.image.image_batches import decode_rgb
pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
png = io.BytesIO(); Image.fromarray(pixels).save(png, "PNG")
view = np.lib.format.open_memmap("view.npy", mode="w+", shape=(24, 24, 3), dtype=np.uint8)
view[:] = 7; del view
view = np.load("view.npy", mmap_mode="r")  # read-only, as the decoded cache's rows
for seed in range(40):
    decode.random_resized_crop(png.getvalue(), 16, np.random.default_rng(seed), decode_rgb)
    decode.crop_from_view(view, 40, 30, 16, np.random.default_rng(seed))
whole = np.asarray(Image.fromarray(pixels))
assert not whole.flags.writeable
out = decode._resize_flip(whole, (0, 0, 40, 30), 1, 16, np.random.default_rng(0))
assert out.shape == (16, 16, 3)
print("ok")
"""
    platform = str(Path(decode.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([platform, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def bomb_jpeg(side: int, progressive: bool = True) -> bytes:
    """A real 16 x 16 JPEG whose frame header (SOF) is patched to declare side x side: ~500 bytes."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, "JPEG", progressive=progressive)
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc2" if progressive else b"\xff\xc0")
    data[sof + 5:sof + 9] = side.to_bytes(2, "big") * 2  # height, width
    return bytes(data)


def files_batch(tmp_path, named: dict) -> dict:
    paths = []
    for name, data in named.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    n = len(paths)
    return {"sample_id": np.arange(n), "path": np.array(paths, dtype=object), "row": np.full(n, -1),
            "label": np.zeros(n, dtype=np.int64), "size": np.full(n, -1)}


def with_peak_rss_growth(fn, *args, **kwargs):
    """(fn(*args, **kwargs), how far it raised this process's peak resident memory, in MB)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn(*args, **kwargs)
    return out, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def test_a_jpeg_declaring_gigapixels_is_a_bad_sample_refused_before_any_decoder_allocates(tmp_path):
    """Issue 65 item 4: a ~500-byte progressive JPEG declaring 16000 x 16000 made libjpeg (simplejpeg) take
    ~750 MB before anything compared its size with a bound; one declaring 10000 x 10000 (over Pillow's bound,
    under its error at twice that) was decoded by PIL's path. Both are now bad samples from their headers:
    counted and dropped under data.max_bad_samples, named otherwise, with no allocation for their pixels."""
    from behemoth.data.image.image_batches import decode_fitted, decode_views

    assert ImageData(root="unused").max_image_pixels == Image.MAX_IMAGE_PIXELS == decode.MAX_IMAGE_PIXELS
    batch = files_batch(tmp_path, {"good.jpg": jpeg(photo(40, 30)), "bomb.jpg": bomb_jpeg(16000),
                                   "big.jpg": bomb_jpeg(10000, progressive=False)})
    for augment, train in (("random_resized_crop", True), ("crop_flip", True), ("none", False)):
        c = ImageData(root="unused", image_size=16, augment=augment, max_bad_samples=2)
        out, grew = with_peak_rss_growth(transform_batch, batch, cfg=c, seed=0, epoch=0, train=train)
        assert out["valid"].tolist() == [True, False, False] and grew < 150, (augment, grew)
        # (PIL's path: Pillow's own check at open refuses it first, above twice its bound; the key is named)
        with pytest.raises(BadSampleError, match=r"cannot decode image .*bomb.jpg: (its header declares 16000 x "
                                                 r"16000 = 256,000,000 pixels, over|Image size \(256000000 pixels\) "
                                                 r".* \(over) data.max_image_pixels 89,478,485"):
            transform_batch(batch, cfg=ImageData(root="unused", image_size=16, augment=augment), seed=0, epoch=0,
                            train=train)
    for rows in (decode_fitted, decode_views):  # the decoded cache's build: stored as bad, with the reason
        out, grew = with_peak_rss_growth(rows, batch, size=16, image_column="image")
        assert out["valid"].tolist() == [True, False, False] and grew < 150
        assert "10000 x 10000 = 100,000,000 pixels, over data.max_image_pixels 89,478,485" in out["error"][2]


def test_max_image_pixels_is_the_bound_on_every_path_both_ways(tmp_path, monkeypatch):
    """data.max_image_pixels bounds libjpeg-turbo's path and PIL's alike, lower than Pillow's or higher (Pillow's
    own check at open does not refuse what the job allows); 0 or less is a config error."""
    from behemoth.data.image.image_batches import decode_fitted
    from behemoth.errors import ConfigError

    png = io.BytesIO()
    Image.fromarray(photo(40, 30)).save(png, "PNG")
    batch = files_batch(tmp_path, {"a.jpg": jpeg(photo(40, 30)), "b.png": png.getvalue()})
    for augment in ("random_resized_crop", "crop_flip"):
        low = ImageData(root="unused", image_size=16, augment=augment, max_bad_samples=2, max_image_pixels=1199)
        assert transform_batch(batch, cfg=low, seed=0, epoch=0, train=True)["valid"].tolist() == [False, False]
        exact = ImageData(root="unused", image_size=16, augment=augment, max_image_pixels=1200)
        assert transform_batch(batch, cfg=exact, seed=0, epoch=0, train=True)["valid"].tolist() == [True, True]
    assert decode_fitted(batch, size=16, image_column="image", max_pixels=1199)["valid"].tolist() == [False, False]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow's own bound, far below the job's
    assert decode_fitted(batch, size=16, image_column="image", max_pixels=1200)["valid"].tolist() == [True, True]
    for bad in (0, -1, True):
        with pytest.raises(ConfigError, match="data.max_image_pixels must be a number of pixels > 0"):
            ImageData(root="unused", max_image_pixels=bad).validate()


def interpolate_then_flip(crop: np.ndarray, size: int, flip: bool) -> np.ndarray:
    """The resize as it was: F.interpolate's channels-first result, moved back to HWC, flipped by numpy."""
    import torch
    from torch.nn.functional import interpolate

    x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1)[None]
    out = interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    out = out.permute(1, 2, 0).numpy()
    return out[:, ::-1] if flip else out


def test_the_resize_written_into_hwc_memory_equals_interpolate_and_flip_bit_for_bit():
    """The pipeline on fast cores (issue 74 item 4): the crop is resized by the antialiased uint8 kernel straight
    into the batch's HWC row (and flipped by torch) instead of interpolate's channels-first result copied back;
    the pixels are F.interpolate's, bit for bit: up and down, odd shapes, both flips, read-only input, a row of a
    batch."""
    rng = np.random.default_rng(0)
    image = photo(173, 131, seed=3)
    image.flags.writeable = False
    batch = np.zeros((3, 37, 37, 3), dtype=np.uint8)
    for seed in range(40):
        box = (int(rng.integers(0, 60)), int(rng.integers(0, 40)), int(rng.integers(5, 113)), int(rng.integers(5, 91)))
        size = int(rng.choice([16, 37, 120]))
        draws = np.random.default_rng(seed)
        flip = draws.random() < 0.5  # _resize_flip's one draw
        want = interpolate_then_flip(image[box[1]:box[1] + box[3], box[0]:box[0] + box[2]], size, flip)
        got = decode._resize_flip(image, box, 1, size, np.random.default_rng(seed))
        np.testing.assert_array_equal(got, want)
        if size == 37:
            row = batch[seed % 3]
            assert decode._resize_flip(image, box, 1, size, np.random.default_rng(seed), out=row) is row
            np.testing.assert_array_equal(batch[seed % 3], want)


def test_random_resized_crop_into_a_row_is_the_same_crop():
    data = jpeg(photo(120, 90, seed=1))
    rows = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    for seed in range(10):
        want = decode.random_resized_crop(data, 32, np.random.default_rng(seed), decode_rgb)
        got = decode.random_resized_crop(data, 32, np.random.default_rng(seed), decode_rgb, out=rows[1])
        assert got is rows[1] or np.shares_memory(got, rows)
        np.testing.assert_array_equal(rows[1], want)
    assert not rows[0].any()


def test_a_decode_task_refills_its_last_output_only_once_nothing_holds_it(tmp_path):
    """A decode task's images go into the array its process's last task returned (fresh memory costs page
    faults a task on a VM whose host takes back freed pages), but never while anything still holds it: a batch
    kept (a block not yet stored, a view, a tensor) keeps its pixels."""
    import torch

    from behemoth.data.image.image_batches import task_output

    photos = {f"{i}.jpg": jpeg(photo(60 + 7 * i, 50, seed=i)) for i in range(4)}
    batch = files_batch(tmp_path, photos)
    c = ImageData(root="unused", image_size=24, augment="random_resized_crop")
    first = transform_batch(batch, cfg=c, seed=0, epoch=0, train=True)
    kept = first["image"].copy()
    view, tensor = first["image"][1:], torch.from_numpy(first["image"])
    del first
    second = transform_batch(batch, cfg=c, seed=0, epoch=1, train=True)  # other crops, while a view is held
    assert not np.shares_memory(second["image"], view)
    np.testing.assert_array_equal(view, kept[1:])
    np.testing.assert_array_equal(tensor.numpy(), kept)
    assert not np.array_equal(second["image"], kept)
    address = second["image"].__array_interface__["data"][0]
    del second
    third = transform_batch(batch, cfg=c, seed=0, epoch=0, train=True)
    assert third["image"].__array_interface__["data"][0] == address  # refilled: nothing held it
    np.testing.assert_array_equal(third["image"], kept)  # and the same pixels as a fresh array's
    del third
    fewer = task_output(2, 24)  # fewer rows: the first rows of the same memory
    assert fewer.shape == (2, 24, 24, 3) and fewer.__array_interface__["data"][0] == address
    del fewer
    other = task_output(2, 25)  # another size: a new array of it
    assert other.shape == (2, 25, 25, 3) and other.__array_interface__["data"][0] != address


def test_threads_of_one_process_never_share_a_decode_tasks_output(monkeypatch):
    """task_output's check and the view that holds the array are taken under one lock: two threads asking at once
    (the check made slow, so that both are inside it together) get memory no other holds."""
    import sys
    import threading
    import time
    from types import SimpleNamespace

    from behemoth.data.image import image_batches

    def slow_getrefcount(obj):
        count = sys.getrefcount(obj) - 1  # (less this frame's own reference)
        time.sleep(0.05)  # the other thread reaches the check meanwhile
        return count

    image_batches.task_output(4, 8)  # kept, held by nothing now
    monkeypatch.setattr(image_batches, "sys", SimpleNamespace(getrefcount=slow_getrefcount))
    got, start = [], threading.Barrier(2)

    def take():
        start.wait()
        got.append(image_batches.task_output(4, 8))

    threads = [threading.Thread(target=take) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(got) == 2 and not np.shares_memory(got[0], got[1])
