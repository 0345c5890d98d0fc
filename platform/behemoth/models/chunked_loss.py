"""A causal LM's training loss without its whole logits.

transformers' causal LMs compute the loss from the full logits, [batch, seq, vocab], upcast to fp32: at Llama 3's
128k vocabulary and 8 x 2,048 tokens that is 8.4 GB, usually the largest activation of a 1B model, held from the
forward to the backward. Here the output projection and the cross-entropy run together over chunks of tokens
(Liger's fused linear cross-entropy, in plain torch): each chunk's logits are made, turned into the chunk's loss
and its gradients with respect to the hidden states and the projection's weight, and dropped; the backward only
scales the gradients already made. The peak is one chunk's logits (CHUNK_BYTES), not the whole; the work is the
same matmuls (no recomputation). The loss equals transformers' (the same shift, -100 ignored, the sum over
`num_items_in_batch` or the mean over the predicted tokens) within float rounding.

`use_chunked_loss(model)` makes a transformers model's forward take this path whenever it is given `labels`
(training and evaluation), and leaves every other call (generation, logits) to the model's own forward. It applies
where the logits are a plain linear projection of the decoder's last hidden state; a model that scales or caps its
logits (Gemma's softcapping, Cohere's logit_scale) keeps the dense loss, said by `chunked_loss_problem`.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

CHUNK_BYTES = 256 << 20  # one chunk's fp32 logits at most (rows = this / (vocabulary x 4), at least 1)
IGNORE = -100


class LinearCrossEntropy(torch.autograd.Function):
    """sum over the rows of `hidden` whose label is not IGNORE of -log softmax(hidden @ weight.T + bias)[label],
    times `scale`, with its gradients made in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale: float, rows: int):
        # only the gradients something needs (LoRA freezes the projection: its [vocab, d] gradient is not made)
        wants_weight, wants_bias = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if wants_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kind = hidden.device.type
        compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start:start + rows], labels[start:start + rows]
            logits = F.linear(h, weight, bias).float()  # [rows, vocab]: the only full-width tensor, one chunk's
            valid = y != IGNORE
            target = y.clamp(min=0)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            # log-sum-exp and the softmax in place (torch.logsumexp would make a second chunk-sized tensor)
            top = logits.amax(dim=-1)
            grad = logits.sub_(top[:, None]).exp_()
            sums = grad.sum(dim=-1)
            total += ((top + sums.log() - picked) * valid).sum()
            # d(loss)/d(logits) = softmax - one-hot, on the valid rows
            grad.div_(sums[:, None])
            grad[torch.arange(len(y), device=y.device), target] -= 1.0
            grad.mul_(valid[:, None])
            # the gradients' matmuls in the dtype the projection ran in (autocast's bf16 on a GPU), summed in fp32
            g = grad.to(compute)
            grad_hidden[start:start + rows] = (g @ weight.to(compute)).to(hidden.dtype)
            if grad_weight is not None and compute == torch.float32:
                grad_weight.addmm_(g.t(), h.float())  # (in place: no second [vocab, d] tensor)
            elif grad_weight is not None:
                grad_weight += (g.t() @ h.to(compute)).float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        none = torch.empty(0)
        ctx.save_for_backward(grad_hidden, none if grad_weight is None else grad_weight,
                              none if grad_bias is None else grad_bias)
        ctx.scale, ctx.wants = scale, (grad_weight is not None, grad_bias is not None)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        factor = grad_output * ctx.scale
        return (grad_hidden * factor.to(grad_hidden.dtype),
                (grad_weight * factor).to(ctx.weight_dtype) if ctx.wants[0] else None,
                (grad_bias * factor).to(ctx.weight_dtype) if ctx.wants[1] else None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """The mean (over `num_items`, else over the labels not IGNORE) token loss of hidden [N, d] projected by
    weight [V, d] (+ bias), never holding more than one chunk's logits."""
    rows = max(1, CHUNK_BYTES // (weight.shape[0] * 4))
    count = (labels != IGNORE).sum() if num_items is None else num_items
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):  # (an evaluation)
        summed = _loss_only(hidden, weight, bias, labels, rows)
        return summed / (count.to(summed.dtype).clamp(min=1) if torch.is_tensor(count) else max(count, 1))
    if torch.is_tensor(count):
        summed = LinearCrossEntropy.apply(hidden, weight, bias, labels, 1.0, rows)
        return summed / count.to(summed.dtype).clamp(min=1)
    return LinearCrossEntropy.apply(hidden, weight, bias, labels, 1.0 / max(count, 1), rows)


def _loss_only(hidden, weight, bias, labels, rows: int) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        y = labels[start:start + rows]
        logits = F.linear(hidden[start:start + rows], weight, bias).float()
        total += F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
    return total


def chunked_loss_problem(model) -> str | None:
    """Why `model` keeps the dense loss (None: the chunked one applies)."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "its logits are not one linear projection"
    if not hasattr(model, "get_decoder") or model.get_decoder() is None:
        return "its decoder cannot be called apart from its head"
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"it scales or caps its logits ({key})"
    return None


def use_chunked_loss(model) -> bool:
    """Route `model(..., labels=...)` through the chunked loss (see the module); False where it does not apply."""
    if chunked_loss_problem(model) is not None:
        return False
    dense = model.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None,
                num_items_in_batch=None, **kwargs):
        if labels is None or kwargs.get("inputs_embeds") is not None or kwargs.get("return_dict") is False:
            return dense(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                         use_cache=use_cache, num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs.pop("logits_to_keep", None)  # (the head's business, which this forward does itself)
        out = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, **kwargs)
        hidden = out.last_hidden_state[:, :-1]
        head = self.get_output_embeddings()
        shifted = labels[:, 1:].to(hidden.device)
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                    shifted.reshape(-1), num_items_in_batch)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
    return True
