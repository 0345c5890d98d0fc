"""Model builders. One file per model family; `registry.py` maps names to builders.

- `registry`: model.name or an import path -> builder; removed names explained.
- `resnet`, `regnet`: ResNet (CIFAR or ImageNet stem) and RegNet (CIFAR scale) from transformers' configs.
- `image_classifier`: any AutoModelForImageClassification; `causal_lm`: any AutoModelForCausalLM.
- `lora`: model.lora's adapters through peft; `sources`: a model's or tokenizer's source (a local folder or a Hub
  name) checked before Ray; `hf_keys`: what model.hf_config may hold (architecture keys only).
- `wrappers`: a model inside training's wrappers (torch.compile, DDP, FSDP2): unwrap, is_sharded.
- `chunked_loss`: a causal LM's loss through its output projection in chunks of tokens (the logits never whole).
"""
