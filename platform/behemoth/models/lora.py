"""LoRA adapters (model.lora) on a transformers model, through the peft library: the base model's weights are
frozen as built, low-rank adapters are added to the named modules (peft's default for the model type where
none are named), and a sequence classifier's head trains too (every module outside the base model). The workers, `behemoth
eval` and `export` build the adapted model the same way, from the same seed; a checkpoint holds only what
trains (checkpoints/live_state.py), an export both the adapter folder and the merged model (driver/commands/export.py).
"""

from __future__ import annotations

import warnings

from behemoth.errors import ConfigError


def add_adapters(model, lora_cfg, task_type: str):
    """`model` with LoRA adapters (a peft PeftModel); `lora_cfg`: the job's model.lora; `task_type`: peft's
    (CAUSAL_LM, SEQ_CLS)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs the peft library: pip install 'behemoth[lora]'") from None
    # a classifier's head trains whole: every top-level module outside the base model (peft's SEQ_CLS keeps only
    # those named classifier, score or pre_classifier: BART's classification_head and DeBERTa's pooler, built
    # fresh, stayed random and frozen)
    heads = [name for name, child in model.named_children() if name != getattr(model, "base_model_prefix", None)
             and any(True for _ in child.parameters())] if task_type == "SEQ_CLS" else None
    config = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                             target_modules=lora_cfg.target_modules, task_type=task_type, modules_to_save=heads)
    try:
        with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates: noise on every console
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            adapted = peft.get_peft_model(model, config)
    except ValueError as e:  # target modules that the model does not have, a model type peft has no default for
        raise ConfigError(f"model.lora: {' '.join(str(e).split())}") from None
    _check_rank(adapted, lora_cfg.r)
    return adapted


def _check_rank(adapted, r: int) -> None:
    """A rank above a targeted layer's smaller side adds no capacity, only memory (r = 1e9 asked for gigabytes per
    layer): refused, naming the smallest layer. The driver checks it on a model on the meta device, before any
    worker allocates the adapters."""
    from peft.tuners.lora import LoraLayer

    sides = {name: min(layer.in_features, layer.out_features) for name, layer in adapted.named_modules()
             if isinstance(layer, LoraLayer)}
    name = min(sides, key=sides.get)
    if r > sides[name]:
        raise ConfigError(f"model.lora.r {r} exceeds the smallest side of an adapted layer ({sides[name]}, "
                          f"{name.removeprefix('base_model.model.')}): a rank above it adds nothing; use at most "
                          f"{sides[name]}")


def is_adapted(model) -> bool:
    """Whether `model` (unwrapped) is a peft model: its checkpoints hold only what trains."""
    return hasattr(model, "peft_config")
