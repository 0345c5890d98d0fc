"""Driver side: `behemoth export` — a checkpoint (or a run's best or latest) as a Hugging Face model folder.

The folder holds what `from_pretrained` and `pipeline` read, so it loads with transformers alone:
- a transformers model: `save_pretrained` (config.json, with a classifier's label names as id2label/label2id;
  model.safetensors);
- the task's files beside it (Task.save_for_transformers: e.g. an image processor config that repeats
  behemoth's validation preprocessing, or the run's tokenizer);
- a model card (README.md): how to load it, the job config, the data, the steps and the final metrics.
A model of one's own (model.name as an import path) is written as model.safetensors plus
behemoth_model.json naming its builder: loading it needs that builder's code, which the card shows.

A checkpoint may come from someone else, and its job.yaml is only data: behemoth imports no module that job.yaml
alone names (a model builder or a task by import path) and never honours its model.trust_remote_code. The user
names that code on the command line (--model-code, --task-code, --trust-remote-code) or export refuses, saying
which flag would run what. Nor does it read a file the job.yaml names for what it ships: the tokenizer and the chat
template come from the checkpoint's own kept copy (Task.exported_job, tasks/kept_tokenizer.py), checked against
its manifest, or from --tokenizer / --chat-template where the user names them (a checkpoint written before
behemoth kept them: refused in one line naming the flag).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


from behemoth.storage import weights
from behemoth.storage.checkpoint import complete_checkpoints, job_sections, read_state, read_verified
from behemoth.config import DataConfig, JobConfig, ModelConfig, dump_yaml, warn_remote_code
from behemoth.errors import CheckpointError, ConfigError
from behemoth.job import config_from_dict
from behemoth.models import registry
from behemoth.models.lora import is_adapted
from behemoth.tasks import task_of
from behemoth.tasks.registry import is_custom_kind
from behemoth.storage.paths import local_out_folder
from behemoth.storage.store import Store
from behemoth.driver.commands.args import add_trusted_code_args


@dataclass(frozen=True)
class TrustedCode:
    """The code the user allows an export to run, named by them, not by the checkpoint: a model builder
    (module:function) and a task (module:Class) to import, and whether model.pretrained's own code may run; and
    the files they name in place of the checkpoint's kept copies: a tokenizer folder and a chat template file."""

    model_code: Optional[str] = None
    task_code: Optional[str] = None
    trust_remote_code: bool = False
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None

    def named_files(self) -> dict[str, str | None]:
        """What Task.exported_job takes as `named`."""
        return {"tokenizer": self.tokenizer, "chat_template": self.chat_template}


ADAPTER_FOLDER = "adapter"  # model.lora: PEFT's adapter folder, beside the merged model


def export(path: str, out: str, which: str = "best", trusted: TrustedCode = TrustedCode()) -> tuple[Path, str]:
    """Write the export of `path` (a checkpoint folder, or a run folder: its `which` checkpoint) to `out`, a
    new or empty local folder (`~` expanded). Returns (the folder, which checkpoint was exported and why)."""
    if not Store(out).is_local:  # refused before anything is read: Path would make a local ./s3:/bucket/x of it
        raise ConfigError(f"--out {out} is a URI: export writes a local folder; export into one (--out "
                          f"exports/NAME) and copy that folder to {out} afterwards with your storage's tool")
    out_dir = local_out_folder(out, empty="the export")
    with tempfile.TemporaryDirectory(prefix="behemoth-kept-") as kept:
        loaded = load_checkpoint_model(path, which, trusted, Path(kept))
        out_dir.mkdir(parents=True, exist_ok=True)
        transformers_model = _write_model(loaded, out_dir)
    (out_dir / "README.md").write_text(model_card(loaded.cfg, loaded.ckpt, loaded.how, transformers_model))
    return out_dir, f"{loaded.ckpt} ({loaded.how})"


