"""Causal language modelling: packed token blocks from the object store; the model's own shifted loss;
validation perplexity over every validation token, aggregated over all workers.

The model: `causal_lm` (any transformers AutoModelForCausalLM), called as `model(input_ids, labels=input_ids)`
for its own loss, or a user's builder by import path, called with vocab_size= and returning a module whose
`model(input_ids)` gives the logits [batch, seq, vocab]: the loss is then the same shifted cross-entropy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from behemoth.storage import weights
from behemoth.config import JobConfig
from behemoth.errors import ConfigError
from behemoth.data.chat.chat import tokenizer_files
from behemoth.data.prefetch import to_device_ahead
from behemoth.data.text.text import TextData, Unit
from behemoth.data.text.text_packing import TokenIndex
from behemoth.models import registry
from behemoth.models.causal_lm import (build_causal_lm, check_causal_lm, train_on_causal_attention,
                                       train_on_document_attention)
from behemoth.models.lora import add_adapters
from behemoth.models.chunked_loss import use_chunked_loss
from behemoth import hosts
from behemoth.hosts.console import console
from behemoth.tasks.contract import Task, local_model
from behemoth.tasks.kept_tokenizer import kept_tokenizer_files, with_kept_tokenizer


def build_lm(cfg: JobConfig, vocab_size: int, eos_id: int, bos_id: int | None, train: bool = False,
             chunked_loss: bool = True) -> torch.nn.Module:
    """The job's model (with model.lora's adapters); `train`: as the workers train it (plain causal attention
    where the whole block is one sequence: models/causal_lm.train_on_causal_attention; the loss from the
    output projection in chunks, never the whole logits: models/chunked_loss.py, where it applies and
    `chunked_loss`)."""
    if registry.is_import_path(cfg.model.name):
        return registry.build_user_model(cfg.model.name, vocab_size=vocab_size)
    model = build_causal_lm(local_model(cfg), vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id,
                            seq_len=cfg.data.seq_len)
    if train and not cfg.data.document_mask:
        model = train_on_causal_attention(model)
    elif train:
        device_type = hosts.device().type if torch.cuda.is_available() else "cpu"
        said = train_on_document_attention(model, device_type, "attn_implementation" in cfg.model.hf_config)
        if said and hosts.current().rank == 0:
            console(said)
    if train and chunked_loss:
        use_chunked_loss(model)  # (before the adapters: peft calls the model's forward, this one)
    return model if cfg.model.lora is None else add_adapters(model, cfg.model.lora, "CAUSAL_LM")


class CausalLM(Task[list[Unit], TokenIndex]):
    # --- driver side ------------------------------------------------------------------------------------
    data_config = TextData
    best = ("val_loss", "min")
    reported = {"val_loss": "min", "val_perplexity": "min", "loss": "min"}
    hf_models = {registry.CAUSAL_LM: "llama"}  # any AutoModelForCausalLM
    builder_keywords = "vocab_size"

    @classmethod
    def check(cls, cfg: JobConfig) -> list[Unit]:
        """Files, formats, columns and the tokenizer, checked without Ray; the work units to tokenise."""
        from behemoth.data.text.text import load_tokenizer
        from behemoth.data.text.text_packing import check_text_sources

        units = check_text_sources(cfg.data)
        tok = load_tokenizer(cfg.data.tokenizer)
        if registry.is_import_path(cfg.model.name):
            registry.check_user_model(cfg.model.name, vocab_size=len(tok))
        else:
            check_causal_lm(local_model(cfg, weights=False), vocab_size=len(tok), eos_id=tok.eos_token_id, bos_id=tok.bos_token_id,
                            seq_len=cfg.data.seq_len)
        return units

    @classmethod
    def train_samples(cls, cfg: JobConfig, data: list[Unit] | TokenIndex) -> int | None:
        """The packed blocks, once prepared; before, the blocks of a small corpus, counted (None: a larger one)."""
        from behemoth.data.text.text_packing import count_train_blocks

        return len(data.train) if isinstance(data, TokenIndex) else count_train_blocks(cfg.data, data, cfg.train.seed)

    @classmethod
    def prepare(cls, cfg: JobConfig, units: list[Unit]) -> TokenIndex:
        """Tokenise and pack the corpus with Ray Data (or read its cache): the blocks the workers gather from."""
        import time

        from behemoth.data.text.text_packing import prepare_text

        started = time.time()
        tokens = prepare_text(cfg.data, seed=cfg.train.seed, units=units)
        stats = tokens.stats
        splits = "; ".join(
            f"{s}: {stats[s]['blocks']} blocks of {stats['seq_len']} tokens ({stats[s]['documents']} documents, "
            f"{stats[s]['tokens']} tokens, {stats[s]['tail_tokens_dropped']} in the final partial block dropped)"
            for s in ("train", "val"))
        print(f"[behemoth] text {splits}. Cache {stats['cache']} ({time.time() - started:.1f} s)", flush=True)
        stats["tokenizer_files"] = tokenizer_files(cls.tokenizer(cfg))  # (kept in every checkpoint: kept_files)
        return tokens

    @classmethod
    def kept_files(cls, cfg: JobConfig, index: TokenIndex) -> dict[str, bytes]:
        """The run's tokenizer (its chat template included), read back by export and generate."""
        return kept_tokenizer_files(index.stats["tokenizer_files"])

    @classmethod
    def exported_job(cls, cfg: JobConfig, ckpt: str, folder: Path, named: dict[str, str | None]) -> JobConfig:
        """data.tokenizer: the checkpoint's kept copy (or the user's --tokenizer), never the job.yaml's path."""
        return with_kept_tokenizer(cfg, ckpt, folder, named)

    @classmethod
    def describe(cls, cfg: JobConfig, units: list[Unit]) -> str:
        from behemoth.data.text.text import load_tokenizer
        from behemoth.data.text.text_packing import count_train_blocks

        source = cfg.data.hf_dataset or f"{len({u.path for u in units})} files in {len(units)} work units"
        blocks = count_train_blocks(cfg.data, units, cfg.train.seed)
        packed = (f"{blocks} training blocks of {cfg.data.seq_len} tokens" if blocks is not None else
                  "tokenised at train time: its blocks, and an epoch's steps, are checked once packed")
        return f"text: {source}; tokenizer {len(load_tokenizer(cfg.data.tokenizer))} tokens ({packed})"

    @staticmethod
    def summary_lines(m: dict) -> list[str]:
        if "val_perplexity" not in m:
            return []
        return [f"final val ppl:     {m['val_perplexity']:.3f} (val_loss {m['val_loss']:.4f}, "
                f"{m['val_tokens']} tokens)"]

    @staticmethod
    def progress_fields(m: dict) -> list[str]:
        return [f"val_loss {m['val_loss']:.4f}", f"val_ppl {m['val_perplexity']:.3f}"] if "val_perplexity" in m else []

    @classmethod
    def model_from_checkpoint(cls, cfg: JobConfig, ckpt: str) -> torch.nn.Module:
        """Driver side (export): the model a checkpoint holds, built as the workers built it (the vocabulary
        from the run's tokenizer, data.tokenizer: export's is the checkpoint's kept copy, exported_job)."""
        from behemoth.data.text.text import load_tokenizer
        from behemoth.models.wrappers import in_model_dtype

        tok = load_tokenizer(cfg.data.tokenizer)
        torch.manual_seed(cfg.train.seed)  # as the workers seed it: LoRA's base, built from a config, is theirs
        model = in_model_dtype(build_lm(cfg, len(tok), tok.eos_token_id, tok.bos_token_id), cfg.model.dtype)
        weights.load_weights(model, weights.read_state_dict(ckpt), ckpt)
        return model

    @classmethod
    def save_for_transformers(cls, cfg: JobConfig, out: Path) -> None:
        """The run's tokenizer files (its chat template kept), for AutoTokenizer.from_pretrained, and
        generation_config.json: the model's own (written beside it, if any) with the tokenizer's EOS, the chat
        template's end-of-turn token and a pad id (models/causal_lm.generation_config), which serving stacks
        and `generate` stop on."""
        from transformers import GenerationConfig

        from behemoth.data.chat.chat import render_text
        from behemoth.models.causal_lm import generation_config

        tok = cls.tokenizer(cfg)
        tok.save_pretrained(out)
        _limit_to_positions(out)
        base = GenerationConfig.from_pretrained(out) if (out / "generation_config.json").is_file() else None
        generation_config(tok, render_text, base).save_pretrained(out)

    @classmethod
    def tokenizer(cls, cfg: JobConfig):
        """The run's tokenizer as the export keeps it."""
        from behemoth.data.text.text import load_tokenizer

        return load_tokenizer(cfg.data.tokenizer)

    @classmethod
    def load_snippet(cls, cfg: JobConfig) -> str:
        return ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "model = AutoModelForCausalLM.from_pretrained(FOLDER)\ntokenizer = AutoTokenizer.from_pretrained(FOLDER)")

    # --- worker side ------------------------------------------------------------------------------------
    eval_sum_names = ("loss", "tokens")  # loss summed over predicted tokens, predicted tokens

    def __init__(self, cfg: JobConfig, index: TokenIndex):
        super().__init__(cfg, index)
        self.index = index
        self.num_train_samples, self.num_val_samples = len(index.train), len(index.val)
        self.tokens_per_sample = cfg.data.seq_len
        self.transformers_model = not registry.is_import_path(cfg.model.name)

    @classmethod
    def check_model(cls, cfg: JobConfig) -> None:
        super().check_model(cfg)
        if cfg.data.document_mask and registry.is_import_path(cfg.model.name):
            raise ConfigError(f"data.document_mask needs a transformers model (causal_lm), which takes position ids "
                              f"and an attention mask: model.name {cfg.model.name} is called with the tokens alone")

    def build_model(self):
        return build_lm(self.cfg, self.index.vocab_size, self.index.eos_id, self.index.bos_id, train=True)

    def train_batches(self, indices, epoch: int, batch_size: int):
        return self._batches(self.index.train, indices, batch_size)

    def eval_batches(self, indices, batch_size: int, split: str = "val"):
        return self._batches(getattr(self.index, split), indices, batch_size)


    def example_batch(self, batch_size: int):
        return {"input_ids": torch.zeros(batch_size, self.cfg.data.seq_len, dtype=torch.long,
                                         device=hosts.device())}

    @staticmethod
    def _batches(blocks, indices, batch_size: int):
        """The blocks are already tokenised and packed: a batch is a gather by block index from the array
        shared through the object store, or from the memory-mapped shard files (data.token_store: files; the
        batch after next is then prefetched into the page cache). On GPU the gather lands in pinned memory and
        the copy is issued one batch ahead, so it overlaps the step."""
        prefetch = getattr(blocks, "prefetch", None)

        def gathered():
            for start in range(0, len(indices), batch_size):
                if prefetch is not None:
                    prefetch(indices[start + batch_size:start + 2 * batch_size])
                yield gather_batch(blocks, indices[start:start + batch_size])

        return to_device_ahead(gathered(), hosts.device(), host_keys=("sample_id",))

    def loss_items(self, batch):
        """With data.document_mask, the tokens predicted, which vary with the documents' starts between
        micro-batches and ranks: the step weighs each micro-batch by them (Task.loss_items), so its gradient is
        the mean over the step's predicted tokens. Without it every row predicts seq_len - 1: equal weights."""
        return self._predicted(batch["input_ids"]) if self.cfg.data.document_mask else None

    def _predicted(self, ids: torch.Tensor) -> torch.Tensor:
        """data.document_mask: the tokens `ids` predicts (not a document's first: a token after an EOS), a device
        scalar."""
        return (ids.shape[0] * (ids.shape[1] - 1) - (ids[:, :-1] == self.index.eos_id).sum()).to(torch.float32)

    def loss(self, model, batch):
        """Labels are the inputs, shifted by one: each row predicts seq_len - 1 tokens (with data.document_mask,
        not the first token of a document from the one before). (the mean loss, its count: the rows, or with
        data.document_mask the tokens predicted, as loss_items weighs them)."""
        ids = batch["input_ids"]
        if self.cfg.data.document_mask:
            return self._mean_loss(model, ids), self._predicted(ids)
        # the count filled on the device: torch.tensor(n, device=...) would be a blocking host-to-device copy
        return self._mean_loss(model, ids), torch.full((), float(len(ids)), device=ids.device)

    def _mean_loss(self, model, ids: torch.Tensor) -> torch.Tensor:
        if self.transformers_model:
            # the model shifts the labels itself; no key/value cache (generation's: training would build one
            # per layer and step, and throw it away)
            if self.cfg.data.document_mask:
                starts = torch.zeros_like(ids, dtype=torch.bool)
                starts[:, 1:] = ids[:, :-1] == self.index.eos_id  # a token after EOS starts a document
                inputs = self.document_inputs(model, ids, starts, ids.masked_fill(starts, -100))
                return model(input_ids=ids, use_cache=False, **inputs).loss
            return model(input_ids=ids, labels=ids, use_cache=False).loss
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    @staticmethod
    def document_inputs(model, ids: torch.Tensor, starts: torch.Tensor, labels: torch.Tensor) -> dict:
        """data.document_mask: the documents of each packed block (`starts`: a document's first token) as the
        model's position ids (from 0 at each document's start), its attention (causal within a document:
        FlexAttention's block mask, a 4-D boolean mask for SDPA, additive for eager attention; for flash attention
        the documents' cumulative lengths over the whole micro-batch, flattened: transformers infers them from the
        position ids only for a batch of one row, and with more rows a block's documents would attend to each
        other) and `labels` (-100 at least at a document's first token: never predicted from the document before).
        All on the device, from the tokens; nothing read on the host but flash's lengths (one sync a step)."""
        length = ids.shape[1]
        steps = torch.arange(length, device=ids.device)
        document = starts.cumsum(dim=1)
        positions = steps - torch.where(starts, steps, 0).cummax(dim=1).values
        inputs = {"position_ids": positions, "labels": labels}
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        implementation = inner.config._attn_implementation
        if "flash" in implementation:
            from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

            # (every row starts a document: the rows' ends are documents' ends in the flattened tokens)
            (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions)
            return {**inputs, "cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": max_q,
                    "max_length_k": max_k}
        if implementation == "flex_attention":
            return {**inputs, "attention_mask": document_block_mask(document)}
        mask = (document[:, :, None] == document[:, None, :]) & (steps[:, None] >= steps[None, :])
        if implementation != "sdpa":  # eager and the like add the mask to the scores
            mask = torch.zeros(mask.shape, dtype=inner.dtype, device=ids.device).masked_fill(
                ~mask, torch.finfo(inner.dtype).min)
        return {**inputs, "attention_mask": mask[:, None]}

    def eval_sums(self, model, batch):
        ids = batch["input_ids"]
        loss = self._mean_loss(model, ids).to(torch.float64)
        if self.cfg.data.document_mask:  # the predicted tokens: not the documents' first ones
            predicted = self._predicted(ids).to(torch.float64)
            return {"loss": loss * predicted, "tokens": predicted}
        predicted = ids.shape[0] * (ids.shape[1] - 1)
        return {"loss": loss * predicted, "tokens": torch.tensor(float(predicted), device=ids.device)}

    def eval_metrics(self, sums):
        tokens = max(sums["tokens"], 1.0)
        val_loss = sums["loss"] / tokens
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0)), "val_tokens": int(tokens)}

    # bad_samples: none (the base's): text was checked and tokenised before training

    def describe_samples(self, sample_ids):
        return [f"block {i}" for i in sample_ids]


