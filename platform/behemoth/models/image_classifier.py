"""Any transformers image classifier (ViT, ConvNeXt, Swin, ...) through AutoModelForImageClassification:

- `model.hf_config: {model_type: vit, hidden_size: 64, ...}` builds a fresh model with `AutoConfig.for_model`;
  `num_labels` comes from the data's classes and, where the architecture has one, `image_size` from
  data.image_size (both unless set);
- `model.pretrained: FOLDER_OR_HUB_NAME` loads weights with `from_pretrained`; a classification head of
  another size is re-initialised for the data's classes (transformers' ignore_mismatched_sizes).
"""

from __future__ import annotations

import json
from typing import NamedTuple

from behemoth.errors import ConfigError
from behemoth.models.causal_lm import config_errors
from behemoth.models.sources import model_file


def build_image_classifier(model_cfg, *, num_classes: int, image_size: int):
    """`model_cfg`: the job's behemoth.config.ModelConfig (not imported: models/ stands below config)."""
    from transformers import AutoConfig, AutoModelForImageClassification

    overrides = dict(model_cfg.hf_config)
    overrides.setdefault("num_labels", num_classes)
    if model_cfg.pretrained:
        overrides.pop("model_type", None)
        model = AutoModelForImageClassification.from_pretrained(
            model_cfg.pretrained, trust_remote_code=model_cfg.trust_remote_code, ignore_mismatched_sizes=True,
            **overrides)
        return model if "image_size" in model_cfg.hf_config else fit_position_embeddings(model, image_size)
    model_type = overrides.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **overrides)
    except (TypeError, *config_errors()) as e:  # unknown model_type, a key its config rejects, keys that disagree
        raise ConfigError(f"model.hf_config: {' '.join(str(e).split())}") from None
    if hasattr(config, "image_size") and "image_size" not in model_cfg.hf_config:
        config.image_size = image_size
    if config.architectures is None:  # (transformers reads it where a model_type has two heads, DeiT's: a TypeError)
        config.architectures = []
    try:
        return AutoModelForImageClassification.from_config(config)
    except ValueError as e:  # a model_type with no image-classification head
        raise ConfigError(f"model.hf_config: model_type {model_type}: {e}") from None