def _write_model(loaded: LoadedCheckpoint, out_dir: Path) -> bool:
    """The model's files (LoRA's adapters merged) and the task's beside them, from the job with the checkpoint's
    kept copies in place of the paths it names (`built`); whether it is a transformers model."""
    from transformers import PreTrainedModel

    built, task, model = loaded.built, loaded.task, loaded.model
    if is_adapted(model):  # model.lora: the adapters as PEFT's folder, and merged into the plain model below
        model.save_pretrained(out_dir / ADAPTER_FOLDER)
        task.save_for_transformers(built, out_dir / ADAPTER_FOLDER)
        model = model.merge_and_unload()

    if isinstance(model, PreTrainedModel):
        model.save_pretrained(out_dir)
        task.save_for_transformers(built, out_dir)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out_dir / "model.safetensors"))
        (out_dir / "behemoth_model.json").write_text(json.dumps({"builder": built.model.name}, indent=1))
    return isinstance(model, PreTrainedModel)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint's model, built as the workers built it (LoRA adapters still apart), with its job config
    (`cfg`, as its job.yaml says: the model card's), the job it was built from (`built`: the checkpoint's kept
    copies, or the user's files, in place of the paths it names; they live in the folder the caller gave), its
    task, the checkpoint folder chosen and why."""

    cfg: JobConfig
    built: JobConfig
    task: type
    ckpt: str
    how: str
    model: object


def load_checkpoint_model(path: str, which: str, trusted: TrustedCode, folder: Path) -> LoadedCheckpoint:
    """The model of `path` (a checkpoint folder, or a run folder: its `which` checkpoint), in eval mode, importing
    only the code the user trusts, its tokenizer and chat template the checkpoint's own (`behemoth export` and
    `behemoth generate`): the checkpoint's kept files are written into `folder`, which the caller removes."""
    cfg = _job_of(path, trusted)
    task = task_of(cfg)
    ckpt, how = weights.resolve(path, which, task.best, task.reported)
    if not weights.is_checkpoint(ckpt):
        raise ConfigError(f"{path} is already a Hugging Face folder, not a behemoth checkpoint")
    cfg = _job_of(ckpt, trusted)  # the chosen checkpoint's own config
    warn_remote_code(cfg.model)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars: one model
    built = task.exported_job(cfg, ckpt, folder, trusted.named_files())
    return LoadedCheckpoint(cfg, built, task, ckpt, how, task.model_from_checkpoint(built, ckpt).eval())


def _job_of(path: str, trusted: TrustedCode) -> JobConfig:
    """The job config of a checkpoint folder, or of a run folder's latest complete checkpoint, with only the
    code the user trusts (its job.yaml is read as data first: building the config imports what it names)."""
    p = Store(path).expanded()  # a URI as it is (Path would fold its //)
    candidates = [p] if weights.is_checkpoint(p) else [c for _, c in complete_checkpoints(p)]
    if not candidates:
        weights.resolve(path)  # raises the message that says what the folder is not, or:
        raise ConfigError(f"{path} is already a Hugging Face folder, not a behemoth checkpoint")
    job = f"{candidates[0]}/job.yaml"
    try:  # checked against the manifest before it is read: an edited job.yaml is damage, never a config to build
        raw = job_sections(read_verified(candidates[0], "job.yaml"), candidates[0])
    except OSError as e:
        raise CheckpointError(f"{candidates[0]}: cannot read its job.yaml ({e})") from None
    return config_from_dict(_with_trusted_code(raw, trusted, job), where=str(job))


def _with_trusted_code(raw: dict, trusted: TrustedCode, job: str) -> dict:
    """`raw` with the code to import and run replaced by what the user named; code that only the checkpoint
    names is refused, naming the flag that would run it."""
    model, data = dict(raw.get("model") or {}), dict(raw.get("data") or {})
    kind, name = data.get("kind", DataConfig.kind), model.get("name", ModelConfig.name)
    if isinstance(kind, str) and is_custom_kind(kind) and trusted.task_code is None:
        raise ConfigError(f"{job}: data.kind {kind} is a task by import path; behemoth does not import code that "
                          f"a checkpoint names. If you trust it, pass --task-code {kind}")
    if isinstance(name, str) and registry.is_import_path(name) and trusted.model_code is None:
        raise ConfigError(f"{job}: model.name {name} is a model builder by import path; behemoth does not import "
                          f"code that a checkpoint names. If you trust it, pass --model-code {name}")
    if model.get("trust_remote_code") and not trusted.trust_remote_code:
        raise ConfigError(f"{job}: model.trust_remote_code is true, which would run the code of repository "
                          f"{model.get('pretrained')}; behemoth does not honour it from a checkpoint. If you trust "
                          f"that repository, pass --trust-remote-code")
    if trusted.task_code is not None:
        data["kind"] = trusted.task_code
    if trusted.model_code is not None:
        model["name"] = trusted.model_code
    model["trust_remote_code"] = trusted.trust_remote_code and bool(model.get("pretrained"))
    return {**raw, "model": model, "data": data}