def document_block_mask(document: torch.Tensor, block: int = 128):
    """FlexAttention's block mask for packed documents: query q sees key k where both are in the same document
    (`document`: B x L, a document's number at each position, nondecreasing along a row) and k <= q. Built from
    each block's first and last document number, never from the L x L mask (create_block_mask evaluates the
    mask function at every position pair: 0.6 GB at 8,192 tokens on a CPU): a key block is left out where its
    last document ends before the query block's first begins or it lies after the query block, whole where both
    blocks hold one and the same document and the key block lies before (no mask evaluated in it), and partial
    (the mask function decides per position) elsewhere. (L / `block`)^2 entries per row."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, length = document.shape
    n = -(-length // block)
    begins = torch.arange(n, device=document.device) * block
    first, last = document[:, begins], document[:, (begins + block - 1).clamp(max=length - 1)]  # B x n each
    # query block i (rows) against key block j (columns), j <= i
    below = torch.ones(n, n, dtype=torch.bool, device=document.device).tril()
    seen = below & (last[:, None, :] >= first[:, :, None])  # (j's documents reach i's first one)
    whole = below.tril(-1) & (first[:, None, :] == last[:, :, None])  # (one document from j's start to i's end)
    if length % block:  # (a last query block cut short is never whole, as create_block_mask counts it)
        whole[:, -1] = False
    partial = seen & ~whole

    def blocks(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = chosen.sum(-1, dtype=torch.int32)[:, None]  # B x 1 x n
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return counts, order

    def same_document_causal(b, h, q_idx, kv_idx):
        return (document[b, q_idx] == document[b, kv_idx]) & (kv_idx <= q_idx)

    kv_counts, kv_order = blocks(partial)
    full_counts, full_order = blocks(whole)
    return BlockMask.from_kv_blocks(kv_counts, kv_order, full_counts, full_order, BLOCK_SIZE=block,
                                    mask_mod=same_document_causal, seq_lengths=(length, length))


def gather_batch(blocks, block_ids) -> dict:
    """One batch on the host: the tokens of these blocks, and as `sample_id` the ids stored with the tokens
    (token_store), read from the same rows. The sample ledger records them: they name the blocks the model
    received, not the ones the plan asked for, so a gather that fetched the wrong rows shows in the ledger."""
    rows = blocks.gather(np.asarray(block_ids, dtype=np.int64))
    return {"input_ids": torch.from_numpy(rows["tokens"].astype(np.int64)),
            "sample_id": torch.from_numpy(rows["id"].copy())}


def _limit_to_positions(out: Path) -> None:
    """The exported tokenizer's model_max_length is the model's max_position_embeddings: training lifts it
    (data/text/text.load_tokenizer: packing cuts the documents), and a serving stack that reads the tokenizer's
    limit would otherwise see none."""
    config, tokenizer_config = out / "config.json", out / "tokenizer_config.json"
    if not (config.is_file() and tokenizer_config.is_file()):
        return
    positions = json.loads(config.read_text()).get("max_position_embeddings")
    if positions:
        settings = json.loads(tokenizer_config.read_text())
        settings["model_max_length"] = positions
        tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
