"""The causal LM's loss without its whole logits (issue 74 item 3): the chunked linear cross-entropy gives
transformers' loss and gradients within float rounding, across chunks, with ignored labels and a given token
count, on a real transformers Llama (with document masks and LoRA), and never holds more than one chunk's
logits."""

import pytest
import torch
import torch.nn.functional as F

from behemoth.models import chunked_loss
from behemoth.models.chunked_loss import IGNORE, chunked_loss_problem, linear_cross_entropy, use_chunked_loss


def _dense(hidden, weight, bias, labels, num_items=None):
    logits = F.linear(hidden, weight, bias).float()
    summed = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return summed / (num_items if num_items is not None else (labels != IGNORE).sum())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 37])
def test_the_chunked_loss_and_its_gradients_are_the_dense_ones(monkeypatch, bias, num_items):
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 7 * 50 * 4)  # 7 rows a chunk: 100 rows in 15 chunks
    torch.manual_seed(0)
    hidden = torch.randn(100, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True) if bias else None
    labels = torch.randint(0, 50, (100,))
    labels[::9] = IGNORE
    count = torch.tensor(num_items) if num_items is not None else None
    got = linear_cross_entropy(hidden, weight, b, labels, count)
    grads = torch.autograd.grad(got * 3.0, [hidden, weight] + ([b] if bias else []))
    want = _dense(hidden, weight, b, labels, count)
    expected = torch.autograd.grad(want * 3.0, [hidden, weight] + ([b] if bias else []))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # (an evaluation: the loss alone)
        assert torch.allclose(linear_cross_entropy(hidden, weight, b, labels, count), want, rtol=1e-5)


def _llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tie", [False, True])
def test_a_transformers_llama_trains_on_the_same_loss_and_gradients(tie):
    dense, chunked = _llama(tie), _llama(tie)
    assert use_chunked_loss(chunked) and chunked_loss_problem(chunked) is None
    ids = torch.randint(0, 300, (3, 40))
    positions = torch.arange(40).repeat(3, 1)
    positions[:, 17:] -= 17  # two documents a row: transformers masks across them from the positions
    labels = ids.masked_fill(positions == 0, IGNORE)
    for kwargs in ({"labels": ids}, {"labels": labels, "position_ids": positions, "num_items_in_batch": torch.tensor(90)}):
        a = dense(input_ids=ids, use_cache=False, **kwargs).loss
        b = chunked(input_ids=ids, use_cache=False, **kwargs).loss
        assert torch.allclose(a, b, rtol=1e-5), (a, b)
        ga = torch.autograd.grad(a, list(dense.parameters()))
        gb = torch.autograd.grad(b, list(chunked.parameters()))
        for x, y in zip(ga, gb):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)
    assert chunked(input_ids=ids).logits.shape == (3, 40, 300)  # without labels: the model's own forward


def test_models_that_scale_their_logits_keep_the_dense_loss():
    model = _llama()
    model.config.final_logit_softcapping = 30.0
    assert "caps its logits" in chunked_loss_problem(model) and not use_chunked_loss(model)


def test_never_more_than_one_chunks_logits(monkeypatch):
    """The projection runs a chunk of rows at a time: no [tokens, vocab] tensor is ever made."""
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 10 * 50 * 4)  # 10 rows of a 50-word vocabulary
    made = []
    real = chunked_loss.F.linear

    def linear(*args):
        out = real(*args)
        made.append(tuple(out.shape))
        return out

    monkeypatch.setattr(chunked_loss, "F", type("F", (), {"linear": staticmethod(linear),
                                                          "cross_entropy": staticmethod(F.cross_entropy)}))
    hidden = torch.randn(95, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (95,))
    linear_cross_entropy(hidden, weight, None, labels).backward()
    with torch.no_grad():
        linear_cross_entropy(hidden, weight, None, labels)
    assert made and max(rows for rows, _ in made) == 10 and len(made) == 20  # 10 chunks, twice


def test_lora_adapters_over_the_chunked_loss_give_the_dense_loss_and_gradients(tmp_path):
    """With LoRA's adapters over a chunked-loss model (peft calls the model's forward, the patched one) the loss
    and the adapters' gradients are the dense path's (that the workers' model has it: the test below)."""
    from behemoth.models.lora import add_adapters
    from behemoth.config.schema import LoraConfig

    dense, chunked = _llama(), _llama()
    assert use_chunked_loss(chunked)
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(1)
    dense = add_adapters(dense, lora, "CAUSAL_LM")
    torch.manual_seed(1)
    chunked = add_adapters(chunked, lora, "CAUSAL_LM")
    ids = torch.randint(0, 300, (2, 30))
    a = dense(input_ids=ids, labels=ids, use_cache=False).loss
    b = chunked(input_ids=ids, labels=ids, use_cache=False).loss
    assert torch.allclose(a, b, rtol=1e-5)
    trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    for x, y in zip(torch.autograd.grad(a, trained(dense)), torch.autograd.grad(b, trained(chunked))):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)


def test_under_autocast_the_loss_is_the_dense_ones_within_bf16_rounding():
    """On a GPU the workers train under bf16 autocast: the chunks' matmuls run in bf16 as the dense path's do
    (checked here with the CPU's autocast), the loss and gradients within bf16's rounding of the dense path's."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    labels = torch.randint(0, 100, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, weight, None, labels)
        want = F.cross_entropy(F.linear(hidden, weight).float(), labels)
    g = torch.autograd.grad(got, [hidden, weight])
    e = torch.autograd.grad(want, [hidden, weight])
    assert torch.allclose(got, want, rtol=2e-2)
    for x, y in zip(g, e):
        assert torch.allclose(x, y, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("lora", [False, True])
def test_the_workers_model_takes_the_chunked_loss_and_the_served_one_keeps_its_logits(tmp_path, lora):
    """CausalLM.build_model (what the workers train) computes the loss without logits, equal to the dense
    model's; build_lm without `train` (generate, export, evaluation from a checkpoint) keeps them."""
    from types import SimpleNamespace

    from behemoth.job import config_from_dict
    from behemoth.tasks.causal_lm import CausalLM, build_lm
    from conftest import lm_job_dict

    job = lm_job_dict(tmp_path, tmp_path)
    if lora:
        job["model"]["lora"] = {"r": 4, "alpha": 8}
    cfg = config_from_dict(job)
    task = object.__new__(CausalLM)  # (the driver's data preparation is not needed to build the model)
    task.cfg, task.index = cfg, SimpleNamespace(vocab_size=300, eos_id=0, bos_id=None)
    torch.manual_seed(0)
    trained = task.build_model()
    torch.manual_seed(0)
    dense = build_lm(cfg, 300, 0, None, train=True, chunked_loss=False)
    ids = torch.randint(0, 300, (2, 32))
    out = trained(input_ids=ids, labels=ids, use_cache=False)
    want = dense(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits is None and want.logits is not None
    assert torch.allclose(out.loss, want.loss, rtol=1e-5)
    served = build_lm(cfg, 300, 0, None)
    assert served(input_ids=ids, labels=ids, use_cache=False).logits.shape == (2, 32, 300)
