"""Names -> model builders, imported lazily so the driver never imports model code it does not need.

A new model is one file in this folder plus one line in MODELS: "name": "module:function", where the
function takes the number of classes and returns a torch module.
"""

from __future__ import annotations

import difflib
import importlib

MODELS: dict[str, str] = {
    "resnet18": "behemoth.models.resnet:resnet18",
    "resnet50": "behemoth.models.resnet:resnet50",
    "resnet18_cifar": "behemoth.models.resnet:resnet18_cifar",
    "resnet_tiny_cifar": "behemoth.models.resnet:resnet_tiny_cifar",
}


def check_name(name: str) -> None:
    if name not in MODELS:
        from behemoth.config import ConfigError

        close = difflib.get_close_matches(name, list(MODELS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model.name '{name}' is not a known model{hint} (known: {', '.join(MODELS)})")


def build_model(name: str, num_classes: int):
    check_name(name)
    module, func = MODELS[name].split(":")
    return getattr(importlib.import_module(module), func)(num_classes)
