"""ResNets from transformers (`ResNetConfig` + `ResNetForImageClassification`), no torchvision needed: the
ImageNet layout (7x7 stride-2 stem and max-pool: 224x224 -> 56x56 before the first stage)."""

from __future__ import annotations

from transformers import ResNetConfig, ResNetForImageClassification

_RESNET18 = dict(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], embedding_size=64)
_RESNET50 = dict(
    layer_type="bottleneck", depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], embedding_size=64
)


def resnet18(num_classes: int):
    return ResNetForImageClassification(ResNetConfig(num_labels=num_classes, **_RESNET18))


def resnet50(num_classes: int):
    return ResNetForImageClassification(ResNetConfig(num_labels=num_classes, **_RESNET50))
