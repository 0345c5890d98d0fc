"""Job config: YAML + overrides -> typed objects; every mistake named before Ray starts."""

from pathlib import Path

import pytest

from behemoth.config import ConfigError
from behemoth.job import config_from_dict, load_config
from behemoth.tasks import Task

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    """A job YAML; a data.root is added unless the text has a data section, so other checks are reached."""
    p = tmp_path / "job.yaml"
    p.write_text(text if text.startswith("data:") else "data:\n  root: /some/images\n" + text)
    return p


def test_unknown_key_names_key_file_and_closest(tmp_path):
    p = write(tmp_path, "train:\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "train.learning_rat" in msg and str(p) in msg
    # close to learning_rate, which other trainers call what behemoth calls lr (not min_lr_ratio)
    assert msg.endswith("unknown key 'train.learning_rat'; did you mean 'train.lr'?")


@pytest.mark.parametrize("key, meant", [("max_grad_norm", "train.grad_clip"), ("num_epochs", "train.epochs"),
                                        ("gradient_accumulation_steps", "train.grad_accum_steps")])
def test_names_from_other_trainers_suggest_ours(tmp_path, key, meant):
    with pytest.raises(ConfigError, match=rf"unknown key 'train.{key}'; did you mean '{meant}'\?"):
        load_config(write(tmp_path, f"train:\n  {key}: 1\n"))


def test_a_key_close_to_nothing_lists_the_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'train.zzzz'; valid keys: epochs, max_steps, "):
        load_config(write(tmp_path, "train:\n  zzzz: 1\n"))


def test_misspelled_key_suggests_closest(tmp_path):
    p = write(tmp_path, "train:\n  global_batchsize: 64\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.global_batchsize'; did you mean 'train.global_batch_size'"):
        load_config(p)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'trian'; did you mean 'train'"):
        load_config(write(tmp_path, "trian:\n  lr: 0.1\n"))


def test_wrong_type_names_key_and_expected_type(tmp_path):
    with pytest.raises(ConfigError, match=r"train.epochs expects int, got str 'three'"):
        load_config(write(tmp_path, "train:\n  epochs: three\n"))
    with pytest.raises(ConfigError, match=r"scaling.use_gpu expects bool"):
        load_config(write(tmp_path, "scaling:\n  use_gpu: 1\n"))


def test_choice_outside_literal(tmp_path):
    with pytest.raises(ConfigError, match=r"train.optimizer must be one of \['sgd', 'adamw'\], got 'adam'.*'adamw'"):
        load_config(write(tmp_path, "train:\n  optimizer: adam\n"))


def test_values_checked(tmp_path):
    with pytest.raises(ConfigError, match="not divisible by scaling.num_workers 3"):
        load_config(write(tmp_path, "train:\n  global_batch_size: 64\nscaling:\n  num_workers: 3\n"))
    with pytest.raises(ConfigError, match="train.lr must be > 0"):
        load_config(write(tmp_path, "train:\n  lr: 0\n"))
    with pytest.raises(ConfigError, match="data.kind image_folder cannot train model.name resnet19: it is not a known "
                                          "model for this task; did you mean 'resnet18'"):
        load_config(write(tmp_path, "model:\n  name: resnet19\n"))


def test_overrides_are_typed_and_checked(tmp_path):
    p = write(tmp_path, "train:\n  lr: 0.1\n")
    cfg = load_config(p, ["train.lr=0.05", "scaling.num_workers=4", "train.max_steps=null", "data.root=/x"])
    assert cfg.train.lr == 0.05 and cfg.scaling.num_workers == 4 and cfg.train.max_steps is None
    assert cfg.data.root == "/x"
    with pytest.raises(ConfigError, match=r"unknown key 'train.lrr'; did you mean 'train.lr'"):
        load_config(p, ["train.lrr=0.1"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(p, ["train.lr"])


def test_int_accepted_for_float_but_not_bool_for_int(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  lr: 1\n"))
    assert isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError, match="train.epochs expects int"):
        load_config(write(tmp_path, "train:\n  epochs: true\n"))


def test_numbers_written_as_papers_write_them_are_numbers(tmp_path):
    """`lr: 3e-4` (YAML 1.2's float; YAML 1.1, which PyYAML reads, wants 3.0e-4) was refused as text: 'train.lr
    expects float, got str'. In the file, in --set and in a sweep; a quoted '3e-4' stays text."""
    cfg = load_config(write(tmp_path, "train:\n  lr: 3e-4\n  weight_decay: 5E-4\n  adam_eps: 1e-8\n"))
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.adam_eps) == (3e-4, 5e-4, 1e-8)
    assert load_config(write(tmp_path, "train:\n  lr: 0.1\n"), ["train.lr=2e-3"]).train.lr == 2e-3
    with pytest.raises(ConfigError, match="train.lr expects float, got str '3e-4'"):
        load_config(write(tmp_path, "train:\n  lr: '3e-4'\n"))


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    """YAML 1.1 keeps the last of two equal keys without a word: a second `lr:`, or a second `train:` section
    pasted at the end, replaced the first."""
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice in one mapping \(first on line 4\).*line 6"):
        load_config(write(tmp_path, "train:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n"))
    with pytest.raises(ConfigError, match=r"key 'train' is given twice in one mapping \(first on line 3\)"):
        load_config(write(tmp_path, "train:\n  lr: 0.1\nmodel:\n  name: resnet18\ntrain:\n  epochs: 3\n"))
    # (merge keys still merge: `<<` is not a key given twice)
    cfg = load_config(write(tmp_path, "train:\n  <<: {lr: 0.2}\n  epochs: 3\n"))
    assert (cfg.train.lr, cfg.train.epochs) == (0.2, 3)


def test_set_reaches_into_an_empty_or_switched_off_section(tmp_path):
    """`--set model.lora.r=16` where the file says `lora: null`, `--set eval.every_n_steps=5` under an empty
    `eval:`: the section was refused as 'not a section'."""
    from behemoth.config import apply_override

    raw = {"model": {"name": "causal_lm", "lora": None}, "eval": None}
    apply_override(raw, "model.lora.r=16")
    apply_override(raw, "eval.every_n_steps=5")
    assert raw == {"model": {"name": "causal_lm", "lora": {"r": 16}}, "eval": {"every_n_steps": 5}}
    p = write(tmp_path, "eval:\ntrain:\n  lr: 0.1\n")
    assert load_config(p, ["eval.every_n_steps=5"]).eval.every_n_steps == 5
    with pytest.raises(ConfigError, match=r"--set train.lr.x: lr is not a section \(it holds 0.1\)"):
        load_config(p, ["train.lr.x=1"])
    with pytest.raises(ConfigError, match=r"--set 'train.lr=\[1': the value is not valid YAML"):
        load_config(p, ["train.lr=[1"])


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_bytes("# caf\xe9\ndata:\n  root: /x\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"job.yaml is not UTF-8 text \(byte 0xe9 at offset 5\): save it as UTF-8"):
        load_config(p)


def test_max_bad_samples_is_refused_where_nothing_would_be_dropped(tmp_path):
    """text and text_classification refuse an unreadable record in the check whatever the budget: a budget given
    there was taken without a word and never used. Chat (which drops bad conversations) keeps it."""
    text = ("data:\n  kind: {kind}\n  train_files: [a.jsonl]\n  val_files: [b.jsonl]\n  max_bad_samples: 5\n"
            "  tokenizer: /some/tokenizer\n")
    for kind in ("text", "text_classification"):
        with pytest.raises(ConfigError, match=rf"data.max_bad_samples is for images .* a {kind} record that cannot "
                                              r"be read stops the check naming its file and line"):
            load_config(write(tmp_path, text.format(kind=kind) + "model:\n  name: causal_lm\n"))
    cfg = load_config(write(tmp_path, text.format(kind="chat") + "model:\n  name: causal_lm\n"
                            "  hf_config: {model_type: llama}\n"))
    assert cfg.data.max_bad_samples == 5


def test_training_data_that_makes_no_sample_is_a_data_error_not_batch_advice(tmp_path):
    """An empty corpus (or zero parquet rows) was answered 'train.global_batch_size 1 exceeds the 0 training
    samples ... Lower it to at most 0'."""
    from behemoth.driver.run import preflight
    from behemoth.errors import DataError

    cfg = load_config(write(tmp_path, "data:\n  kind: text\n  train_files: [corpus/*.txt]\n  val_fraction: 0.1\n"
                            "  seq_len: 64\n  tokenizer: /t\nmodel:\n  name: causal_lm\n"
                            "  hf_config: {model_type: llama}\n"))
    with pytest.raises(DataError, match=r"^the training data \(corpus/\*.txt\) makes no training sample \(for "
                                        r"text: not one block of data.seq_len 64 tokens\): check that its files"):
        preflight.check_epoch(cfg, 0)
    with pytest.raises(ConfigError, match="exceeds the 3 training samples"):
        preflight.check_epoch(cfg, 3)


def test_a_warmup_as_long_as_the_run_is_said(tmp_path, capsys):
    """train.warmup_steps 1000 in a 10-step run: the learning rate never reached train.lr, and nothing said so."""
    from behemoth.driver.run import preflight

    cfg = load_config(write(tmp_path, "train:\n  warmup_steps: 1000\n  max_steps: 10\n  global_batch_size: 8\n"))
    preflight.check_epoch(cfg, 800)
    assert capsys.readouterr().err == (
        "[behemoth] warning: train.warmup_steps makes a warm-up of 1000 steps, not shorter than the run's 10 "
        "(train.max_steps): the learning rate never reaches train.lr 0.1 and never decays\n")
    cfg = load_config(write(tmp_path, "train:\n  warmup_epochs: 2\n  epochs: 2\n  global_batch_size: 8\n"))
    preflight.check_epoch(cfg, 80)
    assert "warmup_epochs makes a warm-up of 20 steps, not shorter than the run's 20 (2 epoch(s) of 10 steps)" in \
        capsys.readouterr().err
    preflight.check_epoch(load_config(write(tmp_path, "train:\n  warmup_steps: 9\n  max_steps: 10\n"
                                                      "  global_batch_size: 8\n")), 800)
    assert capsys.readouterr().err == ""


def test_an_unknown_model_name_reads_in_order(tmp_path):
    with pytest.raises(ConfigError, match=r"it is not a known model for this task; did you mean 'resnet50'\? "
                                          r"\(known: "):
        load_config(write(tmp_path, "model:\n  name: resnet5\n"))


def test_settings_that_would_be_dropped_without_a_word_are_refused(tmp_path):
    """An empty job file (refused by its first missing key, data.root, as if the file held something);
    data.val_fraction beside data.val_files (the files won); train.early_stopping with no evaluation to watch
    (it never stopped anything)."""
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty.yaml is empty: it must hold a mapping of sections"):
        load_config(tmp_path / "empty.yaml")
    text = ("data:\n  kind: text\n  train_files: [a.jsonl]\n  val_files: [b.jsonl]\n  val_fraction: 0.1\n"
            "  tokenizer: /t\nmodel:\n  name: causal_lm\n  hf_config: {model_type: llama}\n")
    with pytest.raises(ConfigError, match=r"data.val_files and data.val_fraction 0.1 are both set"):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"train.early_stopping watches the evaluations' metric, and none are made"):
        load_config(write(tmp_path, "train:\n  early_stopping: {}\neval:\n  per_epoch: false\n"))
    assert load_config(write(tmp_path, "train:\n  early_stopping: {}\neval:\n  per_epoch: false\n"
                                       "  every_n_steps: 50\n")).train.early_stopping.patience > 0


def test_the_python_api_says_what_it_takes(tmp_path, capsys):
    """behemoth.train("job.yaml") failed with "'str' object has no attribute 'checkpoint'"; load_config's
    overrides as one string were read character by character ("--set 't': expected KEY=VALUE"), a dict for the
    path was pathlib's TypeError; a sweep file read as a job said "unknown key 'job'"; `behemoth check` took a
    sweep file without `space:` (misspelled `spaces:`) for a job."""
    from behemoth.driver.commands.cli import main
    from behemoth.driver.run.trainer import _job

    p = write(tmp_path, "train:\n  lr: 0.1\n")
    assert _job(str(p)).train.lr == 0.1 and _job(p).train.lr == 0.1
    with pytest.raises(ConfigError, match=r"^train\(\) takes a JobConfig or a job YAML's path, got dict"):
        _job({"train": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r"^overrides: a list of 'KEY=VALUE' strings .* got str 'train.lr=0.05'"):
        load_config(p, "train.lr=0.05")
    with pytest.raises(ConfigError, match=r"^overrides: a list of 'KEY=VALUE' strings .* got list \[None\]"):
        load_config(p, [None])
    with pytest.raises(ConfigError, match=r"^load_config takes the path of a job YAML, got dict: .*config_from_dict"):
        load_config({"train": {}})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: s\njob: {p}\nspaces:\n  train.lr: {{grid: [0.1]}}\n")
    with pytest.raises(ConfigError, match=r"sweep.yaml: a sweep file \(it has job\): run it with `behemoth tune`"):
        load_config(sweep)
    assert main(["check", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "spaces" in err and "valid keys: data, model" not in err  # (the sweep loader's message, not the job's)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [unclosed\n"))


@pytest.mark.parametrize("name", ["demo_images.yaml", "resnet50_imagenet_8gpu.yaml", "demo_lm.yaml",
                                  "llm_wikitext_8gpu.yaml", "demo_chat.yaml", "chat_lora_8gpu.yaml",
                                  "demo_dpo.yaml", "dpo_lora_8gpu.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(REPO / "jobs" / "configs" / name)
    assert cfg.train.global_batch_size % cfg.scaling.num_workers == 0


def test_8gpu_config_has_the_real_shape():
    cfg = load_config(REPO / "jobs" / "configs" / "resnet50_imagenet_8gpu.yaml")
    assert cfg.scaling.num_workers == 8 and cfg.scaling.use_gpu and cfg.model.name == "resnet50"
    assert cfg.data.image_size == 224 and cfg.data.augment == "random_resized_crop"


def test_llm_8gpu_config_has_the_real_shape():
    cfg = load_config(REPO / "jobs" / "configs" / "llm_wikitext_8gpu.yaml")
    assert cfg.scaling.num_workers == 8 and cfg.scaling.use_gpu
    assert cfg.model.name == "causal_lm" and cfg.model.pretrained == cfg.data.tokenizer  # the model's tokenizer
    assert cfg.data.hf_dataset == "Salesforce/wikitext" and cfg.data.hf_config_name == "wikitext-103-raw-v1"
    assert cfg.train.precision == "bf16" and cfg.train.grad_accum_steps > 1
    micro = cfg.train.global_batch_size // (cfg.scaling.num_workers * cfg.train.grad_accum_steps)
    assert micro * cfg.data.seq_len == 4 * 2048
    assert cfg.checkpoint.storage_path.startswith("s3://")


def test_text_config_checks(tmp_path):
    text = "data:\n  kind: text\n  train_files: [a.jsonl]\n  tokenizer: tok\n"
    with pytest.raises(ConfigError, match="no validation text: set data.val_files or data.val_fraction"):
        load_config(write(tmp_path, text + "model:\n  name: causal_lm\n  hf_config: {model_type: llama}\n"))
    text += "  val_fraction: 0.1\n"
    with pytest.raises(ConfigError, match="data.kind text cannot train model.name regnet_cifar"):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match="set model.pretrained .* or model.hf_config.model_type"):
        load_config(write(tmp_path, text + "model:\n  name: causal_lm\n"))
    with pytest.raises(ConfigError, match=r"model.hf_config.hidden_size expects Any|hf_config expects dict"):
        load_config(write(tmp_path, text + "model:\n  name: causal_lm\n  hf_config: [1]\n"))
    cfg = load_config(write(tmp_path, text + "model:\n  name: causal_lm\n  hf_config: {model_type: llama, "
                                             "hidden_size: 64}\n"), ["train.precision=bf16"])
    assert cfg.model.hf_config == {"model_type": "llama", "hidden_size": 64}
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        load_config(write(tmp_path, text + "model:\n  name: causal_lm\n  hf_config: {model_type: llama}\n"),
                    ["train.precision=fp16"])
    with pytest.raises(ConfigError, match=r"not divisible by scaling.num_workers 2 x train.grad_accum_steps 3"):
        load_config(write(tmp_path, text + "model:\n  name: causal_lm\n  hf_config: {model_type: llama}\n"),
                    ["train.grad_accum_steps=3", "train.global_batch_size=16"])


def test_elastic_range_must_split_the_global_batch_at_every_size(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  global_batch_size: 24\nscaling:\n  num_workers: [1, 4]\n"))
    assert cfg.scaling.elastic and (cfg.scaling.min_workers, cfg.scaling.max_workers) == (1, 4)
    with pytest.raises(ConfigError, match=r"not divisible by scaling.num_workers 3 \(a size in the elastic range "
                                          r"\[2, 4\]\) x train.grad_accum_steps 1: pick a multiple of 3"):
        load_config(write(tmp_path, "train:\n  global_batch_size: 16\nscaling:\n  num_workers: [2, 4]\n"))
    with pytest.raises(ConfigError, match=r"give one count, or \[min, max\] with min <= max"):
        load_config(write(tmp_path, "scaling:\n  num_workers: [4, 2]\n"))


def test_the_configuration_reference_names_every_key():
    """docs/configuration.md lists every job config key (section.key), each built-in task's data keys
    included, and no key that does not exist."""
    import dataclasses
    import re
    import typing
    from pathlib import Path

    from behemoth.config import JobConfig
    from behemoth.tasks.registry import TASKS, data_section

    def leaves(cls, prefix):  # a nested section (tracking.mlflow, an optional train.early_stopping) by its keys
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            section = next((t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)),
                           None)
            if section is not None:
                yield from leaves(section, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    keys = set(leaves(JobConfig, "")).union(*(leaves(data_section(kind), "data.") for kind in TASKS))
    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    table = [line for line in doc.splitlines() if line.startswith("| `")]
    named = {m for line in table for m in re.findall(r"`([a-z]+(?:\.[a-z_0-9]+)+)`", line.split("|")[1])}
    assert sorted(keys - named) == [], "keys missing from docs/configuration.md"
    assert sorted(named - keys) == [], "docs/configuration.md names keys that do not exist"


def test_code_from_a_model_repository_runs_only_when_the_job_says_so():
    """`trust_remote_code: true` slipped into model.hf_config (passed to from_pretrained) is refused; the
    explicit key is model.trust_remote_code, off by default."""
    hf = {"model": {"name": "causal_lm", "pretrained": "some/model", "hf_config": {"trust_remote_code": True}},
          "data": {"kind": "text", "train_files": ["a.jsonl"], "val_files": ["b.jsonl"], "tokenizer": "tok"}}
    with pytest.raises(ConfigError, match="set model.trust_remote_code: true"):
        config_from_dict(hf)
    hf["model"]["hf_config"] = {}
    assert config_from_dict(hf).model.trust_remote_code is False


@pytest.mark.parametrize("option, why", [
    ("weights_only=false", "weights file is unpickled, which runs any code"), ("use_kernels=true", "fetches compiled kernels"),
    ("kernel_config={}", "fetches compiled kernels"), ("allow_all_kernels=true", "unverified Hub"),
    ("code_revision=main", "revision of a repository's code"), ("revision=abc", "downloaded from"),
    ("dtype=bfloat16", "placed, cast or sharded"), ("device_map=auto", "placed, cast or sharded"),
    ("attn_implementation=kernels-community/flash-attn3", "Hub repository whose kernel")])
def test_hf_config_takes_architecture_keys_only(option, why):
    """model.hf_config goes to from_pretrained as kwargs: a loading option there is refused by name, with why;
    architecture keys (and a built-in attention implementation) pass."""
    key = option.split("=")[0]
    with pytest.raises(ConfigError, match=rf"model.hf_config.{key} .*{why}"):
        load_config(REPO / "jobs" / "configs" / "demo_lm.yaml", [f"model.hf_config.{option}"])
    cfg = load_config(REPO / "jobs" / "configs" / "demo_lm.yaml", ["model.hf_config.attn_implementation=sdpa",
                                                                   "model.hf_config.attention_dropout=0.1"])
    assert cfg.model.hf_config["attn_implementation"] == "sdpa"


@pytest.mark.parametrize("hf_config, refused", [
    ({"_attn_implementation": "kernels-community/flash-attn"}, r"model.hf_config._attn_implementation is a private"),
    ({"_experts_implementation": "org/kernel"}, r"model.hf_config._experts_implementation is a private"),
    ({"experts_implementation": "org/kernel"}, r"names a Hugging Face Hub repository"),
    ({"attn_implementation": "my_own"}, r"'my_own' is not one of transformers' built-in implementations"),
    ({"text_config": {"attn_implementation": "kernels-community/flash-attn"}},
     r"model.hf_config.text_config.attn_implementation 'kernels-community/flash-attn' names a Hugging Face Hub"),
    ({"vision_config": {"_attn_implementation": "x/y"}}, r"model.hf_config.vision_config._attn_implementation is"),
    ({"text_config": {"weights_only": False}}, r"model.hf_config.text_config.weights_only is a loading option"),
])
def test_hf_config_is_an_allow_list_private_keys_and_nested_configs_included(hf_config, refused):
    """The deny-list let `_attn_implementation: kernels-community/flash-attn` through (transformers 5 honours it:
    a Hub kernel downloaded and run), and never looked inside a composite model's sub-configs. Now a key must be
    public, not a loading option, its value plain data and any implementation a built-in one, at every depth.
    It is the config's own check, so a received checkpoint's job.yaml meets it too (export reads it)."""
    job = {"data": {"kind": "text", "train_files": ["a.jsonl"], "val_fraction": 0.1, "tokenizer": "t"},
           "model": {"name": "causal_lm", "hf_config": {"model_type": "llama", **hf_config}}}
    with pytest.raises(ConfigError, match=refused):
        config_from_dict(job)
    job["model"]["hf_config"] = {"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                 "layer_types": ["full_attention"], "attn_implementation": "sdpa"}
    assert config_from_dict(job).model.hf_config["rope_scaling"]["factor"] == 2.0


def test_the_loading_options_are_every_option_transformers_takes_out_of_from_pretrained():
    """hf_keys.LOADING_OPTIONS names every parameter of from_pretrained and every kwarg that it, the Auto
    classes and the config loading pop: a transformers upgrade that adds one fails here, not in a user's run."""
    import inspect
    import re

    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    from behemoth.models.hf_keys import KERNEL_NAMING_KEYS, LOADING_OPTIONS

    functions = [PreTrainedModel.from_pretrained, _BaseAutoModelClass.from_pretrained,
                 PretrainedConfig._get_config_dict, PretrainedConfig.from_dict]
    taken = {name for fn in functions for name, p in inspect.signature(fn).parameters.items()
             if p.kind is p.KEYWORD_ONLY or (p.default is not p.empty and name != "self")}
    for fn in functions:
        source = inspect.getsource(fn)
        taken |= set(re.findall(r"kwargs\.pop\(\s*[\"'](\w+)", source))
        for names in re.findall(r"(?:for name in|hub_kwargs_names =) \[(.*?)\]", source, re.S):
            taken |= set(re.findall(r"[\"'](\w+)[\"']", names))
    assert {"weights_only", "use_kernels", "trust_remote_code", "cache_dir", "mirror"} <= taken  # the parse works
    assert sorted(taken - set(LOADING_OPTIONS) - set(KERNEL_NAMING_KEYS)) == []


def test_trusting_a_repositorys_code_prints_one_warning_naming_it(tmp_path, capsys):
    text = ("data:\n  kind: text\n  train_files: [a.jsonl]\n  val_fraction: 0.1\n  tokenizer: tok\n"
            "model:\n  name: causal_lm\n  pretrained: some-org/some-model\n")
    load_config(write(tmp_path, text))
    assert "trust_remote_code" not in capsys.readouterr().err
    cfg = load_config(write(tmp_path, text + "  trust_remote_code: true\n"))
    err = capsys.readouterr().err
    assert cfg.model.trust_remote_code and err.count("\n") == 1
    assert "warning: model.trust_remote_code is true: the Python code of repository some-org/some-model will run" in err
    with pytest.raises(ConfigError, match="model.trust_remote_code runs the code of model.pretrained's repository, "
                                          "and model.pretrained is not set"):
        load_config(write(tmp_path, text.replace("pretrained: some-org/some-model", "hf_config: {model_type: llama}")
                          + "  trust_remote_code: true\n"))


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "../x", " x", "a\\b"])
def test_run_and_sweep_names_stay_inside_their_storage_path(name):
    from behemoth.driver.sweep.config import SweepConfig

    with pytest.raises(ConfigError, match="must be a plain folder name"):
        config_from_dict({"data": {"root": "x"}, "checkpoint": {"run_name": name}})
    with pytest.raises(ConfigError, match="must be a plain folder name"):
        SweepConfig(job="job.yaml", space={"train.lr": {"grid": [0.1]}}, name=name).validate()


@pytest.mark.parametrize("storage", ["runs", "s3://bucket/runs"])
@pytest.mark.parametrize("name", ["exp#1", "a?b", "a%2F..%2Fx", "x y", "r" * 129, "-rf", ".hidden", "run:1",
                                  "caf\u00e9"])
def test_run_and_sweep_names_are_plain_on_every_storage(tmp_path, storage, name):
    """pyarrow reads s3://bucket/runs/exp#1 as runs/exp and ?... as filesystem options: a name is refused on
    every storage, naming the key and the rule, before any path is built from it."""
    from behemoth.config import CheckpointConfig, JobConfig
    from behemoth.driver.run.resume import run_dir
    from behemoth.driver.sweep.config import load_sweep

    rule = r"must be a plain folder name: 1-\d+ characters of A-Z a-z 0-9 '.' '_' '-', not starting with"
    with pytest.raises(ConfigError, match=rf"checkpoint.run_name '.*' {rule}"):
        load_config(write(tmp_path, f"checkpoint:\n  storage_path: {storage}\n"), [f"checkpoint.run_name={name}"])
    with pytest.raises(ConfigError, match=rf"checkpoint.run_name '.*' {rule}"):  # a config never validated
        run_dir(JobConfig(checkpoint=CheckpointConfig(storage_path=storage, run_name=name)))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"job: job.yaml\nstorage_path: {storage}\nspace: {{train.lr: {{grid: [0.1]}}}}\n")
    with pytest.raises(ConfigError, match=rf"name '.*' {rule}"):
        load_sweep(sweep, [f"name={name}"])


def test_names_that_pass_and_the_length_limits(tmp_path):
    from behemoth.driver.sweep.config import SweepConfig

    for name in ["r", "exp_1.v2-b", "A" * 128]:
        assert config_from_dict({"data": {"root": "x"}, "checkpoint": {"run_name": name}}).checkpoint.run_name == name
    sweep = dict(job="job.yaml", space={"train.lr": {"grid": [0.1]}})
    SweepConfig(**sweep, name="s" * 123).validate()  # its best run, NAME_best, is 128 characters
    with pytest.raises(ConfigError, match=r"name 's{124}' must be a plain folder name: 1-123 characters"):
        SweepConfig(**sweep, name="s" * 124).validate()


def test_each_task_reads_and_checks_its_own_data_keys(tmp_path):
    """`data:` is read into the section of its kind (the task's data_config): a key of another task's section
    is an unknown key for this kind, each section checks its own values, and the job's objects are the task's
    section classes (what the workers unpickle)."""
    from behemoth.data.text.text import TextData
    from behemoth.data.image.images import ImageData

    image = load_config(write(tmp_path, "data:\n  root: imgs\n  image_size: 16\n"))
    assert type(image.data) is ImageData and image.data.image_size == 16
    with pytest.raises(ConfigError, match="unknown key 'data.tokenizer' for data.kind image_folder"):
        load_config(write(tmp_path, "data:\n  root: imgs\n  tokenizer: tok\n"))
    text = ("data:\n  kind: text\n  train_files: [a.jsonl]\n  val_fraction: 0.1\n  tokenizer: tok\n"
            "model:\n  name: causal_lm\n  hf_config: {model_type: llama}\n")
    assert type(load_config(write(tmp_path, text)).data) is TextData
    with pytest.raises(ConfigError, match="unknown key 'data.image_siz' for data.kind text"):
        load_config(write(tmp_path, text.replace("  tokenizer: tok\n", "  tokenizer: tok\n  image_siz: 8\n")))
    with pytest.raises(ConfigError, match="data.seq_len must be >= 2"):
        load_config(write(tmp_path, text), ["data.seq_len=1"])
    with pytest.raises(ConfigError, match="data.image_size must be > 0"):
        load_config(write(tmp_path, "data:\n  root: imgs\n  image_size: 0\n"))
    with pytest.raises(ConfigError, match="data.kind 'txt' is not a known task; did you mean 'text'"):
        load_config(write(tmp_path, "data:\n  kind: txt\n"))
    with pytest.raises(ConfigError, match="data.kind expects str"):
        load_config(write(tmp_path, "data:\n  kind: [text]\n"))


def test_a_task_of_ones_own_brings_its_data_keys(tmp_path, monkeypatch):
    """A task outside behemoth (module:Class) names its section as data_config: its keys are accepted and
    checked by it; without one, only the common keys are."""
    import dataclasses
    import sys
    import types

    from behemoth.config import DataConfig

    @dataclasses.dataclass
    class MyData(DataConfig):
        vocab: int = 10

        def validate(self):
            super().validate()
            if self.vocab < 2:
                raise ConfigError("data.vocab must be >= 2")

    module = types.ModuleType("my_tasks")
    module.WithKeys = type("WithKeys", (CompleteTask,), {"data_config": MyData})
    module.WithoutKeys = type("WithoutKeys", (CompleteTask,), {})
    module.Broken = type("Broken", (CompleteTask,), {"data_config": dict})
    monkeypatch.setitem(sys.modules, "my_tasks", module)
    cfg = config_from_dict({"data": {"kind": "my_tasks:WithKeys", "vocab": 50, "prefetch_batches": 1}})
    assert type(cfg.data) is MyData and cfg.data.vocab == 50 and cfg.data.prefetch_batches == 1
    with pytest.raises(ConfigError, match="data.vocab must be >= 2"):
        config_from_dict({"data": {"kind": "my_tasks:WithKeys", "vocab": 1}})
    assert type(config_from_dict({"data": {"kind": "my_tasks:WithoutKeys"}}).data) is DataConfig
    with pytest.raises(ConfigError, match="unknown key 'data.vocab' for data.kind my_tasks:WithoutKeys"):
        config_from_dict({"data": {"kind": "my_tasks:WithoutKeys", "vocab": 50}})
    with pytest.raises(ConfigError, match="data_config must be a dataclass subclassing"):
        config_from_dict({"data": {"kind": "my_tasks:Broken"}})
    with pytest.raises(ConfigError, match="cannot import task no_such_module:Task"):
        config_from_dict({"data": {"kind": "no_such_module:Task"}})


class CompleteTask(Task):
    """Every member the contract requires, and nothing else."""

    best, reported, eval_sum_names = ("val_x", "min"), {"val_x": "min"}, ("x",)
    check = prepare = describe = classmethod(lambda cls, cfg, checked=None: None)
    build_model = train_batches = eval_batches = example_batch = loss = eval_sums = eval_metrics = (
        lambda self, *args, **kw: None)


def test_a_task_is_checked_against_the_contract_and_told_what_it_lacks(monkeypatch):
    """A data.kind by import path must name a Task subclass defining every required member; the error says
    which members are missing (before Ray starts), not an AttributeError on a worker minutes later."""
    import sys
    import types

    module = types.ModuleType("my_tasks")
    module.NotATask = type("NotATask", (), {"best": ("val_x", "min")})
    module.Partial = type("Partial", (Task,), {"best": ("val_x", "min"), "check": classmethod(lambda c, cfg: 0)})
    module.Complete = CompleteTask
    monkeypatch.setitem(sys.modules, "my_tasks", module)
    with pytest.raises(ConfigError, match="is not a task: subclass behemoth.tasks.Task"):
        config_from_dict({"data": {"kind": "my_tasks:NotATask"}})
    with pytest.raises(ConfigError, match=r"task Partial does not define build_model, describe, eval_batches, "
                                          r"eval_metrics, eval_sums, example_batch, loss, prepare, train_batches, "
                                          r"reported, eval_sum_names"):
        config_from_dict({"data": {"kind": "my_tasks:Partial"}})
    assert config_from_dict({"data": {"kind": "my_tasks:Complete"}}).data.kind == "my_tasks:Complete"
    # checkpoint_files was a worker-half method: a task written for that is told, not failed on every worker
    module.OldFiles = type("OldFiles", (CompleteTask,), {"checkpoint_files": lambda self: {"a.json": "[]"}})
    with pytest.raises(ConfigError, match=r"task OldFiles's checkpoint_files must be a classmethod "
                                          r"\(cls, cfg, prepared\)"):
        config_from_dict({"data": {"kind": "my_tasks:OldFiles"}})


def test_a_task_by_import_path_gets_the_same_model_checks_as_a_built_in_one(monkeypatch):
    """A task of one's own builds its own model, so its model.name is its own; but model.hf_config may still
    reach from_pretrained (a received checkpoint's job.yaml, exported with --task-code): a loading option there,
    or trust_remote_code without model.pretrained, is refused with the built-in task's own error."""
    import sys
    import types

    module = types.ModuleType("my_tasks")
    module.Complete = CompleteTask
    monkeypatch.setitem(sys.modules, "my_tasks", module)
    built_in = {"data": {"kind": "text", "train_files": ["a.jsonl"], "val_files": ["b.jsonl"], "tokenizer": "tok"}}
    own = {"data": {"kind": "my_tasks:Complete"}}
    for model in ({"hf_config": {"revision": "abc"}}, {"hf_config": {"weights_only": False}},
                  {"hf_config": {"trust_remote_code": True}, "pretrained": "some/model"},
                  {"hf_config": {"attn_implementation": "kernels-community/flash-attn3"}},
                  {"trust_remote_code": True}):
        errors = []
        for job in (built_in, own):
            with pytest.raises(ConfigError) as refused:
                config_from_dict({**job, "model": {"name": "causal_lm", **model}})
            errors.append(str(refused.value))
        assert errors[1] == errors[0], model
        assert errors[0].startswith(("model.hf_config.", "model.trust_remote_code runs")), errors[0]
    # its model.name is still its own, and architecture keys pass
    cfg = config_from_dict({**own, "model": {"name": "my_linear", "hf_config": {"hidden_size": 8}}})
    assert cfg.model.name == "my_linear" and cfg.model.hf_config == {"hidden_size": 8}


def test_a_job_built_by_hand_is_refused_with_one_error_naming_its_section():
    """JobConfig() holds a plain DataConfig; its kind's task reads ImageData: one ConfigError saying how to build
    the job, not an AttributeError inside the task."""
    from behemoth.config import JobConfig
    from behemoth.tasks import task_of

    with pytest.raises(ConfigError, match="data.kind image_folder reads its data: section into ImageData, and this "
                                          "job holds a DataConfig: build the job with behemoth.load_config"):
        task_of(JobConfig())


def test_register_names_a_task_by_a_plain_kind(monkeypatch):
    """register(kind, "module:Class") makes a plain data.kind name that task in this process; a kind that is an
    import path, or a task not named by one, is refused."""
    import sys
    import types

    from behemoth.tasks import register, registry

    monkeypatch.setattr(registry, "TASKS", dict(registry.TASKS))
    module = types.ModuleType("my_tasks")
    module.Complete = type("Complete", (CompleteTask,), {"model_names": ("regnet_cifar",)})  # the default model
    monkeypatch.setitem(sys.modules, "my_tasks", module)
    with pytest.raises(ConfigError, match="data.kind 'mine' is not a known task"):
        config_from_dict({"data": {"kind": "mine"}})
    register("mine", "my_tasks:Complete")
    assert config_from_dict({"data": {"kind": "mine"}}).data.kind == "mine"
    with pytest.raises(ConfigError, match="a registered kind is a plain name"):
        register("my_tasks:Complete", "my_tasks:Complete")
    with pytest.raises(ConfigError, match="the task is named by import path"):
        register("other", "CompleteTask")


def _section_keys(cls, prefix=""):
    """(dotted key, type) of every field of a config class, nested sections walked into (not optional ones)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _section_keys(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def _optional_sections():
    import dataclasses
    import typing

    from behemoth.config import JobConfig

    for key, tp in _section_keys(JobConfig):
        section = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
        if section is not None:
            yield key, section


def test_an_optional_section_is_off_for_null_or_false_on_for_a_mapping_and_nothing_else(tmp_path):
    """Issue 65 item 2: `false` (or 0) for an optional section turned it on with its defaults (`value or {}`):
    model.lora=false froze the base model, train.early_stopping=false stopped at patience 3, train.profile=0
    profiled. Every optional section: null and false are off, a mapping on ({}: its defaults), anything else
    (true included: which settings would it turn on?) one error naming the key."""
    p = write(tmp_path, "train:\n  lr: 0.1\n")
    sections = dict(_optional_sections())
    assert {"model.lora", "train.early_stopping", "train.profile"} <= set(sections)
    for key in sections:
        for off in ("null", "false", "~"):
            cfg = load_config(p, [f"{key}={off}"])
            assert _get(cfg, key) is None, (key, off)
        for bad in ("true", "0", "1", "yes_please", "[1]", "0.5"):
            with pytest.raises(ConfigError, match=rf"{p}: {key} is a section: give a mapping to turn it on \(\{{\}} "
                                                  rf"for its defaults\) or null/false for off, got "):
                load_config(p, [f"{key}={bad}"])
    for key in ("train.early_stopping", "train.profile"):  # (model.lora on: its task's check refuses a ResNet)
        assert _get(load_config(p, [f"{key}={{}}"]), key) == sections[key]()
    assert load_config(p, ["train.early_stopping={patience: 5}"]).train.early_stopping.patience == 5
    with pytest.raises(ConfigError, match=rf"{p}: train must be a mapping, got bool"):  # a section always there
        load_config(p, ["train=false"])
    assert load_config(write(tmp_path, "train:\n")).train.lr == 0.1  # an empty one: its defaults


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _float_keys():
    """Every float-typed key of a job (optional sections and each built-in task's data section included)."""
    import typing

    from behemoth.config import JobConfig
    from behemoth.tasks.registry import TASKS, task_class

    def floats(cls, prefix):
        for key, tp in _section_keys(cls, prefix):
            args = typing.get_args(tp)
            if tp is float or float in args or list[float] in args or tp == list[float]:
                yield key, "[.nan]" if "list" in str(tp) else ".nan"
    keys = {("image_folder", k, v) for k, v in floats(JobConfig, "") if not k.startswith("data.")}
    keys |= {("image_folder", k, v) for key, section in _optional_sections() for k, v in floats(section, key + ".")}
    keys |= {(kind, k, v) for kind in TASKS for k, v in floats(task_class(kind).data_config, "data.")}
    return sorted(keys)


def test_every_float_key_is_a_finite_number(tmp_path):
    """Issue 65 item 3: `check` passed train.lr=.nan and .inf, warmup_epochs, min_delta and data.mixup_alpha NaN
    (a NaN passes a `< 0` check): one rule over every float of every section refuses NaN and infinity, naming
    the key, before any range or Ray."""
    keys = _float_keys()
    assert {k for _, k, _ in keys} >= {"train.lr", "train.grad_clip", "train.warmup_epochs", "data.mixup_alpha",
                                       "train.early_stopping.min_delta", "train.adam_betas", "model.lora.alpha",
                                       "data.val_fraction", "scaling.cpus_per_worker"}
    for kind, key, value in keys:
        # a section of several values (adam_betas, data.mean) names the element
        named = rf"{key}\[0\]" if value.startswith("[") else key
        p = write(tmp_path, f"data:\n  kind: {kind}\n  root: /x\n" if kind.startswith("image") else
                  f"data:\n  kind: {kind}\n")
        for bad, shown in ((value, "nan"), (value.replace(".nan", ".inf"), "inf"),
                           (value.replace(".nan", "-.inf"), "-inf")):
            with pytest.raises(ConfigError, match=rf"{p}: {named} must be a finite number, got {shown}$"):
                load_config(p, [f"{key}={bad}"])
    with pytest.raises(ConfigError, match=r"model.hf_config.rope_theta must be a finite number, got nan"):
        load_config(write(tmp_path, "train:\n  lr: 0.1\n"), ["model.hf_config={rope_theta: .nan}"])


@pytest.mark.parametrize("override, message", [
    ("train.grad_clip=-1", r"train.grad_clip must be > 0, got -1.0"),  # clipping by -1 flips the gradient
    ("train.grad_clip=0", r"train.grad_clip must be > 0, got 0.0"),
    ("train.momentum=-5", r"train.momentum must be in \[0, 1\), got -5.0"),
    ("train.momentum=1", r"train.momentum must be in \[0, 1\), got 1.0"),
    ("train.weight_decay=-0.1", r"train.weight_decay must be >= 0, got -0.1"),
    ("train.adam_eps=0", r"train.adam_eps must be > 0"),
    ("train.adam_betas=[0.9, 1.0]", r"train.adam_betas needs two values in \[0, 1\)"),
    ("train.min_lr_ratio=1.5", r"train.min_lr_ratio must be in \[0, 1\], got 1.5"),
    ("train.warmup_steps=-1", r"train.warmup_steps must be >= 0, got -1"),
    ("train.warmup_epochs=-1", r"train.warmup_epochs must be >= 0"),
    ("train.ema_decay=1", r"train.ema_decay must be in \(0, 1\) \(0.999 or 0.9999 are usual\), got 1.0"),
    ("train.powersgd_warmup_steps=-1", r"train.powersgd_warmup_steps must be >= 2"),
    # (torch's PowerSGD refused 0 and 1 only when the workers built it, after Ray started)
    ("train.powersgd_warmup_steps=1", r"train.powersgd_warmup_steps must be >= 2 \(torch's PowerSGD with error "),
    ("train.seed=-1", r"train.seed must be in \[0, 4294967296\), got -1"),
    ("train.peak_tflops=0", r"train.peak_tflops must be > 0"),
    ("train.early_stopping.min_delta=-0.1", r"train.early_stopping.min_delta must be >= 0, got -0.1"),
    ("train.profile.start_step=-1", r"train.profile.start_step must be >= 0, got -1"),
    ("model.lora.dropout=1", r"model.lora.dropout must be in \[0, 1\), got 1.0"),
    ("scaling.torch_threads=0", r"scaling.torch_threads must be > 0, got 0"),
    ("scaling.gpus_per_worker=-1", r"scaling.gpus_per_worker must be >= 0, got -1.0"),
    ("scaling.cpus_per_worker=0", r"scaling.cpus_per_worker must be > 0"),
    ("data.mixup_alpha=-1", r"data.mixup_alpha and data.cutmix_alpha must be >= 0"),
    ("data.label_smoothing=1", r"data.label_smoothing must be in \[0, 1\)"),
    ("checkpoint.hold_budget=1.5", r"checkpoint.hold_budget is a share of the training time, between 0 and 1 "),
    ("checkpoint.hold_budget=0.01", r"checkpoint.hold_budget sets the interval of checkpoint.every_n_steps: auto; "
                                    r"with every_n_steps 100 it would do nothing"),
])
def test_every_number_is_in_its_range(tmp_path, override, message):
    """Issue 65 item 3: each number's range, one line naming the key, the range and the value."""
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "train:\n  lr: 0.1\n"), [override])


@pytest.mark.parametrize("overrides, message", [
    (["train.grad_compression=powersgd", "train.nonfinite=skip"],
     r"train.grad_compression powersgd with train.nonfinite skip: a skipped non-finite step would leave NaN in "
     r"PowerSGD's error feedback"),
    (["train.grad_compression=powersgd", "train.precision=fp16", "scaling.use_gpu=true"],
     r"train.grad_compression powersgd with train.precision fp16"),
    (["scaling.strategy=fsdp_full", "train.optimizer=sgd", "train.nonfinite=skip"],
     r"train.nonfinite skip with SGD under scaling.strategy fsdp_full: .* no fused SGD for sharded parameters"),
])
def test_combinations_that_failed_on_the_workers_are_refused(tmp_path, overrides, message):
    """PowerSGD kept a skipped step's NaN in its error feedback, and every step after it was NaN and skipped
    (fp16's scaler skips an overflowing step every ~2,000 steps by design); torch has no fused SGD for FSDP's
    sharded parameters, which skip's flag needs."""
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "train:\n  lr: 0.1\n"), overrides)


def test_a_sweeps_numbers_are_finite_too(tmp_path):
    """A sweep's scheduler read grace_period .nan past `grace_period <= 0` (NaN compares false)."""
    from behemoth.driver.sweep.config import SchedulerConfig, SweepConfig

    sweep = SweepConfig(job="job.yaml", space={"train.lr": {"choice": [0.1]}},
                        scheduler=SchedulerConfig(grace_period=float("nan")))
    with pytest.raises(ConfigError, match=r"scheduler.grace_period must be a finite number, got nan"):
        sweep.validate()
