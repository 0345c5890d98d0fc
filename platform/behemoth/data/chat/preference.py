"""Preference data for DPO (data.kind: preference): pairs of replies to one prompt, one preferred, in TRL's
conversational shapes, one per JSONL line or parquet row:

- explicit prompt: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}` (the replies are what
  follows the prompt: usually one assistant message each);
- implicit prompt: `{"chosen": [messages], "rejected": [messages]}`, two whole conversations whose shared opening
  messages are the prompt.

The pipeline is chat's (data/chat/chat.py: work units, Ray Data tasks rendering in the bounded template process, the
packed cache, the token store); a record is a pair, rendered by data/chat/pair_render.py: the prompt with each reply,
the prompt's tokens the same in both, the replies' assistant tokens trained (TRAIN), the rejected sequence
flagged REJECTED. A pair is packed whole (chosen then rejected, adjacent in one block: a micro-batch holds both
or neither); a pair longer than data.seq_len is dropped, counted, never cut. A record that is not a pair (a
field missing, not a list of messages, no reply, replies that do not differ) is a bad sample named by file and
line, skipped up to data.max_bad_samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from behemoth.data.chat.chat import ChatData
from behemoth.errors import ConfigError


@dataclass
class PreferenceData(ChatData):
    """`data:` of a preference-tuning job (kind: preference): chat's keys (files, tokenizer, template, seq_len,
    packing, the cache), and the fields a pair is read from (docs/preference.md)."""

    # The record's fields: the prompt (messages; absent: the replies' shared opening is the prompt), the
    # preferred reply and the other one.
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # A pair longer than seq_len is dropped (a cut reply changes its log-probability sum): the only choice.
    overlong: Literal["drop"] = "drop"
    # DPO's beta: how far the policy may move from the reference (TRL's default 0.1; larger: closer to it).
    beta: float = 0.1
    # The conservative variant's label noise e (0: the sigmoid loss; TRL's label_smoothing).
    label_smoothing: float = 0.0
    # The chosen reply's mean token NLL added to each pair's loss with this weight (TRL's rpo_alpha; RPO, Pang et
    # al. 2024: 1.0): keeps the chosen replies likely, where DPO alone lowers both replies' likelihoods.
    rpo_alpha: float = 0.0
    # The reference model: auto (with model.lora the model with its adapters off; else precomputed: its
    # log-probabilities computed once before training, from the starting weights), adapters_off, precomputed, or
    # copy (a frozen copy of the starting weights on every worker: twice the weights' memory).
    reference: Literal["auto", "adapters_off", "precomputed", "copy"] = "auto"

    def validate(self) -> None:
        if self.train_on != "assistant":
            raise ConfigError("data.train_on is for data.kind chat: a preference pair scores its replies' "
                              "assistant tokens")
        if self.messages_field != "messages":
            raise ConfigError("data.messages_field is for data.kind chat: a preference record's fields are "
                              "data.prompt_field, data.chosen_field and data.rejected_field")
        if not self.beta > 0 or not 0 <= self.label_smoothing < 0.5 or self.rpo_alpha < 0:
            raise ConfigError(f"data.beta must be > 0, data.label_smoothing in [0, 0.5) and data.rpo_alpha >= 0, got "
                              f"{self.beta}, {self.label_smoothing} and {self.rpo_alpha}")
        if len({self.prompt_field, self.chosen_field, self.rejected_field}) < 3:
            raise ConfigError(f"data.prompt_field, data.chosen_field and data.rejected_field must differ, got "
                              f"{self.prompt_field!r}, {self.chosen_field!r}, {self.rejected_field!r}")
        super().validate()

    def pair_fields(self) -> tuple[str, str, str]:
        return self.prompt_field, self.chosen_field, self.rejected_field
