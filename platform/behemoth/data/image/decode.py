"""The random-resized-crop of one encoded image at the per-core limit (ImageNet's training transform).

A plain loop pays, per 500x375 JPEG: PIL's decode (~1.2 ms here), a full-size copy in `convert("RGB")`
(~0.3 ms), and PIL's scalar bilinear resize of the crop (~0.7 ms). This module pays less for the same crop:

- JPEGs are decoded by libjpeg-turbo through simplejpeg (the same library PIL uses, the same pixels, bit for
  bit, without PIL's chunked Python read loop: ~15 % less), straight to RGB (grey included), no copy after;
- where the crop is at least twice the output on both sides, the JPEG is decoded at 1/2, 1/4 or 1/8 scale in
  the DCT (libjpeg's scaled IDCT: the crop then resamples a smaller image of the same view);
- the crop is resized by torch's antialiased bilinear kernel for uint8 (vectorised; PIL's filter, within a
  level or so of its values inside the crop; at the crop's edges PIL also reads pixels outside the box),
  written straight into the batch's HWC row where the caller gives one (`out`): no transposing copy after;
- EXIF orientation is read only where the file carries an Exif segment.

Every decode is bounded: an image whose header declares more than data.max_image_pixels pixels is refused
(`bounded`: Pillow's DecompressionBombError, a bad sample like any other) before a decoder allocates for it, on
libjpeg-turbo's path from simplejpeg's header, on PIL's (`open_bounded`) from the header Image.open reads.

Anything simplejpeg does not decode (PNG, CMYK JPEGs, damaged files) goes through PIL
(image_batches.decode_rgb), whose verdict on a bad image is the one that counts. The crop's draws are those of
the PIL path before this module (area, ratio, up to 10 tries, offsets, then torchvision's fallback; then the
flip), from the sample's own
generator: the same sample gets the same crop in the same epoch wherever it is decoded, so resumed runs are
exact.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import numpy as np

MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3  # Pillow's default Image.MAX_IMAGE_PIXELS: 89,478,485
_EXIF_ORIENTATION = 0x0112
_SOI = b"\xff\xd8"


def random_resized_crop(data: bytes, size: int, rng: np.random.Generator, decode_pil,
                        max_pixels: int = MAX_IMAGE_PIXELS, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [size, size, 3]: an Inception-style crop (area 8-100 %, aspect ratio 3/4-4/3, log-uniform; after 10
    misses torchvision's fallback: _crop_box) of the upright image, resized to size x size, flipped left-right
    with probability 1/2. `decode_pil(data)` is the fallback
    decoder: an upright RGB PIL image, or the error that makes the sample a bad one (bounded by the same
    `max_pixels` as this path). With `out` (uint8 [size, size, 3], C-contiguous, e.g. a row of a batch), the
    pixels are written there and `out` is returned."""
    header = _jpeg_header(data)
    if header is None:
        pixels = np.asarray(decode_pil(data))
        return _resize_flip(pixels, _crop_box(pixels.shape[1], pixels.shape[0], rng), 1, size, rng, out)
    width, height, orientation = header
    # before the decode: libjpeg allocates for the whole declared image (a progressive one's coefficients
    # too, whatever the DCT scale) before it finds the data a few bytes long
    bounded(width, height, max_pixels)
    upright_w, upright_h = (height, width) if orientation >= 5 else (width, height)
    box = _crop_box(upright_w, upright_h, rng)
    scale = _dct_scale(box, size)
    try:
        pixels = _decode_jpeg(data, width, height, scale)
    except ValueError:  # damaged, or a colour space simplejpeg leaves to PIL: PIL decides, at full scale
        pixels, scale = np.asarray(decode_pil(data)), 1
    else:
        pixels = _upright(pixels, orientation)
    return _resize_flip(pixels, box, scale, size, rng, out)


def bounded(width: int, height: int, max_pixels: int) -> None:
    """Pillow's DecompressionBombError (a bad sample: image_batches.is_the_images_fault) where an image's header
    declares more than `max_pixels` (data.max_image_pixels) pixels."""
    if width * height > max_pixels:
        from PIL import Image

        raise Image.DecompressionBombError(
            f"its header declares {width} x {height} = {width * height:,} pixels, over data.max_image_pixels "
            f"{max_pixels:,} (a decompression bomb; raise data.max_image_pixels if the image is real)")


def open_bounded(data: bytes, max_pixels: int):
    """Image.open of `data` (the header read, no pixel decoded), refused by `bounded` where it is too large.
    Pillow's own bound (Image.MAX_IMAGE_PIXELS, checked at open) is raised to `max_pixels` where that is
    larger, so that the job's bound is the one that counts; its warning between 1 and 2 times its bound is
    silenced: this check decides."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:  # over twice Pillow's bound, so over the job's too
            raise Image.DecompressionBombError(f"{e} (over data.max_image_pixels {max_pixels:,}; raise it if the "
                                               f"image is real)") from None
    bounded(img.width, img.height, max_pixels)
    return img


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread while a batch's crops are resized: one 224-px resize is far too small to share
    (measured: 2 threads halve a task's rate on 2 cores); the count is put back after."""
    import torch

    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def crop_from_view(view: np.ndarray, width: int, height: int, size: int, rng: np.random.Generator,
                   out: np.ndarray | None = None) -> np.ndarray:
    """random_resized_crop's uint8 [size, size, 3] from a stored view of the whole image (uint8 [S, S, 3], the
    upright image of `width` x `height` resized to S x S): the crop is drawn on the original size with the same
    draws, mapped onto the view, resized, flipped as drawn (into `out` where given)."""
    box = _crop_box(width, height, rng)
    s = view.shape[0]
    left, top, cw, ch = box
    scaled = (round(left * s / width), round(top * s / height), round(cw * s / width), round(ch * s / height))
    return _resize_flip(view, scaled, 1, size, rng, out)


