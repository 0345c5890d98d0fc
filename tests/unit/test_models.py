import math
import subprocess
import sys

import pytest
import torch

from behemoth.config import ConfigError
from behemoth.models.registry import MODELS, build_model


@pytest.mark.parametrize("name", list(MODELS))
def test_every_registered_model_round_trips_through_save_pretrained(name, tmp_path):
    """A stock transformers config expresses each registered model: saved and loaded with transformers alone,
    it computes the same logits (the CIFAR-stem ResNets it replaced could not: their stem is not in the config)."""
    from transformers import AutoModelForImageClassification, PreTrainedModel

    torch.manual_seed(0)
    trained = build_model(name, 7).eval()
    model = trained.to_transformers() if hasattr(trained, "to_transformers") else trained  # as export does
    assert isinstance(model, PreTrainedModel)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(trained(pixel_values=x).logits, loaded(pixel_values=x).logits)
    assert model(pixel_values=x).logits.shape == (2, 7)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_registered_model_shows_fsdp_its_logits(name):
    """FSDP hooks the tensors of a forward's output (found through torch's pytree) to gather the parameters
    again for backward; an output it cannot look into (the plain RegNet returned a SimpleNamespace) failed
    the first FSDP backward of every image job ("setStorage ... storage of size 0")."""
    from torch.utils._pytree import tree_leaves

    out = build_model(name, 7)(pixel_values=torch.randn(2, 3, 32, 32))
    assert any(leaf is out.logits for leaf in tree_leaves(out))


@pytest.mark.parametrize("name", ["regnet_tiny_cifar", "regnet_cifar"])
def test_the_plain_torch_regnet_is_transformers_regnet(name):
    """What the workers train is transformers' RegNetForImageClassification without its import: the same
    parameter and buffer names, the same initial weights for a seed, the same logits in train and eval mode."""
    from transformers import RegNetForImageClassification

    torch.manual_seed(3)
    ours = build_model(name, 10)
    torch.manual_seed(3)
    theirs = RegNetForImageClassification(ours.transformers_config())
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(4, 3, 32, 32)
    for train in (True, False):
        ours.train(train), theirs.train(train)
        assert torch.equal(ours(pixel_values=x).logits, theirs(pixel_values=x).logits)
    assert all(torch.equal(a[k], b[k]) for k in a)  # batch norm statistics moved alike in train mode


