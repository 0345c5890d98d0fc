"""An image job's `data:` section (ImageData): its keys, their defaults and checks. (data/image/images.py reads the
samples it names; tasks/image.py: ImageClassification.complete fills the keys whose default is the pretrained
model's.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from behemoth.config import DataConfig
from behemoth.data.image.decode import MAX_IMAGE_PIXELS
from behemoth.errors import ConfigError
from behemoth.storage.store import Store

# data.mean / data.std where neither the job nor model.pretrained's image processor gives them
DEFAULT_MEAN, DEFAULT_STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


@dataclass
class ImageData(DataConfig):
    """`data:` of an image job: image_folder (ROOT/{train,val}/<class>/*.{png,jpg,webp,...}), image_parquet
    (data.train_files / val_files with an image-bytes column and a label column) or image_webdataset
    (data.train_files / val_files: tar shards)."""

    root: str = ""
    image_column: str = "image"
    label_column: str = "label"
    image_size: int = 32
    augment: Literal["crop_flip", "random_resized_crop", "none"] = "crop_flip"
    crop_padding: int = 4
    # Per-channel normalisation of 0..1 pixels. Left out: model.pretrained's own (its image processor's image_mean
    # and image_std: the statistics its weights were trained on), else DEFAULT_MEAN / DEFAULT_STD (tasks/image.py:
    # ImageClassification.complete, which writes them into the job, so the run's job.yaml names them).
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    # Evaluation's centre crop, as a share of the shorter side it is cut from: the image's shorter side is resized
    # to image_size / eval_crop_pct (truncated, as transformers does), then the centre image_size x image_size
    # kept (0.875: 256 for 224, ImageNet's evaluation). Left out: model.pretrained's image processor's (its
    # crop_pct, or its crop over its resize), else 1 (the shorter side resized to image_size).
    eval_crop_pct: Optional[float] = None
    # decoded: every image is decoded and centre-fitted once per node into cache_dir (data/image/image_cache.py);
    # epochs, restarts and sweep trials read those rows. auto: decoded where the decoded set takes at most
    # cache_max_share of the node's RAM and of the free disk at cache_dir (or is built already), and the
    # augmentation starts from the fitted image (not random_resized_crop). none: decode every epoch.
    cache: Literal["auto", "decoded", "none"] = "auto"
    cache_dir: str = "data_cache"
    cache_max_share: float = 0.5
    # random_resized_crop decoded once too (opt-in, FFCV's way): > 0 keeps each training image in the decoded
    # cache as a cache_side x cache_side view of the whole image (its aspect ratio kept aside); every epoch's
    # crop is drawn on the original size as before and taken from that view. Not the same pixels as decoding
    # every epoch: the crop resamples a downscaled image (docs/speed.md). 0: decoded every epoch.
    cache_side: int = 0
    # The training loss's recipe (ImageNet's): cross-entropy against labels smoothed by label_smoothing; mixup
    # (images and labels blended with a partner, weight ~ Beta(mixup_alpha, mixup_alpha)) and cutmix (a box of
    # the partner pasted in, area ~ Beta(cutmix_alpha, cutmix_alpha)), each on when its alpha > 0 (both: one or
    # the other per micro-batch, half and half). data/image/mixing.py. Evaluation is never mixed or smoothed.
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    # An image whose header declares more pixels than this is a bad sample (data.max_bad_samples), refused before
    # any decoder allocates for it: a 557-byte JPEG declaring 16000 x 16000 made libjpeg take 817 MB. The default
    # is Pillow's Image.MAX_IMAGE_PIXELS (1 GiB / 4 / 3); raise it for larger images (data/image/decode.py: bounded).
    max_image_pixels: int = MAX_IMAGE_PIXELS

    path_keys: ClassVar[tuple[str, ...]] = (*DataConfig.path_keys, "root", "cache_dir")

    def validate(self) -> None:
        super().validate()
        if self.kind == "image_folder" and not self.root:
            raise ConfigError("data.root is empty: set it to the folder holding train/ and val/")
        if self.kind in ("image_parquet", "image_webdataset") and not (self.train_files and self.val_files):
            raise ConfigError(f"data.kind is {self.kind}: set data.train_files and data.val_files")
        if self.image_size <= 0:
            raise ConfigError(f"data.image_size must be > 0, got {self.image_size!r}")
        # (empty: left out, filled in by the task's `complete` before a job is checked)
        if len(self.mean) not in (0, 3) or len(self.std) not in (0, 3) or min(self.std, default=1) <= 0:
            raise ConfigError("data.mean and data.std need 3 values each (RGB), std > 0")
        if self.eval_crop_pct is not None and not 0 < self.eval_crop_pct <= 1:
            raise ConfigError(f"data.eval_crop_pct must be in (0, 1] (0.875: resize to 256, keep the centre 224), "
                              f"got {self.eval_crop_pct!r}")
        if isinstance(self.max_image_pixels, bool) or self.max_image_pixels <= 0:
            raise ConfigError(f"data.max_image_pixels must be a number of pixels > 0 (default {MAX_IMAGE_PIXELS:,}, "
                              f"Pillow's), got {self.max_image_pixels!r}")
        if self.crop_padding < 0:
            raise ConfigError("data.crop_padding must be >= 0")
        if not 0 < self.cache_max_share <= 1:
            raise ConfigError(f"data.cache_max_share must be in (0, 1], got {self.cache_max_share!r}")
        if self.cache == "decoded" and self.augment == "random_resized_crop" and not self.cache_side:
            raise ConfigError("data.cache=decoded keeps the centre-fitted image, and random_resized_crop crops the "
                              "original: use data.cache=none (or auto, which decodes every epoch for it), or set "
                              "data.cache_side (e.g. 320) to keep a bounded view of every image to crop from")
        if self.cache_side and (self.augment != "random_resized_crop" or self.cache == "none"):
            raise ConfigError(f"data.cache_side {self.cache_side} is for augment random_resized_crop with data.cache "
                              f"auto or decoded (got augment {self.augment}, cache {self.cache}): remove it")
        if self.cache_side < 0:
            raise ConfigError(f"data.cache_side must be >= 0 (0: off), got {self.cache_side}")
        if self.cache_side and self.cache_side < self.image_size:
            raise ConfigError(f"data.cache_side {self.cache_side} is smaller than data.image_size "
                              f"{self.image_size}: every crop would be upsampled; use at least {self.image_size}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"data.label_smoothing must be in [0, 1), got {self.label_smoothing!r} (0.1 is usual)")
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0:
            raise ConfigError(f"data.mixup_alpha and data.cutmix_alpha must be >= 0 (0: off; 0.2 and 1.0 are "
                              f"usual), got {self.mixup_alpha!r}, {self.cutmix_alpha!r}")
        if self.cache == "decoded" and not Store(self.cache_dir).is_local:
            raise ConfigError(f"data.cache_dir {self.cache_dir} is a URI: the decoded cache is a folder on each "
                              f"node's own disk (a local path), read by memory-mapping it")

    def eval_fit(self) -> int:
        """The shorter side evaluation resizes an image to before its centre crop of image_size."""
        # (+1e-6: a ratio read as crop / resize, 224 / 256, gives back 256, not 255.99999...)
        return max(self.image_size, int(self.image_size / (self.eval_crop_pct or 1) + 1e-6))

    def source(self) -> str:
        return self.root if reads_folder(self) else super().source()


def reads_folder(cfg: ImageData) -> bool:
    return cfg.kind == "image_folder" or (cfg.kind not in ("image_parquet", "image_webdataset") and not cfg.train_files)
