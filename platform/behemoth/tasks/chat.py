"""Chat fine-tuning (data.kind: chat): a causal LM trained on conversations rendered with a chat template, the
loss on the assistant's turns only, conversations packed whole with each its own document (data/chat/chat.py makes
the blocks; every stored token carries its TRAIN and START flags).

The loss is the mean over the step's trained tokens: each micro-batch's sum of token losses over the count of
the whole global batch's (Task.loss_items; worker/loop.py: loss_weights), not a mean of micro-batch means, which
would weigh a short reply's tokens more than a long one's. The reported loss and val_loss are per trained token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from behemoth.config import JobConfig
from behemoth.data.chat.chat import ChatData, split_flags
from behemoth.data.text.text import Unit
from behemoth.data.text.text_packing import TokenIndex
from behemoth.errors import ConfigError
from behemoth.models import registry
from behemoth.tasks.causal_lm import CausalLM
from behemoth.tasks.contract import local_model
from behemoth.tasks.kept_tokenizer import KEPT_FOLDER, with_kept_tokenizer


class ChatLM(CausalLM):
    # --- driver side ------------------------------------------------------------------------------------
    data_config = ChatData
    samples_are = "conversations"  # (a packed document's name in the preparation's lines)

    @classmethod
    def check(cls, cfg: JobConfig) -> list[Unit]:
        """Files, their first records rendered with the template, the tokenizer and the model; without Ray."""
        from behemoth.data.chat.chat import chat_tokenizer
        from behemoth.data.chat.chat_sources import plan_chat_units
        from behemoth.data.text.text_packing import _hf_splits
        from behemoth.models.causal_lm import check_causal_lm

        tok = chat_tokenizer(cfg.data)
        if cfg.data.hf_dataset:
            _hf_splits(cfg.data, cfg.data.messages_field, cfg.data.pair_fields())
            units = []
        else:
            units = plan_chat_units(cfg.data)
        check_causal_lm(local_model(cfg, weights=False), vocab_size=len(tok), eos_id=tok.eos_token_id, bos_id=tok.bos_token_id,
                        seq_len=cfg.data.seq_len)
        return units

    @classmethod
    def check_model(cls, cfg: JobConfig) -> None:
        super().check_model(cfg)
        if registry.is_import_path(cfg.model.name):
            raise ConfigError(f"data.kind chat trains a transformers causal LM (model.name causal_lm), which takes "
                              f"labels, position ids and an attention mask: model.name {cfg.model.name} is called "
                              f"with the tokens alone")

    @classmethod
    def train_samples(cls, cfg: JobConfig, data: list[Unit] | TokenIndex) -> int | None:
        """The packed blocks, once prepared (how many conversations share a block is known only then)."""
        return len(data.train) if isinstance(data, TokenIndex) else None

    @classmethod
    def prepare(cls, cfg: JobConfig, units: list[Unit]) -> TokenIndex:
        from behemoth.data.chat.chat import chat_tokenizer, pad_id, render_text, tokenizer_files
        from behemoth.data.chat.chat_packing import prepare_chat

        from behemoth.models.causal_lm import generation_config

        started = time.time()
        index = prepare_chat(cfg.data, seed=cfg.train.seed, units=units)
        stats = index.stats
        tok = chat_tokenizer(cfg.data)
        stats["eval_stop_ids"] = generation_config(tok, render_text).eos_token_id  # (the export's: EOS and the end of turn)
        _, pad_line = pad_id(tok)
        if pad_line:
            print(f"[behemoth] {pad_line}", flush=True)
        for split in ("train", "val"):
            s = stats[split]
            print(f"[behemoth] {cfg.data.kind} {split}: {s['documents']} {cls.samples_are} in {s['blocks']} blocks of "
                  f"{stats['seq_len']} tokens ({cfg.data.packing}); {s['trained_tokens']} of {s['tokens']} tokens "
                  f"trained ({cfg.data.train_on}), {s['padding_tokens']} padding; {s['truncated']} cut at seq_len, "
                  f"{s['dropped_overlong']} dropped as longer (data.overlong: {cfg.data.overlong})", flush=True)
        if stats.get("bad_records"):
            shown = stats["bad_examples"]  # (the first 20, each named by file and line or row)
            print(f"[behemoth] {stats['bad_records']} records are not conversations and were skipped "
                  f"(data.max_bad_samples {cfg.data.max_bad_samples})"
                  f"{'' if len(shown) == stats['bad_records'] else f'; the first {len(shown)}'}: {'; '.join(shown)}",
                  flush=True)
        print(f"[behemoth] chat data cache {stats['cache']} ({time.time() - started:.1f} s)", flush=True)
        stats.setdefault("tokenizer_files", tokenizer_files(tok))  # (kept in every checkpoint: kept_files)
        return index

    @classmethod
    def checkpoint_files(cls, cfg: JobConfig, index: TokenIndex) -> dict[str, str]:
        """The template the conversations were rendered with, as the kept tokenizer holds it: a rerun or `behemoth
        eval` whose template renders them otherwise is refused (driver/run/resume.task_files_differ)."""
        template = index.stats["tokenizer_files"].get("chat_template.jinja")
        return {} if template is None else {f"{KEPT_FOLDER}/chat_template.jinja": template.decode()}

    @classmethod
    def exported_job(cls, cfg: JobConfig, ckpt: str, folder: Path, named: dict[str, str | None]) -> JobConfig:
        """data.tokenizer and data.chat_template: the checkpoint's kept copies (or the user's --tokenizer and
        --chat-template), never a path the job.yaml names."""
        return with_kept_tokenizer(cfg, ckpt, folder, named, chat=True)

    @classmethod
    def describe(cls, cfg: JobConfig, units: list[Unit]) -> str:
        from behemoth.data.chat.chat import chat_tokenizer

        tok = chat_tokenizer(cfg.data)
        source = cfg.data.hf_dataset or f"{len({u.path for u in units})} files in {len(units)} work units"
        template = cfg.data.chat_template or "the tokenizer's own"
        return (f"chat: {source}; tokenizer {len(tok)} tokens, template {template}; loss on "
                f"{'the assistant turns' if cfg.data.train_on == 'assistant' else 'every token'}; conversations "
                f"{cfg.data.packing} into blocks of {cfg.data.seq_len} (counted once packed)")

    @staticmethod
    def summary_lines(m: dict) -> list[str]:
        if "val_perplexity" not in m:
            return []
        return [(f"final val ppl:     {m['val_perplexity']:.3f} (val_loss {m['val_loss']:.4f} over "
                 f"{m['val_tokens']} trained tokens)")]

    @classmethod
    def tokenizer(cls, cfg: JobConfig):
        """The run's tokenizer with the template it was trained with (data.chat_template where set)."""
        from behemoth.data.chat.chat import chat_tokenizer

        return chat_tokenizer(cfg.data)

    # --- worker side ------------------------------------------------------------------------------------
    def model_inputs(self, model, stored: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The model's keyword arguments for stored blocks (ids, positions and attention per conversation, labels
        on the trained tokens), and how many tokens the loss is taken on (labels after the model's shift)."""
        ids, trained, starts = split_flags(stored)
        labels = ids.masked_fill(~trained | starts, -100)
        count = (labels[:, 1:] != -100).sum()
        return {"input_ids": ids, **self.document_inputs(model, ids, starts, labels)}, count

    def loss_items(self, batch):
        _, trained, starts = split_flags(batch["input_ids"])
        return (trained & ~starts)[:, 1:].sum()

    def loss(self, model, batch):
        """(the mean loss over the micro-batch's trained tokens, their count)."""
        loss, count = self._token_loss(model, batch["input_ids"])
        return loss, count

    def _token_loss(self, model, stored):
        inputs, count = self.model_inputs(model, stored)
        # the sum over trained tokens over their count: a micro-batch with none gives 0, not a mean over nothing
        loss = model(**inputs, use_cache=False, num_items_in_batch=count.clamp(min=1)).loss
        return loss, count

    def eval_sums(self, model, batch):
        loss, count = self._token_loss(model, batch["input_ids"])
        count = count.to(torch.float64)
        return {"loss": loss.to(torch.float64) * count, "tokens": count}

    def eval_samples(self, model) -> list[dict]:
        """The model's greedy replies to the validation prompts the driver chose (data.eval_samples): [{prompt,
        reply}] as text, the prompt being its last turn's."""
        from behemoth.data.chat.chat import tokenizer_from_files

        prompts = self.index.stats.get("eval_prompts") or []
        if not prompts:
            return []
        if getattr(self, "_tokenizer", None) is None:  # (once per worker)
            self._tokenizer = tokenizer_from_files(self.index.stats["tokenizer_files"])
        tok = self._tokenizer
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        out = []
        positions = getattr(inner.config, "max_position_embeddings", None) or 1 << 62
        for ids in prompts:
            given = torch.tensor([ids], device=next(inner.parameters()).device)
            # (within the model's positions, as `behemoth generate` stops: the prompt came from a block of seq_len)
            new = inner.generate(given, attention_mask=torch.ones_like(given), do_sample=False,
                                 max_new_tokens=max(min(self.cfg.data.eval_max_new_tokens, positions - len(ids)), 1),
                                 eos_token_id=self.index.stats["eval_stop_ids"],
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            text = tok.decode(ids, skip_special_tokens=True).strip()
            out.append({"prompt": text[-300:], "reply": tok.decode(new[0, len(ids):], skip_special_tokens=True)})
        return out

    def example_batch(self, batch_size: int):
        from behemoth import hosts
        from behemoth.data.chat.chat import START, TRAIN

        block = torch.full((batch_size, self.cfg.data.seq_len), TRAIN, dtype=torch.long, device=hosts.device())
        block[:, 0] |= START
        return {"input_ids": block}

    def describe_samples(self, sample_ids):
        return [f"block {i}" for i in sample_ids]
