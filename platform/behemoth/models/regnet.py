"""Small-image (CIFAR-scale) CNNs that a stock transformers config expresses, so their exports load with
transformers alone: RegNetX (`RegNetConfig` + `RegNetForImageClassification`) with the first stage kept at
the stem's resolution (`downsample_in_first_stage=False`).

Why not a ResNet with a CIFAR stem: the usual CIFAR ResNet replaces the 7x7 stride-2 stem and max-pool by a
3x3 stride-1 convolution, which `ResNetConfig` cannot express (its stem is fixed), so such a model saved with
`save_pretrained` would load with the wrong stem. RegNet's stem is a 3x3 stride-2 convolution without
pooling: a 32x32 image reaches the first stage at 16x16 (a ResNet's ImageNet stem leaves 8x8). With
`groups_width` equal to the widest stage every 3x3 convolution is a full one (one group), so each block is
a ResNet-style residual block (1x1 -> 3x3 -> 1x1, no width reduction).

The workers train `RegNetX`, written here in plain torch with transformers' module layout: the same
parameter names, the same operations in the same order, and the same initial weights for the same seed
(tests/unit/test_models.py checks all three against `RegNetForImageClassification`). Importing transformers'
modelling code costs every training worker seconds (it pulls in torch._dynamo and DTensor); only
`to_transformers()` (export) imports it.

`regnet_tiny_cifar`'s accuracy and step time on the demo images: BENCHMARKS.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn


class ConvLayer(nn.Module):
    """transformers' RegNetConvLayer: convolution (no bias), batch norm, optional ReLU."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, relu: bool = True):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
        self.normalization = nn.BatchNorm2d(cout)
        self.activation = nn.ReLU() if relu else nn.Identity()

    def forward(self, x):
        return self.activation(self.normalization(self.convolution(x)))


class ShortCut(nn.Module):
    """transformers' RegNetShortCut: 1x1 projection (and stride) with batch norm."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)
        self.normalization = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.normalization(self.convolution(x))


class XLayer(nn.Module):
    """transformers' RegNetXLayer with one group (groups_width = the widest stage)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.shortcut = ShortCut(cin, cout, stride) if cin != cout or stride != 1 else nn.Identity()
        self.layer = nn.Sequential(ConvLayer(cin, cout, kernel_size=1), ConvLayer(cout, cout, stride=stride),
                                   ConvLayer(cout, cout, kernel_size=1, relu=False))
        self.activation = nn.ReLU()

    def forward(self, x):
        out = self.layer(x)
        out += self.shortcut(x)
        return self.activation(out)


class Stage(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, depth: int):
        super().__init__()
        self.layers = nn.Sequential(XLayer(cin, cout, stride), *[XLayer(cout, cout) for _ in range(depth - 1)])

    def forward(self, x):
        return self.layers(x)


class _Embeddings(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.embedder = ConvLayer(3, width, kernel_size=3, stride=2)

    def forward(self, x):
        return self.embedder(x)


class _Encoder(nn.Module):
    def __init__(self, depths: list[int], widths: list[int]):
        super().__init__()
        self.stages = nn.ModuleList([Stage(widths[0], widths[0], 1, depths[0])])
        for (cin, cout), depth in zip(zip(widths, widths[1:]), depths[1:]):
            self.stages.append(Stage(cin, cout, 2, depth))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


class _Backbone(nn.Module):
    def __init__(self, depths: list[int], widths: list[int]):
        super().__init__()
        self.embedder = _Embeddings(widths[0])
        self.encoder = _Encoder(depths, widths)
        self.pooler = nn.AdaptiveAvgPool2d((1, 1))

    def forward(self, x):
        return self.pooler(self.encoder(self.embedder(x)))


class Output(NamedTuple):
    """What the model returns: `.logits`, like a transformers model's output. A named tuple, so that torch's
    pytree sees the tensor in it: FSDP hooks the output's tensors to gather the parameters again for backward
    (an object it cannot look into would leave the first backward without them)."""

    logits: torch.Tensor


class RegNetX(nn.Module):
    """`RegNetForImageClassification(RegNetConfig(layer_type="x", ...))` in plain torch: called as
    `model(pixel_values=images).logits`, like the transformers model."""

    def __init__(self, num_classes: int, depths: list[int], widths: list[int]):
        super().__init__()
        self.depths, self.widths, self.num_classes = list(depths), list(widths), num_classes
        self.regnet = _Backbone(depths, widths)
        # transformers' post_init of the inner RegNetModel: every convolution, children before parents
        for module in _post_order(self.regnet):
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(widths[-1], num_classes))
        # ... and of the outer model: the new head (torch's own Linear initialisation, drawn once more)
        head = self.classifier[1]
        nn.init.kaiming_uniform_(head.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(head.weight.shape[1])
        nn.init.uniform_(head.bias, -bound, bound)

    def forward(self, pixel_values: torch.Tensor):
        return Output(logits=self.classifier(self.regnet(pixel_values)))

    def transformers_config(self, classes: list[str] | None = None):
        from transformers import RegNetConfig

        labels = {} if classes is None else {"id2label": dict(enumerate(classes)),
                                             "label2id": {c: i for i, c in enumerate(classes)}}
        return RegNetConfig(num_labels=self.num_classes, layer_type="x", depths=self.depths,
                            hidden_sizes=self.widths, embedding_size=self.widths[0], groups_width=self.widths[-1],
                            downsample_in_first_stage=False, **labels)

    def to_transformers(self, classes: list[str] | None = None):
        """The same model as a `RegNetForImageClassification` holding these weights (for save_pretrained)."""
        from transformers import RegNetForImageClassification

        model = RegNetForImageClassification(self.transformers_config(classes))
        model.load_state_dict(self.state_dict(), strict=True)
        return model.to(next(self.parameters()).device).train(self.training)


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def regnet_tiny_cifar(num_classes: int) -> RegNetX:
    """~0.24 M parameters: the demo and the tests (2 CPU cores)."""
    return RegNetX(num_classes, depths=[1, 1, 1, 1], widths=[16, 32, 64, 128])


def regnet_cifar(num_classes: int) -> RegNetX:
    """ResNet-18's depths and widths (~11 M parameters) at CIFAR scale."""
    return RegNetX(num_classes, depths=[2, 2, 2, 2], widths=[64, 128, 256, 512])
