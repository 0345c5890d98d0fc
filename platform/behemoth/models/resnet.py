"""ResNets from transformers (`ResNetConfig` + `ResNetForImageClassification`), no torchvision needed.

The `_cifar` variants swap the ImageNet stem (7x7 stride-2 conv + max-pool, which shrinks a 32x32 image to
8x8 before the first stage) for a 3x3 stride-1 conv and no pooling, as in the CIFAR ResNet papers.
"""

from __future__ import annotations

from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification
from transformers.models.resnet.modeling_resnet import ResNetConvLayer


def _resnet(num_classes: int, cifar_stem: bool, **arch) -> ResNetForImageClassification:
    config = ResNetConfig(num_labels=num_classes, **arch)
    model = ResNetForImageClassification(config)
    if cifar_stem:
        model.resnet.embedder.embedder = ResNetConvLayer(
            config.num_channels, config.embedding_size, kernel_size=3, stride=1, activation=config.hidden_act
        )
        model.resnet.embedder.pooler = nn.Identity()
    return model


_RESNET18 = dict(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], embedding_size=64)
_RESNET50 = dict(
    layer_type="bottleneck", depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], embedding_size=64
)
# Small enough for 2 CPU cores: the demo and the tests.
_TINY = dict(layer_type="basic", depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], embedding_size=16)


def resnet18(num_classes: int):
    return _resnet(num_classes, cifar_stem=False, **_RESNET18)


def resnet50(num_classes: int):
    return _resnet(num_classes, cifar_stem=False, **_RESNET50)


def resnet18_cifar(num_classes: int):
    return _resnet(num_classes, cifar_stem=True, **_RESNET18)


def resnet_tiny_cifar(num_classes: int):
    return _resnet(num_classes, cifar_stem=True, **_TINY)
