"""fp32 master weights (model.dtype): a pretrained model stored in bf16 trains with fp32 parameters and AdamW
state; pure bf16 training only where the job asks for it, and never with fp16's gradient scaler."""

import pytest
import torch

from behemoth.errors import ConfigError
from behemoth.job import config_from_dict
from behemoth.worker.precision import master_weights
from conftest import lm_job_dict


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face folder in bf16 (as hub checkpoints are)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16_llama")
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                  vocab_size=400)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_a_bf16_checkpoint_trains_with_fp32_parameters_and_optimizer_state(bf16_llama, tmp_path):
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.worker.optim import build_optimizer

    cfg = config_from_dict(lm_job_dict(tmp_path, tmp_path, model={"pretrained": str(bf16_llama), "hf_config": {}},
                                       train={"optimizer": "adamw", "precision": "bf16"}))
    loaded = build_causal_lm(cfg.model, vocab_size=400, eos_id=0, bos_id=None, seq_len=32)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}  # transformers keeps the stored dtype
    stored = {k: v.clone() for k, v in loaded.state_dict().items()}

    model = master_weights(loaded, cfg.model.dtype)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    assert all(torch.equal(model.state_dict()[k].to(torch.bfloat16), v) for k, v in stored.items())  # the values
    optimizer = build_optimizer(model, cfg.train)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=torch.randint(0, 400, (2, 16)), labels=torch.randint(0, 400, (2, 16))).loss
    loss.backward()
    optimizer.step()
    assert {s.dtype for state in optimizer.state.values() for k, s in state.items() if k != "step"} == {torch.float32}


def test_pure_bf16_only_on_purpose(tmp_path):
    cfg = config_from_dict(lm_job_dict(tmp_path, tmp_path, model={"dtype": "bfloat16"}))
    model = master_weights(torch.nn.Linear(4, 4), cfg.model.dtype)
    assert model.weight.dtype == torch.bfloat16
    assert config_from_dict(lm_job_dict(tmp_path, tmp_path)).model.dtype == "float32"
    with pytest.raises(ConfigError, match="model.dtype bfloat16 with train.precision fp16"):
        config_from_dict(lm_job_dict(tmp_path, tmp_path, model={"dtype": "bfloat16"},
                                     train={"precision": "fp16"}, scaling={"use_gpu": True}))


def test_adamw_takes_the_jobs_betas_and_eps_and_is_fused_only_on_a_gpu(tmp_path):
    from behemoth.worker.optim import build_optimizer

    cfg = config_from_dict(lm_job_dict(tmp_path, tmp_path, train={"adam_betas": [0.9, 0.95], "adam_eps": 1e-6}))
    optimizer = build_optimizer(torch.nn.Linear(4, 4), cfg.train)
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6 for g in optimizer.param_groups)
    assert not any(g.get("fused") for g in optimizer.param_groups)  # CPU parameters: the default kernel
    with pytest.raises(ConfigError, match="train.adam_betas needs two values"):
        config_from_dict(lm_job_dict(tmp_path, tmp_path, train={"adam_betas": [0.9, 1.0]}))


@pytest.mark.gpu
def test_adamw_is_fused_on_a_gpu_and_updates_as_the_default_kernel(tmp_path):
    from behemoth.worker.optim import build_optimizer

    cfg = config_from_dict(lm_job_dict(tmp_path, tmp_path))
    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 64).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = build_optimizer(models[0], cfg.train)
    plain = torch.optim.AdamW([{"params": [models[1].weight], "weight_decay": cfg.train.weight_decay},
                               {"params": [models[1].bias], "weight_decay": 0.0}], lr=cfg.train.lr)
    assert all(g["fused"] for g in fused.param_groups)
    x = torch.randn(8, 64, device="cuda")
    for model, opt in zip(models, (fused, plain)):
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(models[0].weight, models[1].weight, atol=1e-6, rtol=1e-5)


def test_a_bf16_model_keeps_its_rotary_frequencies_in_float32():
    """model.dtype bfloat16 cast every buffer, the rotary embedding's inv_freq too: its angles moved from the ones
    the model was pretrained with (cos off by 0.1 at position 1,024) and from those its export computes
    (transformers' from_pretrained(dtype=bf16) keeps the non-persistent buffer in float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from behemoth.models.wrappers import in_model_dtype

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    want = model.model.rotary_emb.inv_freq.clone()
    model = in_model_dtype(model, "bfloat16")
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(model.model.rotary_emb.inv_freq, want)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
