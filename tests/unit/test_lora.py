"""model.lora (issue 58): LoRA adapters through peft on a transformers causal LM built from a config: only the
adapters train and are checkpointed, a resume from that checkpoint continues exactly, and the export holds
both PEFT's adapter folder and the merged model, each predicting what the training model predicts."""

import json

import pytest
import torch

from behemoth.config import dump_yaml
from behemoth.job import config_from_dict
from behemoth.storage.checkpoint import TrainState
from behemoth.tasks.causal_lm import build_lm
from behemoth.checkpoints import live_state
from behemoth.worker.loop import train_step
from behemoth.worker.optim import build_optimizer, lr_schedule
from behemoth.worker.precision import grad_scaler
from conftest import lm_job_dict


class _LanguageModelling:
    def loss(self, model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss, \
            torch.tensor(float(len(batch["input_ids"])))

    def loss_items(self, batch):  # the Task contract's default: each micro-batch's mean weighs the same
        return None


def _built(cfg, tok):
    torch.manual_seed(cfg.train.seed)  # as the worker's loop seeds it before building
    model = build_lm(cfg, len(tok), tok.eos_token_id, tok.bos_token_id, train=True)
    optimizer = build_optimizer(model, cfg.train)
    return model, optimizer, lr_schedule(optimizer, cfg.train, total_steps=20)


def _steps(model, optimizer, scheduler, cfg, seeds):
    for seed in seeds:
        ids = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(seed))
        train_step(model, optimizer, scheduler, grad_scaler(torch.device("cpu"), "fp32"), [{"input_ids": ids}], cfg,
                   _LanguageModelling(), torch.device("cpu"))


def _loss(model, seed: int) -> float:
    """The model's loss on _steps's batch of `seed`, without dropout."""
    model.eval()
    with torch.no_grad():
        ids = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(seed))
        loss = _LanguageModelling().loss(model, {"input_ids": ids})[0].item()
    model.train()
    return loss


def test_lora_trains_and_keeps_only_adapters_resumes_exactly_and_exports_adapter_and_merged_model(text_corpus, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, pipeline

    from behemoth.data.chat.chat import tokenizer_files
    from behemoth.data.text.text import load_tokenizer
    from behemoth.driver.commands.export import export
    from behemoth.driver.commands.generate import Sampling, load_generator
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.tasks.kept_tokenizer import kept_tokenizer_files

    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, scaling={"num_workers": 1},
                                       train={"optimizer": "adamw", "lr": 0.05},
                                       model={"lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}}))
    tok = load_tokenizer(cfg.data.tokenizer)
    model, optimizer, scheduler = _built(cfg, tok)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    base = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = _loss(model, seed=0)
    _steps(model, optimizer, scheduler, cfg, [0, 0, 0])
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)  # the base is frozen
    # the adapters trained and took effect (issue 65: with lora_alpha 0 every assert here passed): lora_B starts
    # at zero and moves only where the adapters' output counts; the loss of the batch trained on fell
    adapters_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert adapters_b and all(p.abs().sum() > 0 for p in adapters_b)
    assert _loss(model, seed=0) < before - 0.03, (before, _loss(model, seed=0))  # (here 5.99 -> 5.89)

    ckpt = tmp_path / "checkpoint"
    live_state.save(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, state=TrainState(step=3),
                       task_files=kept_tokenizer_files(tokenizer_files(tok)), job_yaml=dump_yaml(cfg))
    kept = torch.load(ckpt / "model.pt", weights_only=True)
    assert set(kept) == {n for n in model.state_dict() if n in trained} and kept  # the adapters, nothing else
    full = sum(v.numel() for v in model.state_dict().values())
    assert sum(v.numel() for v in kept.values()) < full / 10

    resumed, optimizer2, scheduler2 = _built(cfg, tok)  # a restarted worker: same seed, fresh adapters
    live_state.load(ckpt, model=resumed, optimizer=optimizer2, scheduler=scheduler2)
    _steps(model, optimizer, scheduler, cfg, [7])
    _steps(resumed, optimizer2, scheduler2, cfg, [7])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    out = tmp_path / "export"
    export(str(ckpt), str(out))
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(11))
    kept_model = resumed  # (state at step 4; the exported checkpoint is step 3's: compare with that)
    live_state.load(ckpt, model=kept_model)
    kept_model.eval()
    with torch.no_grad():
        expected = kept_model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5)
        torch.manual_seed(cfg.train.seed)  # the base it was trained on: the same config and seed
        base_model = build_causal_lm(cfg.model, vocab_size=len(tok), eos_id=tok.eos_token_id, bos_id=tok.bos_token_id,
                                     seq_len=cfg.data.seq_len)
        adapted = PeftModel.from_pretrained(base_model, out / "adapter").eval()
        assert torch.allclose(adapted(input_ids=ids).logits, expected, atol=1e-5)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    generated = pipeline("text-generation", model=str(out))("once upon", max_new_tokens=2, do_sample=False)
    assert generated[0]["generated_text"].startswith("once upon")
    # `behemoth generate` on the checkpoint: the adapters merged, as in the export (a PeftModel is refused)
    generator = load_generator(str(ckpt))
    prompt = generator.encode("once upon", chat=False)
    expected = merged.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
    assert generator.complete(prompt, Sampling(max_new_tokens=4)) == expected.tolist()


