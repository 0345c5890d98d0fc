"""Text classification: labelled texts tokenised once by Ray Data; a transformers sequence classifier;
cross-entropy; validation accuracy and loss. Exports to a folder that `pipeline("text-classification")` loads.

The model: `sequence_classifier` (any transformers AutoModelForSequenceClassification, from `model.hf_config`
for tests and demos, or `model.pretrained`: weights only, no repository code unless model.trust_remote_code),
called as `model(input_ids=..., attention_mask=...).logits`; or a user's builder by import path, called with
num_classes= and vocab_size= and returning a module called the same way (logits, or an output with .logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from behemoth.storage import weights
from behemoth.storage.checkpoint import read_json
from behemoth.config import JobConfig
from behemoth.data.text.labelled_text import (
    LabelledRows,
    LabelledTextData,
    TokenisedRows,
    load_classification_tokenizer,
    read_labelled,
    tokenise,
)
from behemoth.data.prefetch import to_device_ahead
from behemoth.errors import ConfigError
from behemoth.models import registry
from behemoth.models.causal_lm import config_errors
from behemoth.models.lora import add_adapters
from behemoth import hosts
from behemoth.tasks.classification import Classification
from behemoth.tasks.contract import Task, local_model
from behemoth.tasks.kept_tokenizer import kept_tokenizer_files, with_kept_tokenizer

SEQUENCE_CLASSIFIER = "sequence_classifier"


def build_classifier(cfg: JobConfig, classes: list[str], vocab_size: int, pad_id: int,
                     ends: tuple[int | None, int | None] = (None, None)) -> torch.nn.Module:
    """The job's model for these classes; a transformers model carries their names (id2label) and the pad id
    (a decoder-only model classifies from the last token that is not padding); one built from model.hf_config
    also the tokenizer's BOS and EOS ids (`ends`), not its architecture's defaults (GPT-2's 50256 in a 300-token
    vocabulary)."""
    if registry.is_import_path(cfg.model.name):
        return registry.build_user_model(cfg.model.name, num_classes=len(classes), vocab_size=vocab_size)
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = {"num_labels": len(classes), "id2label": dict(enumerate(classes)),
              "label2id": {name: i for i, name in enumerate(classes)}}
    overrides = {**cfg.model.hf_config, "pad_token_id": pad_id}  # hf_config's own was refused (check_model)
    where = cfg.model.pretrained or f"model.hf_config ({overrides.get('model_type')})"
    try:
        if cfg.model.pretrained:
            overrides.pop("model_type", None)
            # a head for another number of labels starts fresh (transformers says which tensors it re-initialised)
            model = AutoModelForSequenceClassification.from_pretrained(
                local_model(cfg).pretrained, trust_remote_code=cfg.model.trust_remote_code, ignore_mismatched_sizes=True,
                **labels, **overrides)
        else:
            model_type = overrides.pop("model_type")
            overrides.setdefault("vocab_size", vocab_size)
            overrides.setdefault("bos_token_id", ends[0])
            overrides.setdefault("eos_token_id", ends[1])
            model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(model_type, **overrides, **labels))
    except (TypeError, *config_errors()) as e:  # an unknown model_type or key, no classifier head, keys that disagree
        raise ConfigError(f"{where}: no sequence classifier from it: {e}") from None
    # The batches are padded with the tokenizer's pad id, and a decoder-only classifier pools the last token that
    # is not config.pad_token_id: the two must agree, or training pools padding where the exported pipeline
    # (one text, unpadded) pools the last real token.
    model.config.pad_token_id = pad_id
    where = cfg.model.pretrained or f"model.hf_config ({model.config.model_type})"
    if model.config.vocab_size < vocab_size:
        raise ConfigError(f"{where}: vocab_size {model.config.vocab_size} is smaller than the tokenizer's "
                          f"{vocab_size} tokens: use the model's own tokenizer, or a larger "
                          f"model.hf_config.vocab_size")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and positions < cfg.data.max_length:
        raise ConfigError(f"{where}: max_position_embeddings {positions} < data.max_length {cfg.data.max_length}: "
                          f"lower data.max_length or raise model.hf_config.max_position_embeddings")
    return model if cfg.model.lora is None else add_adapters(model, cfg.model.lora, "SEQ_CLS")


# Model types whose classifier reads the hidden state at the EOS token that ends each text (transformers raises
# on a batch whose rows have none)
EOS_POOLING = {"bart", "mbart", "plbart", "mvp", "led", "bigbird_pegasus"}


def _check_eos_pooling(cfg: JobConfig, tok) -> None:
    """An EOS-pooling model (BART's family) with a tokenizer that appends no EOS failed every worker's first step
    ("All examples must have the same number of <eos> tokens"): refused before Ray."""
    if registry.is_import_path(cfg.model.name):
        return
    if cfg.model.pretrained:
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(local_model(cfg, weights=False).pretrained,
                                                trust_remote_code=cfg.model.trust_remote_code).model_type
    else:
        model_type = cfg.model.hf_config.get("model_type")
    ids = tok("a text", truncation=True, max_length=cfg.data.max_length)["input_ids"]
    if model_type in EOS_POOLING and (tok.eos_token_id is None or not ids or ids[-1] != tok.eos_token_id):
        raise ConfigError(f"model type {model_type} classifies from the hidden state at the EOS token that ends each "
                          f"text, and data.tokenizer {cfg.data.tokenizer} appends none: use the model's own tokenizer "
                          f"(BART's appends </s>), or another model type")


class TextClassification(Classification, Task[LabelledRows, TokenisedRows]):
    """Its step and evaluation are the ready-made classifier's (tasks/classification.py) over `logits`."""

    # --- driver side ------------------------------------------------------------------------------------
    data_config = LabelledTextData
    samples_are = "texts"
    hf_models = {SEQUENCE_CLASSIFIER: "bert"}  # any AutoModelForSequenceClassification
    builder_keywords = "num_classes and vocab_size"

    @classmethod
    def check_model(cls, cfg: JobConfig) -> None:
        super().check_model(cfg)
        taken = sorted({"num_labels", "id2label", "label2id", "pad_token_id"} & set(cfg.model.hf_config))
        if taken:
            raise ConfigError(f"model.hf_config.{taken[0]}: the labels and the pad id come from the data and its "
                              f"tokenizer (data.label_column, data.tokenizer): remove it")

    @classmethod
    def check(cls, cfg: JobConfig) -> LabelledRows:
        """Every row read and checked, the tokenizer loaded; the model built once on torch's meta device (no
        memory) from hf_config or a user's builder, so a wrong key fails here, before Ray starts."""
        rows = read_labelled(cfg.data)
        tok = load_classification_tokenizer(cfg.data.tokenizer)
        if registry.is_import_path(cfg.model.name):
            registry.check_user_model(cfg.model.name, num_classes=len(rows.classes), vocab_size=len(tok))
        elif not cfg.model.pretrained:
            with torch.device("meta"):
                build_classifier(cfg, rows.classes, len(tok), tok.pad_token_id, (tok.bos_token_id, tok.eos_token_id))
        _check_eos_pooling(cfg, tok)
        return rows

    @classmethod
    def prepare(cls, cfg: JobConfig, rows: LabelledRows) -> TokenisedRows:
        from behemoth.data.chat.chat import tokenizer_files

        tokenised = tokenise(cfg.data, rows)
        tokenised.tokenizer_files = tokenizer_files(load_classification_tokenizer(cfg.data.tokenizer))
        return tokenised

    @classmethod
    def kept_files(cls, cfg: JobConfig, rows: TokenisedRows) -> dict[str, bytes]:
        """The run's tokenizer (its pad token set), read back by export."""
        return kept_tokenizer_files(rows.tokenizer_files)

    @classmethod
    def exported_job(cls, cfg: JobConfig, ckpt: str, folder: Path, named: dict[str, str | None]) -> JobConfig:
        """data.tokenizer: the checkpoint's kept copy (or the user's --tokenizer), never the job.yaml's path."""
        return with_kept_tokenizer(cfg, ckpt, folder, named)

    @classmethod
    def train_samples(cls, cfg: JobConfig, rows: LabelledRows | TokenisedRows) -> int:
        return len(rows.texts["train"]) if isinstance(rows, LabelledRows) else len(rows.labels["train"])

    @classmethod
    def describe(cls, cfg: JobConfig, rows: LabelledRows) -> str:
        return (f"{len(rows.texts['train'])} train / {len(rows.texts['val'])} val texts, {len(rows.classes)} "
                f"classes ({', '.join(rows.classes[:8])}{', ...' if len(rows.classes) > 8 else ''})")

    @classmethod
    def model_from_checkpoint(cls, cfg: JobConfig, ckpt: str) -> torch.nn.Module:
        """The model a checkpoint holds, built as the workers built it (classes from its labels.json, checked
        against its manifest: an edited one would name the classes wrongly in the export)."""
        from behemoth.models.wrappers import in_model_dtype

        classes = read_json(ckpt, "labels.json")
        tok = load_classification_tokenizer(cfg.data.tokenizer)
        torch.manual_seed(cfg.train.seed)  # as the workers seed it: LoRA's base, built from a config, is theirs
        model = in_model_dtype(build_classifier(cfg, classes, len(tok), tok.pad_token_id,
                                                (tok.bos_token_id, tok.eos_token_id)), cfg.model.dtype)
        weights.load_weights(model, weights.read_state_dict(ckpt), ckpt)
        return model

    @classmethod
    def checkpoint_files(cls, cfg: JobConfig, rows: TokenisedRows) -> dict[str, str]:
        return {"labels.json": json.dumps(rows.classes)}  # class index -> name, read back by export

    @classmethod
    def save_for_transformers(cls, cfg: JobConfig, out: Path) -> None:
        """The run's tokenizer, with the pad token and the length the run truncated to."""
        tok = load_classification_tokenizer(cfg.data.tokenizer)
        tok.model_max_length = cfg.data.max_length
        tok.save_pretrained(out)

    @classmethod
    def load_snippet(cls, cfg: JobConfig) -> str:
        return ("from transformers import pipeline\nclassify = pipeline('text-classification', model=FOLDER)\n"
                "classify('some text', truncation=True)")

    # --- worker side ------------------------------------------------------------------------------------
    eval_batches_repeat = True  # a gather from arrays every worker holds: kept on the device after the first

    def __init__(self, cfg: JobConfig, rows: TokenisedRows):
        super().__init__(cfg, rows)
        self.rows = rows
        self.num_train_samples, self.num_val_samples = len(rows.labels["train"]), len(rows.labels["val"])
        self.transformers_model = not registry.is_import_path(cfg.model.name)
        # fine-tuning for other classes: a head whose first dimension is this task's class count starts fresh
        self.reinit_ok = weights.classification_head(len(rows.classes))

    def build_model(self):
        model = build_classifier(self.cfg, self.rows.classes, self.rows.vocab_size, self.rows.pad_id,
                                 (self.rows.bos_id, self.rows.eos_id))
        if getattr(getattr(model, "config", None), "use_cache", None):
            model.config.use_cache = False  # a decoder's key/value cache is for generation: training drops it
        return model

    def train_batches(self, indices, epoch: int, batch_size: int):
        return self._batches("train", indices, batch_size)

    def eval_batches(self, indices, batch_size: int, split: str = "val"):
        return self._batches(split, indices, batch_size)

    def _batches(self, split: str, indices, batch_size: int):
        """A gather from the tokenised arrays; on GPU pinned and copied one batch ahead (overlapping the step)."""
        rows = self.rows

        def gathered():
            for start in range(0, len(indices), batch_size):
                ids = np.asarray(indices[start:start + batch_size], dtype=np.int64)
                yield {"input_ids": torch.from_numpy(rows.ids[split][ids].astype(np.int64)),
                       "attention_mask": torch.from_numpy(rows.mask[split][ids].astype(np.int64)),
                       "label": torch.from_numpy(rows.labels[split][ids]),
                       "sample_id": torch.from_numpy(ids)}

        return to_device_ahead(gathered(), hosts.device(), host_keys=("sample_id",))

    def example_batch(self, batch_size: int):
        device, length = hosts.device(), self.cfg.data.max_length
        return {"input_ids": torch.zeros(batch_size, length, dtype=torch.long, device=device),
                "attention_mask": torch.ones(batch_size, length, dtype=torch.long, device=device),
                "label": torch.zeros(batch_size, dtype=torch.long, device=device)}

    def logits(self, model, batch: dict) -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return out.logits if hasattr(out, "logits") else out

    def describe_samples(self, sample_ids):
        return [self.rows.describe("train", int(i)) for i in sample_ids]

