"""The exported image processor repeats behemoth's validation preprocessing (issue 34): on images that are not
already square at data.image_size, transformers (its pipeline and the processor `behemoth export` writes) hands
the model the pixels behemoth evaluated, so the logits and every top-1 agree. No Ray: a model built from the
config, the processor written by the task's own save function, generated images."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from behemoth.job import config_from_dict
from behemoth.data.image.image_batches import fit_size, normalise, transform_batch
from behemoth.tasks.image import ImageClassification, build_image_model
from conftest import job_dict

CLASSES = [f"c{i}" for i in range(10)]


def write_images(folder, rng, size: int) -> list[str]:
    """Noise images (resampling differences show at full strength) of random non-square sizes, larger and
    smaller than `size`: PNG in RGB, L and half-transparent RGBA, JPEG in RGB and L, and a JPEG whose EXIF
    orientation says 'rotate 90'."""
    paths = []
    for i in range(30):
        w, h = (int(v) for v in rng.integers(size // 3, 5 * size, size=2))
        mode, fmt = [("RGB", "PNG"), ("L", "PNG"), ("RGBA", "PNG"), ("RGB", "JPEG"), ("L", "JPEG")][i % 5]
        channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
        pixels = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
        if mode == "RGBA":
            pixels[..., 3] = rng.integers(0, 256, size=(h, w))
        img = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
        paths.append(str(folder / f"{i:02d}_{w}x{h}.{fmt.lower()}"))
        img.save(paths[-1], fmt)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: shown rotated 90 degrees clockwise
    rotated = Image.fromarray(rng.integers(0, 256, size=(size + 7, 2 * size + 3, 3), dtype=np.uint8))
    paths.append(str(folder / "exif_rotated.jpg"))
    rotated.save(paths[-1], "JPEG", exif=exif)
    return paths


def behemoth_side(cfg, paths: list[str]) -> np.ndarray:
    """behemoth's validation pixels (normalised, [n, 3, S, S]) for these files, as its workers compute them."""
    n = len(paths)
    batch = {"sample_id": np.arange(n), "path": np.asarray(paths, dtype=object), "row": np.full(n, -1),
             "label": np.zeros(n, dtype=np.int64), "size": np.full(n, -1)}
    out = transform_batch(batch, cfg=cfg.data, seed=0, epoch=0, train=False)
    assert out["valid"].all()
    mean, std = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in (cfg.data.mean, cfg.data.std))
    return normalise(torch.from_numpy(out["image"]), torch.from_numpy(out["valid"]), mean, std).numpy()


@pytest.fixture(scope="module", params=[None, 0.875], ids=["fit", "eval_crop_pct"])
def exported(tmp_path_factory, request):
    """A model built from a demo-like config (32 px), saved as `behemoth export` saves one, and the images; with
    data.eval_crop_pct left out (the shorter side resized to 32) and at 0.875 (to 36, then the centre 32)."""
    folder = tmp_path_factory.mktemp("export_parity")
    cfg = config_from_dict(job_dict(folder, folder, data={"image_size": 32, "eval_crop_pct": request.param}))
    torch.manual_seed(0)
    model = build_image_model(cfg, CLASSES).to_transformers(CLASSES).eval()
    out = folder / "export"
    model.save_pretrained(out)
    ImageClassification.save_for_transformers(cfg, out)
    images = folder / "images"
    images.mkdir()
    return cfg, model, out, write_images(images, np.random.default_rng(0), cfg.data.image_size)


def test_the_exported_processor_gives_behemoths_pixels_logits_and_top1(exported):
    from transformers import AutoImageProcessor, pipeline
    from transformers.image_utils import load_image

    cfg, model, out, paths = exported
    ours = behemoth_side(cfg, paths)
    processor = AutoImageProcessor.from_pretrained(out, backend="pil")
    assert processor.size["shortest_edge"] == {1.0: 32, 0.875: 36}[cfg.data.eval_crop_pct]
    theirs = processor([load_image(p) for p in paths], return_tensors="pt")["pixel_values"]
    # the same uint8 pixels: what is left is float rounding of /255 and mean/std
    np.testing.assert_allclose(theirs.numpy(), ours, atol=1e-5, rtol=0)
    with torch.no_grad():
        want = model(pixel_values=torch.from_numpy(ours)).logits
        got = model(pixel_values=theirs).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert got.argmax(1).tolist() == want.argmax(1).tolist()

    # the pipeline, from the files: the same top-1 class and probability for every image
    classify = pipeline("image-classification", model=str(out), image_processor=processor)
    top = [p[0] for p in classify(paths, top_k=1, batch_size=8)]
    probs = want.softmax(1)
    assert [t["label"] for t in top] == [CLASSES[i] for i in want.argmax(1).tolist()]
    np.testing.assert_allclose([t["score"] for t in top], probs.max(1).values.numpy(), atol=1e-4, rtol=0)


def test_fit_size_is_transformers_resize_arithmetic_for_every_shape():
    """Both of transformers' backends (PIL and torchvision) size a shortest_edge resize with
    get_resize_output_image_size; behemoth's fit_size gives the same (height, width) for every shape."""
    from transformers.image_transforms import get_resize_output_image_size
    from transformers.image_utils import ChannelDimension

    differ = []
    for size in (16, 32, 224):
        for h in range(1, 241):
            for w in range(1, 241):
                image = np.broadcast_to(np.uint8(0), (3, h, w))
                want = get_resize_output_image_size(image, size, default_to_square=False,
                                                    input_data_format=ChannelDimension.FIRST)
                if fit_size(w, h, size)[::-1] != tuple(want):
                    differ.append((size, w, h))
    assert differ == []


def test_decoding_follows_exif_orientation_and_drops_alpha(tmp_path):
    """As transformers' load_image: a photo stored sideways with an EXIF orientation is turned upright, and a
    transparent pixel keeps its colour (the alpha channel is dropped, not blended onto a background)."""
    from behemoth.data.image.image_batches import decode_rgb

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (200, 30, 30)).save(buf, "JPEG", exif=exif)
    assert decode_rgb(buf.getvalue()).size == (20, 40)
    buf = io.BytesIO()
    Image.new("RGBA", (4, 4), (10, 20, 30, 0)).save(buf, "PNG")
    assert decode_rgb(buf.getvalue()).getpixel((0, 0)) == (10, 20, 30)
