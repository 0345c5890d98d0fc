"""Names -> model builders, imported lazily so the driver never imports model code it does not need.

Image models: one file in this folder plus one line in MODELS: "name": "module:function", where the
function takes the number of classes and returns a torch module. Language models need no entry: the name
`causal_lm` builds any transformers AutoModelForCausalLM from model.hf_config / model.pretrained
(behemoth.models.causal_lm).
"""

from __future__ import annotations

import importlib

from behemoth.errors import ConfigError, did_you_mean

MODELS: dict[str, str] = {
    "resnet18": "behemoth.models.resnet:resnet18",
    "resnet50": "behemoth.models.resnet:resnet50",
    "resnet18_cifar": "behemoth.models.resnet:resnet18_cifar",
    "resnet_tiny_cifar": "behemoth.models.resnet:resnet_tiny_cifar",
}
CAUSAL_LM = "causal_lm"


def check_name(name: str) -> None:
    known = [*MODELS, CAUSAL_LM]
    if name not in known:
        raise ConfigError(f"model.name '{name}' is not a known model{did_you_mean(name, known)} "
                          f"(known: {', '.join(known)})")


def build_model(name: str, num_classes: int):
    check_name(name)
    module, func = MODELS[name].split(":")
    return getattr(importlib.import_module(module), func)(num_classes)