def test_building_a_regnet_does_not_import_transformers():
    """The point of the plain-torch RegNet: a training worker skips transformers' 4-7 s import."""
    code = ("import sys; from behemoth.models.registry import build_model; build_model('regnet_tiny_cifar', 3); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cifar_models_keep_more_resolution_than_the_imagenet_stem():
    x = torch.randn(1, 3, 32, 32)
    regnet = build_model("regnet_cifar", 10)
    first_stage = regnet.regnet.encoder.stages[0](regnet.regnet.embedder(x))
    assert first_stage.shape[-2:] == (16, 16)
    assert build_model("resnet18", 10).resnet.embedder(x).shape[-2:] == (8, 8)


def test_removed_cifar_resnets_name_their_replacement():
    with pytest.raises(ConfigError, match="'resnet_tiny_cifar' was removed.*Use 'regnet_tiny_cifar'"):
        build_model("resnet_tiny_cifar", 10)
    with pytest.raises(ConfigError, match="Use 'regnet_cifar'"):
        build_model("resnet18_cifar", 10)


def small_cnn(num_classes):  # a user's builder, by import path (tests.unit.test_models:small_cnn)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))


def not_a_module(num_classes):
    return {"classes": num_classes}


def needs_other_facts(vocab_size):
    return torch.nn.Linear(vocab_size, 2)


NOT_CALLABLE = 3


def test_a_builder_by_import_path_and_its_errors():
    from behemoth.models.registry import check_name, check_user_model

    assert isinstance(build_model("unit.test_models:small_cnn", 5), torch.nn.Sequential)
    check_user_model("unit.test_models:small_cnn", num_classes=5)
    with pytest.raises(ConfigError, match="module no_such_pkg.models cannot be imported"):
        check_name("no_such_pkg.models:build")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        check_name("unit.test_models:nope")
    with pytest.raises(ConfigError, match="NOT_CALLABLE is a int, not a function"):
        check_name("unit.test_models:NOT_CALLABLE")
    with pytest.raises(ConfigError, match=r"returned dict, not a torch.nn.Module \(called with num_classes=5\)"):
        check_user_model("unit.test_models:not_a_module", num_classes=5)
    with pytest.raises(ConfigError, match="calling it with num_classes=5 failed: TypeError"):
        check_user_model("unit.test_models:needs_other_facts", num_classes=5)


def test_image_classifier_from_hf_config_gets_the_classes_and_image_size():
    from transformers import ViTForImageClassification

    from behemoth.config import ModelConfig
    from behemoth.models.image_classifier import build_image_classifier

    cfg = ModelConfig(name="image_classifier", hf_config={
        "model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "patch_size": 8})
    model = build_image_classifier(cfg, num_classes=3, image_size=32)
    assert isinstance(model, ViTForImageClassification)
    assert model.config.num_labels == 3 and model.config.image_size == 32
    assert model(pixel_values=torch.randn(2, 3, 32, 32)).logits.shape == (2, 3)
    with pytest.raises(ConfigError, match="model.hf_config"):
        build_image_classifier(ModelConfig(name="image_classifier", hf_config={"model_type": "vitt"}),
                               num_classes=3, image_size=32)


def test_model_configs_transformers_refuses_are_one_line_before_ray(image_root, tmp_path, capsys):
    """Keys transformers' strict config classes refuse (64 hidden units over 5 attention heads) came out as
    huggingface_hub's raw StrictDataclassClassValidationError, which is no ValueError; and an image_classifier's
    hf_config was first built on the workers, after Ray Train had started (model_type vitt passed the check)."""
    import yaml

    from behemoth.config import ModelConfig
    from behemoth.driver.commands.cli import main
    from behemoth.models.causal_lm import causal_lm_config
    from conftest import job_dict

    lm = ModelConfig(name="causal_lm", hf_config={"model_type": "llama", "hidden_size": 64,
                                                  "num_attention_heads": 5})
    with pytest.raises(ConfigError, match=r"^model.hf_config: .*hidden size \(64\).* attention heads \(5\)"):
        causal_lm_config(lm, vocab_size=100, eos_id=0, bos_id=None)
    vitt = {"name": "image_classifier", "hf_config": {"model_type": "vitt"}}
    job = job_dict(image_root, tmp_path / "runs", model=vitt)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["check", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("behemoth: config error: model.hf_config: Unrecognized model identifier: vitt")
    assert len(err.splitlines()) == 1


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


def _fsdp_bf16_batchnorm_and_sgd(rank: int, port: int, out: str) -> None:
    """One gloo process: a ResNet with BatchNorm sharded by behemoth (bf16 policy), a step of behemoth's SGD with
    train.nonfinite skip's fused request (the config refuses that under FSDP; the optimizer must not break)."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from transformers import ResNetConfig, ResNetForImageClassification

    from behemoth.config import TrainConfig
    from behemoth.worker import parallel
    from behemoth.worker.optim import build_optimizer
    from behemoth.worker.precision import autocast

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    seen = {}
    try:
        torch.manual_seed(0)
        model = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                          num_labels=3))
        model = parallel.shard(model, reshard_after_forward=True, precision="bf16")
        optimizer = build_optimizer(model, TrainConfig(optimizer="sgd", lr=0.1, nonfinite="skip"))
        with autocast(torch.device("cpu"), "bf16"):
            logits = model(pixel_values=torch.randn(2, 3, 32, 32)).logits
        logits.float().sum().backward()
        optimizer.step()
        seen = {"logits": str(logits.dtype), "stepped": True}
    except Exception as e:  # noqa: BLE001 - reported to the test
        seen = {"error": f"{type(e).__name__}: {e}"[:300]}
    Path(out).write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_fsdp_in_bf16_trains_a_batchnorm_model_with_sgd(tmp_path):
    """FSDP's bf16 policy cast BatchNorm's weight to bf16 beside its fp32 running statistics ("expected scalar
    type BFloat16 but found Float": every image model with scaling.strategy fsdp and bf16), and behemoth's fused
    SGD has no sharding rule for FSDP's parameters (torch refused its first step, "no sharding strategy
    registered", on any GPU)."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_bf16_batchnorm_and_sgd, args=(port, str(tmp_path / "seen.json")), nprocs=1)
    assert json.loads((tmp_path / "seen.json").read_text()) == {"logits": "torch.bfloat16", "stepped": True}


def test_a_pretrained_classifier_is_fed_pixels_normalised_as_it_was_trained(image_root, tmp_path, capsys):
    """data.mean / data.std left out of a job fine-tuning a pretrained classifier: its image processor's
    statistics (ImageNet's for a ResNet), not behemoth's 0.5 / 0.25, which fed every pretrained ResNet inputs
    ~2x off in scale and shifted; data.eval_crop_pct its processor's crop (crop_pct, or a crop size over the
    resize), not the whole shorter side: written into the job (and so its job.yaml). Set in the job: kept. A
    folder without a processor: the defaults, said in one warning; a processor that is not JSON, or over 1 MiB
    (bounded before it is read): one error."""
    import json

    from transformers import ResNetConfig, ResNetForImageClassification

    from behemoth.job import config_from_dict
    from conftest import job_dict

    folder = tmp_path / "resnet"
    ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1],
                                              num_labels=4)).save_pretrained(folder)
    imagenet = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    (folder / "preprocessor_config.json").write_text(json.dumps({"crop_pct": 0.875, **imagenet}))
    model = {"name": "image_classifier", "pretrained": str(folder)}
    capsys.readouterr()  # (save_pretrained's progress bar)

    cfg = config_from_dict(job_dict(image_root, tmp_path / "runs", model=model))
    assert (cfg.data.mean, cfg.data.std) == (imagenet["image_mean"], imagenet["image_std"])
    assert cfg.data.eval_crop_pct == 0.875  # evaluated as it was: 256 for 224, the centre kept
    assert cfg.to_dict()["data"]["mean"] == imagenet["image_mean"]  # what job.yaml holds
    mine = config_from_dict(job_dict(image_root, tmp_path / "runs", model=model,
                                     data={"mean": [0.1, 0.2, 0.3], "eval_crop_pct": 1.0}))
    assert (mine.data.mean, mine.data.std, mine.data.eval_crop_pct) == ([0.1, 0.2, 0.3], imagenet["image_std"], 1)
    plain = config_from_dict(job_dict(image_root, tmp_path / "runs"))  # no pretrained model: behemoth's defaults
    assert (plain.data.mean, plain.data.std, plain.data.eval_crop_pct) == ([0.5] * 3, [0.25] * 3, 1.0)
    assert capsys.readouterr().err == ""

    (folder / "preprocessor_config.json").write_text(json.dumps({  # BiT's (and behemoth's exports'): a crop size
        "do_center_crop": True, "size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224},
        **imagenet}))
    assert config_from_dict(job_dict(image_root, tmp_path / "runs", model=model)).data.eval_fit() == 16 * 256 // 224
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": 0.5, "image_std": 0.5}))  # ViT's
    cfg = config_from_dict(job_dict(image_root, tmp_path / "runs", model=model))
    assert (cfg.data.mean, cfg.data.std, cfg.data.eval_crop_pct) == ([0.5] * 3, [0.5] * 3, 1.0)
    (folder / "preprocessor_config.json").unlink()
    cfg = config_from_dict(job_dict(image_root, tmp_path / "runs", model=model))
    assert (cfg.data.mean, cfg.data.std) == ([0.5] * 3, [0.25] * 3)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "has no image processor" in err and "data.mean / data.std" in err
    (folder / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"preprocessor_config.json is not valid JSON.*set data.mean"):
        config_from_dict(job_dict(image_root, tmp_path / "runs", model=model))
    (folder / "preprocessor_config.json").write_text(" " * (1 << 20) + "{}")  # bounded before it is read
    with pytest.raises(ConfigError, match=r"preprocessor_config.json holds 1,048,578 bytes, not an image processor"):
        config_from_dict(job_dict(image_root, tmp_path / "runs", model=model))


@pytest.mark.parametrize("settings, crop_pct", [
    ({"crop_pct": 0.875, "size": {"shortest_edge": 224}}, 0.875),  # ConvNeXt's, ResNet's
    ({"crop_pct": 0.875, "size": {"shortest_edge": 384}}, None),  # from 384 up: resized to the square, no crop
    ({"crop_pct": None, "image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 224}}, 0.875),
    ({"do_center_crop": True, "size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}}, 0.875),
    ({"size": 256, "crop_size": 224}, 0.875),  # an older feature extractor's plain numbers
    ({"do_center_crop": True, "size": {"height": 256, "width": 256}, "crop_size": {"height": 224, "width": 224}},
     0.875),  # DeiT's
    ({"size": {"height": 224, "width": 224}}, None),  # ViT's: no crop
    ({"do_center_crop": False, "size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}}, None),
])
def test_evaluations_crop_is_read_as_transformers_processors_mean_it(settings, crop_pct):
    """transformers' ConvNeXt processor applies crop_pct below a 384 shortest edge only (and 224 / 256 where it is
    null); BiT, CLIP and DeiT give a crop size and the size they resize to; old files give plain numbers."""
    from behemoth.models.image_classifier import _crop_pct

    assert _crop_pct(settings) == crop_pct


def test_a_job_yaml_written_before_eval_crop_pct_is_read_as_evaluated_then():
    """A checkpoint's job.yaml from before data.eval_crop_pct was evaluated with the shorter side at image_size:
    read without the key, its export (or a resume's comparison) would take the pretrained model's crop now."""
    import yaml

    from behemoth.storage.checkpoint import job_sections

    old = {"data": {"kind": "image_folder", "image_size": 224}, "model": {"name": "image_classifier"}}
    assert job_sections(yaml.safe_dump(old).encode(), "ckpt")["data"]["eval_crop_pct"] == 1.0
    text = {"data": {"kind": "text", "seq_len": 64}}
    assert "eval_crop_pct" not in job_sections(yaml.safe_dump(text).encode(), "ckpt")["data"]
    new = {"data": {"kind": "image_folder", "image_size": 224, "eval_crop_pct": 0.875}}
    assert job_sections(yaml.safe_dump(new).encode(), "ckpt")["data"]["eval_crop_pct"] == 0.875


@pytest.mark.parametrize("kind", ["vit", "deit"])
def test_a_vision_transformer_pretrained_at_another_size_takes_the_jobs_images(tmp_path, kind):
    """A ViT (or DeiT) pretrained at 64 px fine-tuned at data.image_size 32 or 128 failed every worker's first step
    (transformers: "Input image size (32*32) doesn't match model (64*64)"), and setting hf_config.image_size made
    from_pretrained re-initialise the position embeddings (a line in its log). Its positions are resampled once,
    as transformers' interpolate_pos_encoding does them: the same logits, and the saved model (the export) takes
    the job's size in transformers alone."""
    import transformers
    from transformers import AutoModelForImageClassification

    from behemoth.config import ModelConfig
    from behemoth.models.image_classifier import build_image_classifier

    name = "ViT" if kind == "vit" else "DeiT"
    config = getattr(transformers, f"{name}Config")(image_size=64, patch_size=16, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=10)
    getattr(transformers, f"{name}ForImageClassification")(config).save_pretrained(tmp_path / "pre")
    for size in (32, 128):
        torch.manual_seed(0)
        model = build_image_classifier(ModelConfig(name="image_classifier", pretrained=str(tmp_path / "pre")),
                                       num_classes=3, image_size=size).eval()
        reference = AutoModelForImageClassification.from_pretrained(tmp_path / "pre", num_labels=3,
                                                                    ignore_mismatched_sizes=True).eval()
        reference.load_state_dict({k: v for k, v in model.state_dict().items() if "position_embeddings" not in k},
                                  strict=False)
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            torch.testing.assert_close(model(pixel_values=x).logits,
                                       reference(pixel_values=x, interpolate_pos_encoding=True).logits)
        model.save_pretrained(tmp_path / f"at{size}")
        exported = AutoModelForImageClassification.from_pretrained(tmp_path / f"at{size}").eval()
        assert exported.config.image_size == size and exported(pixel_values=x).logits.shape == (2, 3)


def test_an_image_classifiers_num_labels_is_the_datas_and_a_deit_builds_from_scratch():
    """hf_config.num_labels other than the data's classes built a head of that size while the export's id2label
    had the data's (transformers' pipeline could not load it): refused. DeiT from a config failed with a raw
    TypeError out of transformers (its two heads and no `architectures`)."""
    from behemoth.config import ModelConfig
    from behemoth.models.image_classifier import build_image_classifier, check_image_classifier

    five = ModelConfig(name="image_classifier", pretrained="/unused", hf_config={"num_labels": 5})
    with pytest.raises(ConfigError, match=r"^model.hf_config.num_labels 5: the data has 3 classes"):
        check_image_classifier(five, num_classes=3, image_size=32)
    deit = ModelConfig(name="image_classifier", hf_config={
        "model_type": "deit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "patch_size": 8})
    check_image_classifier(deit, num_classes=3, image_size=32)
    assert build_image_classifier(deit, num_classes=3, image_size=32)(
        pixel_values=torch.randn(2, 3, 32, 32)).logits.shape == (2, 3)


def test_a_pretrained_run_from_before_the_models_own_statistics_resumes_as_it_was_trained(image_root, tmp_path):
    """A run fine-tuning a pretrained ResNet started before data.mean / std / eval_crop_pct came from its processor
    (its job.yaml: 0.5 / 0.25, no eval_crop_pct) is refused as trained with another config, naming the keys; set
    back to those values, it resumes (an eval_crop_pct of 1 matched nothing: a job.yaml without it read as None)."""
    import json

    import yaml
    from transformers import ResNetConfig, ResNetForImageClassification

    from behemoth.driver.run.resume import check_resume_compatible
    from behemoth.job import config_from_dict
    from behemoth.storage.checkpoint import job_sections
    from conftest import job_dict

    folder = tmp_path / "resnet"
    ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1])).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"crop_pct": 0.875, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    job = job_dict(image_root, tmp_path / "runs", model={"name": "image_classifier", "pretrained": str(folder)})
    before = config_from_dict(job).to_dict()
    before["data"].update(mean=[0.5] * 3, std=[0.25] * 3)
    del before["data"]["eval_crop_pct"]  # as the earlier behemoth wrote it
    latest = ("runs/t/checkpoint_000010", job_sections(yaml.safe_dump(before).encode(), "checkpoint_000010"))
    with pytest.raises(ConfigError, match=r"data.mean: \[0.5, 0.5, 0.5\] -> \[0.485, 0.456, 0.406\]; data.std: .*; "
                                          r"data.eval_crop_pct: 1.0 -> 0.875\. Set them back"):
        check_resume_compatible(config_from_dict(job), latest)
    job["data"].update(mean=[0.5] * 3, std=[0.25] * 3, eval_crop_pct=1.0)
    check_resume_compatible(config_from_dict(job), latest)