def model_card(cfg: JobConfig, ckpt: str, how: str, transformers_model: bool) -> str:
    state = read_state(ckpt)
    metrics = {k: v for k, v in weights.checkpoint_metrics(ckpt).items()  # (the figures: not val_outputs' rows)
               if (k.startswith("val_") or k in ("loss", "step", "epoch", "samples_seen")) and not isinstance(v, list)}
    task = task_of(cfg)
    if not transformers_model:
        load = (f"model = {cfg.model.name.split(':')[1]}(...)  # from {cfg.model.name.split(':')[0]}, with the "
                f"run's {task.builder_keywords}\nsafetensors.torch.load_model(model, 'model.safetensors')")
    else:
        load = task.load_snippet(cfg)
    if cfg.model.lora is not None:
        load += (f"\n# the LoRA adapters alone (merged into the model above), on the base model they were trained on:"
                 f"\n# peft.PeftModel.from_pretrained(base_model, FOLDER + '/{ADAPTER_FOLDER}')")
    data = cfg.data.source()
    lines = [
        f"# {cfg.checkpoint.run_name}", "",
        f"Trained with behemoth: {cfg.model.name} on {cfg.data.kind} data ({data}), exported from {ckpt} ({how}).",
        "", f"How it was trained: {how_trained(cfg)}.",
        "", "## Load", "", "```python", load, "```", "",
        "## Training", "",
        f"- steps: {state.step} ({state.samples_seen} samples, epoch {state.epoch}, {state.world_size} workers)",
        f"- global batch {cfg.train.global_batch_size}, {cfg.train.optimizer} lr {cfg.train.lr}, precision "
        f"{cfg.train.precision}, seed {cfg.train.seed}",
        *(["", "## Metrics at this checkpoint", "", *[f"- {k}: {v}" for k, v in metrics.items()]] if metrics else []),
        "", "## Job config", "", "```yaml", dump_yaml(cfg).rstrip(), "```", "",
    ]
    return "\n".join(lines)


def how_trained(cfg: JobConfig) -> str:
    """The model card's line on how the weights came to be: from what (a pretrained model, a config, another
    run's weights) and by what (full training or LoRA adapters merged in)."""
    model = cfg.model
    if model.pretrained:
        start = f"the pretrained model {model.pretrained}"
    elif model.hf_config:
        start = f"a freshly initialised {model.hf_config.get('model_type', model.name)} (model.hf_config)"
    else:
        start = f"a freshly built {model.name}"
    if cfg.train.init_from:
        start += f", its weights then taken from {cfg.train.init_from} (train.init_from)"
    if model.lora is not None:
        modules = ", ".join(model.lora.target_modules) if model.lora.target_modules else "peft's default modules"
        return (f"LoRA adapters (r {model.lora.r}, alpha {model.lora.alpha}, on {modules}) trained on {start}, "
                f"its weights frozen; the adapters are merged into this model and kept alone in {ADAPTER_FOLDER}/")
    tuned = "full fine-tuning of" if model.pretrained or cfg.train.init_from else "training from scratch of"
    return f"{tuned} {start}, every weight trained"


def add_command(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder (save_pretrained: "
                       "safetensors, config with labels, image processor or tokenizer, model card)")
    p.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its best checkpoint by default)")
    p.add_argument("--out", required=True, help="a new (or empty) local folder to write (not a URI: copy the "
                   "folder to a bucket afterwards)")
    pick = p.add_mutually_exclusive_group()
    pick.add_argument("--best", dest="which", action="store_const", const="best", default="best",
                      help="a run folder's best checkpoint by the task's metric (default)")
    pick.add_argument("--latest", dest="which", action="store_const", const="latest",
                      help="a run folder's latest checkpoint")
    add_trusted_code_args(p)
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to export instead of the one the "
                   "checkpoint keeps (the run's); needed for a checkpoint written before behemoth kept it, whose "
                   "job.yaml names a template file: behemoth reads no file a checkpoint names")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    trusted = TrustedCode(args.model_code, args.task_code, args.trust_remote_code, args.tokenizer, args.chat_template)
    out, source = export(args.checkpoint, args.out, args.which, trusted)
    print(f"[behemoth] exported {source}\n  to {out} (load with transformers' from_pretrained / pipeline; "
          f"see its README.md)")
    return 0