def test_a_lora_checkpoint_of_a_model_with_tied_embeddings_keeps_the_adapters_alone(text_corpus, tmp_path):
    """An output layer tied to the embedding (Llama 3.2's, Gemma's) is one frozen parameter under two names, and
    named_parameters lists it once: the other name, lm_head.weight, was kept in every checkpoint (~1 GB at a 1B
    model's vocabulary in fp32). The checkpoint keeps the adapters alone, and the model export builds from it
    loads them."""
    job = lm_job_dict(text_corpus, tmp_path, scaling={"num_workers": 1},
                      model={"lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}})
    job["model"]["hf_config"]["tie_word_embeddings"] = True
    cfg = config_from_dict(job)
    from behemoth.data.text.text import load_tokenizer

    model, optimizer, scheduler = _built(cfg, load_tokenizer(cfg.data.tokenizer))
    kept = live_state.trained_state(model)
    assert kept and all("lora_" in name for name in kept), sorted(n for n in kept if "lora_" not in n)
    # ... and what export, generate and eval build from it loads (it named lm_head.weight missing)
    from behemoth.tasks.causal_lm import CausalLM

    _steps(model, optimizer, scheduler, cfg, [0])
    live_state.save(tmp_path / "c", model=model, optimizer=optimizer, scheduler=scheduler, state=TrainState(step=1),
                    task_files={}, job_yaml=dump_yaml(cfg))
    exported = CausalLM.model_from_checkpoint(cfg, str(tmp_path / "c"))
    assert _loss(exported, seed=3) == pytest.approx(_loss(model, seed=3), rel=1e-6)


def test_export_builds_the_model_in_the_runs_dtype_not_the_pretrained_files(text_corpus, tmp_path):
    """A float32 run from a bf16 pretrained model (from_pretrained keeps the stored dtype, the workers train in
    model.dtype): export built the model in bf16 and copied the trained fp32 weights into it, rounding away a
    third of the fine-tuning (a norm weight's whole update)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from behemoth.data.text.text import load_tokenizer
    from behemoth.tasks.causal_lm import CausalLM
    from behemoth.worker.precision import master_weights

    job = lm_job_dict(text_corpus, tmp_path, scaling={"num_workers": 1})
    tok = load_tokenizer(job["data"]["tokenizer"])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "pre")
    job["model"] = {"name": "causal_lm", "pretrained": str(tmp_path / "pre")}
    cfg = config_from_dict(job)
    model, optimizer, scheduler = _built(cfg, tok)
    model = master_weights(model, cfg.model.dtype)  # (as the workers hold it)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4)  # a fine-tuning's small update, under bf16's step near 1.0 (0.008)
    live_state.save(tmp_path / "c", model=model, optimizer=optimizer, scheduler=scheduler, state=TrainState(step=1),
                    task_files={}, job_yaml=dump_yaml(cfg))
    exported = CausalLM.model_from_checkpoint(cfg, str(tmp_path / "c"))
    assert {p.dtype for p in exported.parameters()} == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weight_average_of_a_lora_model_averages_its_adapters_over_the_shared_base(text_corpus, tmp_path, dtype):
    """train.ema_decay with model.lora: the average was a copy of the whole model (the frozen base's memory twice),
    updated over the base every step, and ema.pt held all of it. The base is shared now, the adapters averaged
    (in fp32 over bf16 weights), ema.pt holds them alone and loads back, and the average evaluates."""
    from behemoth.data.text.text import load_tokenizer
    from behemoth.worker.ema import WeightAverage
    from behemoth.worker.precision import master_weights

    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, scaling={"num_workers": 1},
                                       train={"optimizer": "adamw", "lr": 0.05, "ema_decay": 0.5},
                                       model={"dtype": dtype, "lora": {"r": 4, "alpha": 8.0,
                                                                       "target_modules": ["q_proj", "v_proj"]}}))
    model, optimizer, scheduler = _built(cfg, load_tokenizer(cfg.data.tokenizer))
    model = master_weights(model, dtype)
    ema = WeightAverage(model, decay=0.5)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    averaged = dict(ema.module.named_parameters())
    assert all(averaged[n] is p for n, p in frozen.items())  # the base: the model's own tensors
    assert ema.state_dict().keys() == live_state.trained_state(model).keys()
    assert {averaged[n].dtype for n in averaged if n not in frozen} == {torch.float32}
    optimizer = build_optimizer(model, cfg.train)
    _steps(model, optimizer, lr_schedule(optimizer, cfg.train, total_steps=20), cfg, [0])
    ema.update()
    b = next(n for n in averaged if "lora_B" in n)
    assert averaged[b].abs().sum() > 0 and not torch.equal(averaged[b], dict(model.named_parameters())[b].float())
    _loss(ema.module, seed=0)  # (the fp32 adapters over a bf16 base evaluate)
    live_state.save(tmp_path / "c", model=model, optimizer=optimizer, scheduler=scheduler, state=TrainState(step=1),
                    task_files={}, job_yaml="x: 1\n", ema=ema)
    again = WeightAverage(model, decay=0.5)
    again.load_state_dict(torch.load(tmp_path / "c" / "ema.pt", weights_only=True))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ema.state_dict().items())


def test_lora_is_refused_where_it_cannot_work(text_corpus, tmp_path):
    from behemoth.errors import ConfigError

    for sections, message in (
            ({"model": {"lora": {"r": 0}}}, "model.lora.r must be > 0"),
            ({"model": {"lora": {}}, "scaling": {"strategy": "fsdp_full"}}, "model.lora trains and checkpoints only"),
            ({"model": {"lora": {"target_modules": []}}}, "model.lora.target_modules is empty")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict(lm_job_dict(text_corpus, tmp_path, **sections))
    image = {"data": {"kind": "image_folder", "root": str(tmp_path)},
             "model": {"name": "regnet_tiny_cifar", "lora": {}}}
    with pytest.raises(ConfigError, match="model.lora adds adapters to a transformers language model"):
        config_from_dict(image)


def test_a_sequence_classifier_with_lora_trains_its_adapters_and_its_head():
    """model.name sequence_classifier with model.lora: peft's SEQ_CLS keeps the new classification head
    trainable beside the adapters, and a checkpoint keeps both (and nothing of the frozen base)."""
    from types import SimpleNamespace

    from behemoth.config import LoraConfig
    from behemoth.tasks.text_classification import build_classifier

    model_cfg = SimpleNamespace(name="sequence_classifier", pretrained=None, trust_remote_code=False, lora=LoraConfig(r=2),
                                hf_config={"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
                                           "num_attention_heads": 2, "intermediate_size": 64})
    cfg = SimpleNamespace(model=model_cfg, data=SimpleNamespace(max_length=16))
    model = build_classifier(cfg, ["neg", "pos"], vocab_size=100, pad_id=0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trained) and any("classifier" in n and "lora_" not in n for n in trained)
    kept = live_state.trained_state(model)
    assert set(kept) <= {n for n in model.state_dict()} and {n for n in trained} <= set(kept)
    assert not any("word_embeddings" in n for n in kept)
    # a few steps move the adapters (lora_B starts at zero: it moves only where the adapters' output counts,
    # issue 65) and lower the loss
    torch.manual_seed(0)
    ids, labels = torch.randint(1, 100, (4, 16)), torch.tensor([0, 1, 0, 1])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    adapters_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert adapters_b and all(p.abs().sum() > 0 for p in adapters_b)


@pytest.mark.parametrize("model_type, head", [("bart", "classification_head"), ("deberta-v2", "pooler")])
def test_a_classifiers_head_outside_peft_names_trains_too(model_type, head):
    """peft's SEQ_CLS keeps only modules named classifier, score or pre_classifier: BART's classification_head
    and DeBERTa's pooler (both built fresh for the task) stayed random and frozen for the whole run. Every
    top-level module outside the base model trains now."""
    from types import SimpleNamespace

    from behemoth.config import LoraConfig
    from behemoth.tasks.text_classification import build_classifier

    sizes = ({"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
              "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64} if model_type == "bart" else
             {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64})
    model_cfg = SimpleNamespace(name="sequence_classifier", pretrained=None, trust_remote_code=False,
                                lora=LoraConfig(r=2), hf_config={"model_type": model_type, **sizes})
    model = build_classifier(SimpleNamespace(model=model_cfg, data=SimpleNamespace(max_length=16)), ["neg", "pos"],
                             vocab_size=100, pad_id=0)
    heads = [(n, p.requires_grad) for n, p in model.named_parameters() if f".{head}." in n and "original_module" not in n]
    assert heads and all(grad for _, grad in heads), heads
    assert set(n for n, p in model.named_parameters() if p.requires_grad) <= set(live_state.trained_state(model))
