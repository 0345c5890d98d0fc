"""Any transformers image classifier (ViT, ConvNeXt, Swin, ...) through AutoModelForImageClassification:

- `model.hf_config: {model_type: vit, hidden_size: 64, ...}` builds a fresh model with `AutoConfig.for_model`;
  `num_labels` comes from the data's classes and, where the architecture has one, `image_size` from
  data.image_size (both unless set);
- `model.pretrained: FOLDER_OR_HUB_NAME` loads weights with `from_pretrained`; a classification head of
  another size is re-initialised for the data's classes (transformers' ignore_mismatched_sizes).
"""

from __future__ import annotations

import json
import sys

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


def processor_normalisation(source: str, named: str, default: tuple[list[float], list[float]]):
    """(image_mean, image_std) of the image processor of the model at `source` (a local folder or a Hub name;
    model.pretrained `named`): the statistics its weights were trained on. Where it has none, `default`, said in
    one warning. A processor file that is not JSON is the model folder's fault: one error naming it."""
    found = model_file(source, PROCESSOR_FILE)
    values = _normalisation(found, named) if found is not None else None
    if values is None:
        print(f"[behemoth] warning: model.pretrained {named} has no image processor giving image_mean and image_std "
              f"({PROCESSOR_FILE}): data.mean / data.std default to {default[0]} / {default[1]}; set them to "
              f"the statistics the model was trained with", file=sys.stderr, flush=True)
    return values or default


def _normalisation(found, named: str) -> tuple[list[float], list[float]] | None:
    try:
        settings = json.loads(found.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.pretrained {named}: {PROCESSOR_FILE} is not valid JSON ({e}): "
                          f"repair or remove it, or set data.mean and data.std") from None
    values = [settings.get(key) if isinstance(settings, dict) else None for key in ("image_mean", "image_std")]
    # (transformers takes one number for every channel too)
    values = [[v] * 3 if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in values]
    if not all(isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v) for v in values):
        return None  # (none given, or not three channels': the job's defaults, with the warning)
    return [float(x) for x in values[0]], [float(x) for x in values[1]]
