"""Model names -> builders, imported lazily so the driver never imports model code it does not need.

`model.name` is one of:
- a registered image model (MODELS below): "name": "module:function", the function takes the number of
  classes and returns a transformers model;
- `image_classifier`: any transformers AutoModelForImageClassification, from `model.hf_config` (with its
  `model_type`, e.g. vit or convnext) or `model.pretrained` (behemoth.models.image_classifier);
- `causal_lm`: any transformers AutoModelForCausalLM, from `model.hf_config` / `model.pretrained`
  (behemoth.models.causal_lm);
- a user's own builder as an import path, "my_package.my_module:function": called with the task's facts as
  keywords (image classification: `num_classes`; causal LM: `vocab_size`) and returning a torch.nn.Module.
"""

from __future__ import annotations

import importlib

from behemoth.errors import ConfigError, did_you_mean

MODELS: dict[str, str] = {
    "resnet18": "behemoth.models.resnet:resnet18",
    "resnet50": "behemoth.models.resnet:resnet50",
    "regnet_cifar": "behemoth.models.regnet:regnet_cifar",
    "regnet_tiny_cifar": "behemoth.models.regnet:regnet_tiny_cifar",
}
IMAGE_CLASSIFIER = "image_classifier"
CAUSAL_LM = "causal_lm"
# Names an earlier behemoth knew, and what replaced them.
REMOVED = {
    "resnet_tiny_cifar": "regnet_tiny_cifar",
    "resnet18_cifar": "regnet_cifar",
}


def is_import_path(name: str) -> bool:
    return ":" in name


def check_name(name: str) -> None:
    """An import path that imports to something callable (checked without calling it); a name an earlier
    behemoth knew names its replacement. Which names a job may use is its task's check (Task.check_model)."""
    if is_import_path(name):
        _import_builder(name)
        return
    if name in REMOVED:
        raise ConfigError(
            f"model.name '{name}' was removed: its 3x3 CIFAR stem is not expressible by a transformers "
            f"ResNetConfig, so its exports could not load with transformers alone. Use '{REMOVED[name]}' (the "
            f"same role at CIFAR scale, a stock RegNetConfig; checkpoints of the old model do not load into it)")


def build_model(name: str, num_classes: int):
    """A registered image model, or a user's builder called with num_classes=."""
    if is_import_path(name):
        return build_user_model(name, num_classes=num_classes)
    check_name(name)
    if name not in MODELS:
        raise ConfigError(f"model.name '{name}' is not a registered model{did_you_mean(name, list(MODELS))} "
                          f"(registered: {', '.join(MODELS)})")
    module, func = MODELS[name].split(":")
    return getattr(importlib.import_module(module), func)(num_classes)


def build_user_model(path: str, **facts):
    """Call a user's builder with the task's facts; anything but a torch.nn.Module is refused, naming it."""
    import torch

    model = _import_builder(path)(**facts)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.name {path}: returned {type(model).__name__}, not a torch.nn.Module "
                          f"(called with {', '.join(f'{k}={v}' for k, v in facts.items())})")
    return model


def check_user_model(path: str, **facts) -> None:
    """Build a user's model on torch's meta device (no memory, no time) to check it before Ray starts."""
    import torch

    try:
        with torch.device("meta"):
            build_user_model(path, **facts)
    except ConfigError:
        raise
    except Exception as e:  # the user's code: any error, named with the call that raised it
        args = ", ".join(f"{k}={v}" for k, v in facts.items())
        raise ConfigError(f"model.name {path}: calling it with {args} failed: {type(e).__name__}: {e}") from None


def _import_builder(path: str):
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.name {path}: module {module_name} cannot be imported ({e}); is it installed, "
                          f"or on PYTHONPATH (with ray job submit: in the --working-dir)?") from None
    builder = getattr(module, attr, None)
    if builder is None:
        raise ConfigError(f"model.name {path}: module {module_name} has no attribute '{attr}'")
    if not callable(builder):
        raise ConfigError(f"model.name {path}: {attr} is a {type(builder).__name__}, not a function")
    return builder
