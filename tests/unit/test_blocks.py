"""A model's blocks, and what is applied per block (worker/block_transforms.py): activation checkpointing gives the
gradients (and batch-norm statistics) of training without it; compile works block by block, leaving the model's
parameters and state-dict keys as they are."""

from __future__ import annotations

import copy

import pytest
import torch

from behemoth import hosts

from behemoth.worker.block_transforms import blocks, checkpoint_activations


def _llama(dropout: float = 0.1):
    """(dropout: the recomputation must draw the same masks)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                  attention_dropout=dropout)
    return AutoModelForCausalLM.from_config(config)


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(num_labels=5, layer_type="bottleneck", depths=[1, 2],
                                                     hidden_sizes=[16, 32], embedding_size=8))


def test_the_blocks_are_the_repeated_units():
    assert [type(b).__name__ for b in blocks(_llama())] == ["LlamaDecoderLayer"] * 4
    assert [type(b).__name__ for b in blocks(_resnet())] == ["ResNetBottleNeckLayer"] * 3
    from behemoth.models.regnet import regnet_tiny_cifar

    assert {type(b).__name__ for b in blocks(regnet_tiny_cifar(10))} == {"XLayer"}
    assert blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def _step(model, batch, loss_of):
    torch.manual_seed(1)
    model.train()
    loss_of(model, batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy, checkpointed", [("full", 4), (2, 2)])
def test_checkpointing_a_transformer_gives_the_same_gradients(policy, checkpointed):
    plain = _llama()
    ours = copy.deepcopy(plain)
    assert checkpoint_activations(ours, policy) == checkpointed
    ids = torch.randint(0, 100, (2, 16))

    def loss_of(model, ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    expected, got = _step(plain, ids, loss_of), _step(ours, ids, loss_of)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    assert ours.state_dict().keys() == plain.state_dict().keys()


def test_checkpointing_a_resnet_keeps_gradients_and_batch_norm_statistics():
    """The backward recomputes each residual unit's forward: its batch norms would update their running
    statistics a second time, unless put back."""
    plain = _resnet()
    ours = copy.deepcopy(plain)
    assert checkpoint_activations(ours, "full") == 3
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])

    def loss_of(model, images):
        return torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)

    expected, got = _step(plain, images, loss_of), _step(ours, images, loss_of)
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    buffers = dict(plain.named_buffers())
    assert all(torch.equal(buffers[n], b) for n, b in ours.named_buffers())  # running stats, batches tracked
    assert checkpoint_activations(_resnet(), "none") == 0


class _Host(hosts.WorkerHost):
    """One worker on the CPU, no Ray: what parallel.wrap asks of its host."""

    @property
    def device(self):
        return torch.device("cpu")

    def prepare_model(self, model, wrap_ddp):
        return model


def _wrapped(model, lines, **train):
    from behemoth.job import config_from_dict
    from behemoth.worker import parallel

    cfg = config_from_dict({"data": {"kind": "image_folder", "root": "."}, "model": {"name": "resnet18"},
                            "train": train, "scaling": {"num_workers": 1}})
    with hosts.hosted(_Host()):
        return parallel.wrap(model, cfg, console=lines.append)[0]


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def test_compile_goes_block_by_block_and_trains_as_eager():
    """train.compile: each block compiled in place (the parameter names stay), checked at the first step; a loss
    and gradients as eager's within float rounding (compiled kernels fuse; no dropout: compiled code draws its
    own random numbers). Activation checkpointing goes first, in the same blocks."""
    plain = _llama(dropout=0.0)
    lines = []
    ours = _wrapped(copy.deepcopy(plain), lines, compile=True, activation_checkpointing="full")
    assert [n for n, _ in ours.named_parameters()] == [f"_orig_mod.{n}" for n, _ in plain.named_parameters()]
    ids = torch.randint(0, 100, (2, 16))
    expected, got = _step(plain, ids, _lm_loss), _step(ours, ids, _lm_loss)
    assert lines[0] == "activation checkpointing: 4 of 4 blocks"
    assert "torch.compile (mode default, 4 blocks): first step compiled in" in lines[1]
    assert all(b._compiled_call_impl is not None for b in blocks(ours._orig_mod))
    assert all(torch.allclose(expected[n], got[f"_orig_mod.{n}"],
                              rtol=1e-4, atol=1e-5) for n in expected)


def test_a_block_compilation_that_fails_trains_eagerly():
    """A real compiler failure (inductor pointed at a C++ compiler that does not exist): one line, the blocks
    back to eager, and eager's numbers exactly."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    plain = _llama(dropout=0.0)
    lines = []
    ids = torch.randint(0, 100, (2, 16))
    # (the config's own patch: monkeypatch's undo of a config attribute deletes it, breaking later compiles)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        ours = _wrapped(copy.deepcopy(plain), lines, compile=True)
        got = _step(ours, ids, _lm_loss)
    torch._dynamo.reset()
    assert len(lines) == 1 and "torch.compile (mode default, 4 blocks) failed, training eagerly" in lines[0]
    assert all(b._compiled_call_impl is None for b in blocks(ours._orig_mod))
    expected = _step(plain, ids, _lm_loss)
    assert all(torch.equal(expected[n], got[f"_orig_mod.{n}"]) for n in expected)


def test_gpu_settings_leave_a_cpu_run_alone_and_set_a_gpu_runs():
    """(Called with a CUDA device on this machine: the settings touch no CUDA API.)"""
    from behemoth.worker.precision import device_settings

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.benchmark = False
        model = device_settings(_resnet(), torch.device("cpu"), tf32=True, channels_last=True)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.benchmark
        assert model.resnet.embedder.embedder.convolution.weight.is_contiguous()
        model = device_settings(model, torch.device("cuda"), tf32=True, channels_last=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
        assert model.resnet.embedder.embedder.convolution.weight.is_contiguous(memory_format=torch.channels_last)
        device_settings(_llama(), torch.device("cuda"), tf32=False, channels_last=False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


def test_channels_last_input_is_the_same_numbers():
    from behemoth.data.image.image_batches import normalise

    images = torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8)
    valid = torch.tensor([True, False, True, True])
    mean, std = torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    plain, last = normalise(images, valid, mean, std), normalise(images, valid, mean, std, channels_last=True)
    assert torch.equal(plain, last) and last.is_contiguous(memory_format=torch.channels_last)
