"""DPO's objective, apart from the task that trains it (tasks/preference.py): each reply's log-probability sum from
the model's logits over packed pair blocks, the sigmoid loss (cDPO's label smoothing, RPO's NLL term) and the
pairs' sums under TRL's metric names. Plain tensor functions: the loss, the evaluation and the reference pass
(tasks/preference_reference.py) share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from behemoth.data.chat.chat import REJECTED, START, split_flags

# The sums a report window and an evaluation keep (summed over micro-batches and ranks, then divided by pairs).
PAIR_SUMS = ("pairs", "loss", "chosen", "rejected", "correct", "logps_chosen", "logps_rejected", "nll")


def dpo_losses(policy: tuple, reference: tuple[torch.Tensor, torch.Tensor], beta: float,
               label_smoothing: float = 0.0, rpo_alpha: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(each pair's loss, the pairs' sums by PAIR_SUMS' names) from the policy's and the reference's
    log-probability sums of the chosen and the rejected replies (each a [pairs] tensor; the policy's with the
    chosen replies' token counts third); `rpo_alpha`: the chosen reply's mean token NLL added, so weighted."""
    (pc, pr, tokens), (rc, rr) = policy, reference
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    logits = chosen - rejected
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    nll = -pc / tokens.clamp(min=1)
    if rpo_alpha:
        losses = losses + rpo_alpha * nll
    chosen, rejected = chosen.detach(), rejected.detach()
    sums = {"pairs": torch.full((), float(len(pc)), device=pc.device), "loss": losses.detach().sum(),
            "chosen": chosen.sum(), "rejected": rejected.sum(), "correct": (chosen > rejected).float().sum(),
            "logps_chosen": pc.detach().sum(), "logps_rejected": pr.detach().sum(), "nll": nll.detach().sum()}
    return losses, sums


def pair_metrics(sums: dict[str, float], prefix: str = "") -> dict:
    """TRL's names for the pairs' means (`prefix`: val_ for the held-out pairs')."""
    pairs = max(sums["pairs"], 1.0)
    return {f"{prefix}rewards/chosen": sums["chosen"] / pairs, f"{prefix}rewards/rejected": sums["rejected"] / pairs,
            f"{prefix}rewards/accuracies": sums["correct"] / pairs,
            f"{prefix}rewards/margins": (sums["chosen"] - sums["rejected"]) / pairs,
            f"{prefix}logps/chosen": sums["logps_chosen"] / pairs,
            f"{prefix}logps/rejected": sums["logps_rejected"] / pairs, f"{prefix}nll_loss": sums["nll"] / pairs}


def sequence_logps(logits: torch.Tensor, stored: torch.Tensor, counts: bool = False) -> tuple:
    """(chosen, rejected) log-probability sums over each pair's trained tokens, [pairs] each in block order, from
    the model's logits for stored blocks ([B, L, V] and [B, L]); with `counts`, the chosen replies' trained
    token counts third. A trained token is predicted from the one before it, in its own document (a document's
    first token is never a target)."""
    ids, trained, starts = split_flags(stored)
    targets = trained[:, 1:] & ~starts[:, 1:]
    scores = logits[:, :-1].float()
    token = scores.gather(-1, ids[:, 1:, None]).squeeze(-1) - scores.logsumexp(dim=-1)
    document = starts.long().cumsum(dim=1)  # each token's document in its row, from 1
    width = stored.shape[1] + 1
    sums = torch.zeros(stored.shape[0], width, dtype=torch.float32, device=stored.device)
    sums.scatter_add_(1, document[:, 1:], torch.where(targets, token, 0.0))
    # each document's kind, from its first token: a chosen reply's has TRAIN tokens and no REJECTED flag,
    # padding has no TRAIN token (data/chat/pair_render.py); pairs are adjacent, chosen first
    first = torch.zeros(stored.shape[0], width, dtype=stored.dtype, device=stored.device)
    first.scatter_(1, torch.where(starts, document, 0), torch.where(starts, stored, 0))
    counted = torch.zeros(stored.shape[0], width, dtype=torch.long, device=stored.device)
    counted.scatter_add_(1, document, trained.long())
    is_rejected = (first & REJECTED) != 0
    is_chosen = (counted > 0) & ~is_rejected & ((first & START) != 0)
    if not counts:
        return sums[is_chosen], sums[is_rejected]
    tokens = torch.zeros(stored.shape[0], width, dtype=torch.float32, device=stored.device)
    tokens.scatter_add_(1, document[:, 1:], targets.float())
    return sums[is_chosen], sums[is_rejected], tokens[is_chosen]


def made_up(batch: dict) -> bool:
    """example_batch's blocks (sample id -1), not the data's."""
    ids = batch.get("sample_id")
    return ids is not None and len(ids) > 0 and int(ids.min()) < 0


def pairs_per_row(stored: torch.Tensor) -> torch.Tensor:
    """How many pairs each block holds (its rejected replies' first tokens)."""
    return (((stored & START) != 0) & ((stored & REJECTED) != 0)).sum(dim=-1)