def _crop_box(w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, width, height) of the crop in the upright image; after 10 misses torchvision's fallback: the
    largest centred crop whose aspect ratio is the image's clamped to 3/4-4/3 (squashed to a square by the
    resize). Centre-fitting a square there instead kept a 4:1 image's middle quarter, not its middle third."""
    for _ in range(10):
        area = w * h * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = int(round(np.sqrt(area * ratio))), int(round(np.sqrt(area / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
            return int(left), int(top), cw, ch
    if w / h < 3 / 4:
        cw, ch = w, int(round(w / (3 / 4)))
    elif w / h > 4 / 3:
        cw, ch = int(round(h * (4 / 3))), h
    else:
        cw, ch = w, h
    return (w - cw) // 2, (h - ch) // 2, cw, ch


def _dct_scale(box: tuple[int, int, int, int], size: int) -> int:
    """The largest of 8, 4, 2 by which the crop can shrink and stay at least `size` on both sides (else 1)."""
    short = min(box[2], box[3])
    for k in (8, 4, 2):
        if short >= k * size:
            return k
    return 1


def _decode_jpeg(data: bytes, width: int, height: int, scale: int) -> np.ndarray:
    import simplejpeg

    if scale == 1:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    # the smallest of libjpeg's scaling factors giving at least these sizes: exactly 1/scale
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=math.ceil(height / scale),
                                  min_width=math.ceil(width / scale))


def _resize_flip(pixels: np.ndarray, box, scale: int, size: int, rng: np.random.Generator,
                 out: np.ndarray | None = None) -> np.ndarray:
    import torch

    # the box's edges on the reduced grid, each rounded (its sides rounded apart moved the far edges by up to
    # `scale` pixels of the full image)
    left, top = round(box[0] / scale), round(box[1] / scale)
    cw, ch = round((box[0] + box[2]) / scale) - left, round((box[1] + box[3]) / scale) - top
    h, w = pixels.shape[:2]
    left, top = min(left, w - 1), min(top, h - 1)
    crop = pixels[top:top + max(ch, 1), left:left + max(cw, 1)]
    flip = rng.random() < 0.5  # drawn after the crop, as image_batches._transformed draws it
    # torch.from_numpy shares the array's memory, and warns (once per process, from every decode task) where it is
    # read-only: PIL's np.asarray, the decoded cache's memory map. A crop narrower than the image is copied to
    # make it contiguous anyway; only a full-width crop of read-only pixels costs a copy here (of the crop alone)
    x = torch.from_numpy(np.require(crop, requirements=("C", "W"))).permute(2, 0, 1)[None]
    out = np.empty((size, size, 3), dtype=np.uint8) if out is None else out
    target = torch.from_numpy(out)
    # interpolate's antialiased bilinear kernel for uint8 (F.interpolate's, the same values) written straight
    # into HWC memory, which it works in: interpolate's channels-first result and the transposing copy back to
    # HWC cost 3x as much at 224 px (BENCHMARKS.md, the pipeline on fast cores)
    resized = torch.empty_like(target) if flip else target
    torch.ops.aten._upsample_bilinear2d_aa.out(x, [size, size], False, None, None,
                                               out=resized.permute(2, 0, 1)[None])
    if flip:
        target.copy_(resized.flip(1))
    return out


def _jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, EXIF orientation 1-8) of a JPEG simplejpeg decodes to RGB (YCbCr or grey), or None."""
    if not data.startswith(_SOI):
        return None
    import simplejpeg

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("YCbCr", "Gray"):
        return None  # CMYK, YCCK: PIL's conversion, as before
    return width, height, _orientation(data)


def _orientation(data: bytes) -> int:
    """The EXIF orientation (1: upright), read by PIL only where an Exif segment is in the file's head."""
    head = data[:65536]
    if b"Exif\x00\x00" not in head and b"tiff:Orientation" not in head:  # (PIL reads XMP's too)
        return 1
    from PIL import Image

    try:
        value = Image.open(io.BytesIO(data)).getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - an unreadable Exif block: PIL's exif_transpose ignores it too
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _upright(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """The decoded (stored) pixels turned as EXIF's orientation says (PIL's ImageOps.exif_transpose)."""
    if orientation == 1:
        return pixels
    ops = {2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
           5: lambda a: a.transpose(1, 0, 2), 6: lambda a: np.rot90(a, -1),
           7: lambda a: a[::-1, ::-1].transpose(1, 0, 2), 8: lambda a: np.rot90(a, 1)}
    return ops[orientation](pixels)
