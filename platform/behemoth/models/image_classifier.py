"""Any transformers image classifier (ViT, ConvNeXt, Swin, ...) through AutoModelForImageClassification:

- `model.hf_config: {model_type: vit, hidden_size: 64, ...}` builds a fresh model with `AutoConfig.for_model`;
  `num_labels` comes from the data's classes and, where the architecture has one, `image_size` from
  data.image_size (both unless set);
- `model.pretrained: FOLDER_OR_HUB_NAME` loads weights with `from_pretrained`; a classification head of
  another size is re-initialised for the data's classes (transformers' ignore_mismatched_sizes).
"""

from __future__ import annotations

from behemoth.errors import ConfigError
from behemoth.models.causal_lm import config_errors


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
