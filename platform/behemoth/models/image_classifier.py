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
        return AutoModelForImageClassification.from_pretrained(
            model_cfg.pretrained, trust_remote_code=model_cfg.trust_remote_code, ignore_mismatched_sizes=True,
            **overrides)
    model_type = overrides.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **overrides)
    except (TypeError, *config_errors()) as e:  # unknown model_type, a key its config rejects, keys that disagree
        raise ConfigError(f"model.hf_config: {' '.join(str(e).split())}") from None
    if hasattr(config, "image_size") and "image_size" not in model_cfg.hf_config:
        config.image_size = image_size
    try:
        return AutoModelForImageClassification.from_config(config)
    except ValueError as e:  # a model_type with no image-classification head
        raise ConfigError(f"model.hf_config: model_type {model_type}: {e}") from None


def check_image_classifier(model_cfg, *, num_classes: int, image_size: int) -> None:
    """On the driver, before Ray: model.hf_config's model built on torch's meta device (no memory), as the
    workers will build it, so that a model_type or keys transformers refuses are one line here, not a failure on
    every worker after Ray Train has started. (model.pretrained's folder is checked where it is read.)"""
    if model_cfg.pretrained:
        return
    import torch

    with torch.device("meta"):
        build_image_classifier(model_cfg, num_classes=num_classes, image_size=image_size)


PROCESSOR_FILE = "preprocessor_config.json"  # transformers' image processor's settings (IMAGE_PROCESSOR_NAME)


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
    """ConvNeXt's and timm's crop_pct; else a centre crop's size over the shorter side it resizes to (BiT's, CLIP's,
    behemoth's exports: shortest_edge 256, crop 224); else None (a ViT's: resized to the square, no crop)."""
    if _number(settings.get("crop_pct")) and 0 < settings["crop_pct"] <= 1:
        return float(settings["crop_pct"])
    size, crop = settings.get("size"), settings.get("crop_size")
    if settings.get("do_center_crop") and isinstance(size, dict) and isinstance(crop, dict):
        short, side = size.get("shortest_edge"), crop.get("height")
        if _number(short) and _number(side) and 0 < side <= short:
            return side / short
    return None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