def fit_position_embeddings(model, image_size: int):
    """A vision transformer pretrained at another resolution (ViT, DeiT: one learned position per patch) refuses
    images of another size unless told to interpolate its positions in every forward, which transformers'
    pipeline never says: its position embeddings are resampled once to data.image_size's patch grid (transformers'
    own bicubic interpolate_pos_encoding) and its config says that size, so the model, its checkpoints and its
    export all take data.image_size. Models that take any size (convolutions, Swin, BEiT's, DINOv2's) unchanged."""
    import torch

    for module in model.modules():
        positions, patches = getattr(module, "position_embeddings", None), getattr(module, "patch_embeddings", None)
        if not (isinstance(positions, torch.nn.Parameter) and hasattr(module, "interpolate_pos_encoding")
                and hasattr(patches, "num_patches") and hasattr(patches, "patch_size")):
            continue
        if tuple(patches.image_size) == (image_size, image_size):
            continue
        grid = (image_size // patches.patch_size[0]) * (image_size // patches.patch_size[1])
        extra = positions.shape[1] - patches.num_patches  # the class (and distillation) tokens' positions
        with torch.no_grad():
            resampled = module.interpolate_pos_encoding(positions.new_zeros(1, extra + grid, positions.shape[2]),
                                                        image_size, image_size)
        module.position_embeddings = torch.nn.Parameter(resampled.clone(), requires_grad=positions.requires_grad)
        patches.image_size, patches.num_patches = (image_size, image_size), grid
        if hasattr(module, "image_size"):  # (ViT's embeddings check the input's size against their own copy)
            module.image_size = (image_size, image_size)
        model.config.image_size = image_size
    return model


def check_image_classifier(model_cfg, *, num_classes: int, image_size: int) -> None:
    """On the driver, before Ray: model.hf_config's model built on torch's meta device (no memory), as the
    workers will build it, so that a model_type or keys transformers refuses are one line here, not a failure on
    every worker after Ray Train has started. (model.pretrained's folder is checked where it is read.) A
    num_labels other than the data's classes is refused: the head would not be the data's, nor the export's
    id2label its size (transformers' pipeline then cannot load it)."""
    labels = model_cfg.hf_config.get("num_labels")
    if labels is not None and labels != num_classes:
        raise ConfigError(f"model.hf_config.num_labels {labels!r}: the data has {num_classes} classes, which size the "
                          f"classification head; remove num_labels")
    if model_cfg.pretrained:
        return
    import torch

    with torch.device("meta"):
        build_image_classifier(model_cfg, num_classes=num_classes, image_size=image_size)


PROCESSOR_FILE = "preprocessor_config.json"  # transformers' image processor's settings (IMAGE_PROCESSOR_NAME)
PROCESSOR_MAX_BYTES = 1 << 20


class Preprocessing(NamedTuple):
    """What a pretrained model's image processor says of its inputs (None: it does not say)."""

    mean: list[float] | None = None  # image_mean, image_std: the statistics its weights were trained on
    std: list[float] | None = None
    crop_pct: float | None = None  # evaluation's centre crop over the shorter side it is cut from


def pretrained_preprocessing(source: str, named: str) -> Preprocessing:
    """The image processor settings of the model at `source` (a local folder or a Hub name; model.pretrained
    `named`). A processor file that is not JSON is the model folder's fault: one error naming it."""
    found = model_file(source, PROCESSOR_FILE)
    if found is None:
        return Preprocessing()
    if found.stat().st_size > PROCESSOR_MAX_BYTES:  # (read before the job is checked: bounded first)
        raise ConfigError(f"model.pretrained {named}: {PROCESSOR_FILE} holds {found.stat().st_size:,} bytes, not an "
                          f"image processor's settings (a few hundred): replace it, or set data.mean, data.std and "
                          f"data.eval_crop_pct")
    try:
        settings = json.loads(found.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.pretrained {named}: {PROCESSOR_FILE} is not valid JSON ({e}): "
                          f"repair or remove it, or set data.mean, data.std and data.eval_crop_pct") from None
    if not isinstance(settings, dict):
        return Preprocessing()
    # (transformers takes one number for every channel too)
    values = [settings.get(key) for key in ("image_mean", "image_std")]
    values = [[v] * 3 if _number(v) else v for v in values]
    three = all(isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v) for v in values)
    mean, std = ([float(x) for x in v] for v in values) if three else (None, None)
    return Preprocessing(mean, std, _crop_pct(settings))


def _crop_pct(settings: dict) -> float | None:
    """Evaluation's crop share as the processor gives it, where behemoth's centre fit can repeat it: ConvNeXt's
    crop_pct (none given: transformers' 224 / 256; from a 384 shortest edge up it resizes to the square without a
    crop: None); else a centre crop's size over the size it resizes to (BiT's, CLIP's, DeiT's, behemoth's exports:
    256 and 224; the older plain numbers too); else None (a ViT's: resized to the square, no crop)."""
    size, crop = settings.get("size"), settings.get("crop_size")
    short = (size.get("shortest_edge", size.get("height")) if isinstance(size, dict) else size) if size else None
    side = (crop.get("height") if isinstance(crop, dict) else crop) if crop else None
    if "crop_pct" in settings:
        pct = settings["crop_pct"]
        if pct is None and "ConvNext" in str(settings.get("image_processor_type") or
                                             settings.get("feature_extractor_type") or ""):
            pct = 224 / 256
        if _number(short) and short >= 384:
            return None
        return float(pct) if _number(pct) and 0 < pct <= 1 else None
    if settings.get("do_center_crop", True) and _number(short) and _number(side) and 0 < side <= short:
        return side / short
    return None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
