"""The demo's model before issue 15 (behemoth <= f2f5348, `resnet_tiny_cifar`): a tiny transformers ResNet with
its ImageNet stem swapped for a CIFAR one (3x3 stride-1 conv, no pooling), which no stock transformers config
expresses — the reason it was replaced by `regnet_tiny_cifar`. Kept here only as bench/demo_models.py's
baseline, given to behemoth as a model of one's own (model.name: bench.old_demo_model:resnet_tiny_cifar)."""

from __future__ import annotations

from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification
from transformers.models.resnet.modeling_resnet import ResNetConvLayer


def resnet_tiny_cifar(num_classes: int) -> ResNetForImageClassification:
    config = ResNetConfig(num_labels=num_classes, layer_type="basic", depths=[1, 1, 1, 1],
                          hidden_sizes=[16, 32, 64, 128], embedding_size=16)
    model = ResNetForImageClassification(config)
    model.resnet.embedder.embedder = ResNetConvLayer(config.num_channels, config.embedding_size, kernel_size=3,
                                                     stride=1, activation=config.hidden_act)
    model.resnet.embedder.pooler = nn.Identity()
    return model
