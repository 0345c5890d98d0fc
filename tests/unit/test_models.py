import math

import pytest
import torch

from behemoth.config import ConfigError
from behemoth.models.registry import MODELS, build_model


def test_registry_builds_transformers_resnets():
    from transformers import ResNetForImageClassification

    for name in MODELS:
        assert isinstance(build_model(name, 10), ResNetForImageClassification)


@pytest.mark.parametrize("name,size", [("resnet_tiny_cifar", 32), ("resnet18_cifar", 32), ("resnet18", 64)])
def test_forward_shapes(name, size):
    model = build_model(name, 7).eval()
    with torch.no_grad():
        logits = model(pixel_values=torch.randn(2, 3, size, size)).logits
    assert logits.shape == (2, 7)


def test_cifar_stem_keeps_resolution():
    model = build_model("resnet18_cifar", 10)
    stem = model.resnet.embedder(torch.randn(1, 3, 32, 32))
    assert stem.shape[-2:] == (32, 32)  # the ImageNet stem would give 8x8
    assert build_model("resnet18", 10).resnet.embedder(torch.randn(1, 3, 32, 32)).shape[-2:] == (8, 8)


def test_resnet_sizes_match_the_papers():
    def params(name):
        return sum(p.numel() for p in build_model(name, 1000).parameters()) / 1e6

    assert 11.0 < params("resnet18") < 12.5  # torchvision resnet18: 11.7M
    assert 25.0 < params("resnet50") < 26.2  # torchvision resnet50: 25.6M


def test_unknown_model():
    with pytest.raises(ConfigError, match="did you mean 'resnet50'"):
        build_model("resnet51", 10)


def test_causal_lm_from_config_takes_the_tokenizers_vocabulary():
    from transformers import LlamaForCausalLM

    from behemoth.config import ModelConfig
    from behemoth.models.causal_lm import build_causal_lm

    cfg = ModelConfig(name="causal_lm", hf_config={"model_type": "llama", "hidden_size": 32,
                                                   "intermediate_size": 64, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "max_position_embeddings": 64})
    model = build_causal_lm(cfg, vocab_size=300, eos_id=0, bos_id=None, seq_len=64)
    assert isinstance(model, LlamaForCausalLM) and model.config.vocab_size == 300
    assert model.config.eos_token_id == model.config.bos_token_id == 0
    ids = torch.randint(0, 300, (2, 16))
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(math.log(300), rel=0.1)
    with pytest.raises(ConfigError, match=r"max_position_embeddings 64 < data.seq_len 128"):
        build_causal_lm(cfg, vocab_size=300, eos_id=0, bos_id=None, seq_len=128)
    small = ModelConfig(name="causal_lm", hf_config={**cfg.hf_config, "vocab_size": 100})
    with pytest.raises(ConfigError, match=r"vocab_size 100 is smaller than the tokenizer's 300"):
        build_causal_lm(small, vocab_size=300, eos_id=0, bos_id=None, seq_len=64)
    with pytest.raises(ConfigError, match="model.hf_config: .*lama2"):
        build_causal_lm(ModelConfig(name="causal_lm", hf_config={"model_type": "lama2"}), vocab_size=300,
                        eos_id=0, bos_id=None, seq_len=64)
