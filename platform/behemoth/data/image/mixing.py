"""Mixup and cutmix of a training micro-batch, on its device: each sample is blended with (mixup) or gets a box
of (cutmix) its partner, the sample at the mirrored place of the micro-batch, and its loss weighs the two labels
by the share of each in the image (per sample, timm's "elem" mode).

Every draw (mixup or cutmix, the share, the box) is a device tensor from torch's generators, which the loop
reseeds every step from (seed, rank, step): a resumed run mixes exactly as the uninterrupted one did, and
nothing here waits for the device. The pairs are within a rank's micro-batch, so an elastic resize (which
changes what a micro-batch holds) mixes other pairs, as it draws other dropout masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Mixed:
    images: torch.Tensor  # the mixed batch
    partner_labels: torch.Tensor  # each sample's partner's label
    share: torch.Tensor  # each sample's own share of its image (its label's weight); the partner's is 1 - share
    partner_valid: torch.Tensor  # whether the partner was decodable (an undecodable one is a zero image)


def mix(images: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, mixup_alpha: float,
        cutmix_alpha: float) -> Mixed | None:
    """The micro-batch (NCHW float images) mixed, or None where both alphas are 0. With both on, each sample
    is mixed one way or the other, half and half."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return None
    n, device = images.shape[0], images.device
    partner = images.flip(0)  # (tasks/image.py's loss_items pairs the samples the same way)
    if mixup_alpha > 0:
        share = _beta(mixup_alpha, n, device)
        mixed = images * _per_sample(share) + partner * _per_sample(1 - share)
    if cutmix_alpha > 0:
        inside = _boxes(1 - _beta(cutmix_alpha, n, device), images.shape[-2], images.shape[-1])
        cut, cut_share = torch.where(inside[:, None], partner, images), 1 - inside.float().mean(dim=(1, 2))
        if mixup_alpha > 0:
            use_cut = torch.rand(n, device=device) < 0.5
            mixed, share = torch.where(_per_sample(use_cut), cut, mixed), torch.where(use_cut, cut_share, share)
        else:
            mixed, share = cut, cut_share
    return Mixed(mixed, labels.flip(0), share, valid.flip(0))


def _beta(alpha: float, n: int, device) -> torch.Tensor:
    concentration = torch.full((n,), float(alpha), device=device)
    # validate_args off: its parameter check would read a device tensor on the host every step
    return torch.distributions.Beta(concentration, concentration, validate_args=False).sample()


def _per_sample(values: torch.Tensor) -> torch.Tensor:
    return values[:, None, None, None]


def _boxes(area: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per sample, a box of about `area` of the image (its sides sqrt(area) of the image's), centred at a
    uniform point and clipped at the border: an (N, H, W) mask, true inside."""
    n, device = area.shape[0], area.device
    side = area.clamp(min=0).sqrt()
    cy, cx = torch.rand(n, device=device) * height, torch.rand(n, device=device) * width
    half_h, half_w = side * height / 2, side * width / 2
    ys = torch.arange(height, device=device, dtype=torch.float32)[None, :, None]
    xs = torch.arange(width, device=device, dtype=torch.float32)[None, None, :]
    return (((ys >= (cy - half_h)[:, None, None]) & (ys < (cy + half_h)[:, None, None]))
            & ((xs >= (cx - half_w)[:, None, None]) & (xs < (cx + half_w)[:, None, None])))
