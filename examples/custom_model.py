"""Bring your own model and your own loss: a plain PyTorch CNN trained with a focal loss on the demo images,
with no change to behemoth. The job (examples/custom_model.yaml) names both by import path:

    model.name: examples.custom_model:small_cnn          # called with num_classes=, returns a torch.nn.Module
    data.kind:  examples.custom_model:FocalLossImages    # a task: image classification with this loss

Run it from the repository root (the import paths are relative to it; under `ray job submit --working-dir .`
the working directory is on the workers' path already):

    behemoth data synth-images --out data/demo_images                      # once
    PYTHONPATH=. behemoth train examples/custom_model.yaml
    PYTHONPATH=. behemoth export runs/custom_model --out exports/custom_model \
        --model-code examples.custom_model:small_cnn \
        --task-code examples.custom_model:FocalLossImages                  # safetensors + its builder's name

(export imports no code that only a checkpoint names: the two flags say that you trust these two.)

Everything else is behemoth's: Ray Data decoding and augmentation, DDP over the workers, checkpoints, exact
resume, evaluation (top-1 accuracy), export. tests/integration/test_models_io.py runs this example.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from behemoth import ImageClassification


def small_cnn(num_classes: int) -> nn.Module:
    """Three conv blocks (32x32 -> 16 -> 8 -> 4), global average pooling, a linear classifier. It takes the
    normalised image batch [N, 3, H, W] and returns logits [N, num_classes]: what behemoth calls a model that
    is not a transformers one with."""

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.MaxPool2d(2))

    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, num_classes))


class FocalLossImages(ImageClassification):
    """Image classification whose training loss is the focal loss (Lin et al. 2017): cross-entropy scaled by
    (1 - p_true)^gamma, so samples the model already gets right weigh less. Evaluation stays behemoth's
    (cross-entropy and top-1 accuracy), so runs compare with ordinary ones."""

    gamma = 2.0

    def loss(self, model, batch):
        """(mean loss over the batch's decodable samples, their number): the contract of Task.loss."""
        valid = batch["valid"].float()
        logits = self.logits(model, self.pixel_values(batch)).float()  # uint8 images, normalised on the device
        log_p = F.log_softmax(logits, dim=1).gather(1, batch["label"][:, None]).squeeze(1)
        per_sample = -((1.0 - log_p.exp()) ** self.gamma) * log_p
        n_valid = valid.sum()
        return (per_sample * valid).sum() / n_valid.clamp(min=1), n_valid
