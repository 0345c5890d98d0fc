"""Preference tuning with DPO (data.kind: preference): a causal LM, usually a chat run's SFT model, trained on pairs
of replies (data/chat/preference.py) to prefer the chosen one more than a frozen reference model does.

For a pair, with log-probability sums over each reply's trained tokens (its assistant turns, the end of turn
included) under the policy (pc, pr) and the reference (rc, rr), the loss is Rafailov et al.'s sigmoid loss
-log sigmoid(beta x ((pc - rc) - (pr - rr))), with data.label_smoothing e the conservative variant
(1 - e) x that + e x -log sigmoid(-beta x ...), plus data.rpo_alpha x the chosen reply's mean token NLL (the
objective: tasks/dpo.py). A step's loss is the mean over the global batch's pairs (each
micro-batch's sum over its pairs' count; worker/loop.py weighs by Task.loss_items). A pair's two sequences sit
in one block, each its own document, so they are scored in the same forward and never attend to each other.

The reference without a second copy (data.reference auto): with model.lora it is the same model with its
adapters switched off (peft's disable_adapter). A full fine-tune's reference log-probabilities are computed once
before training (precomputed, tasks/preference_reference.py): a Ray Data pass over the packed pairs on the
workers' resources with the weights the run starts from (model.pretrained, train.init_from, or the seed), stored
beside the token cache under a
fingerprint of the tokens and those weights, verified (sha256) where the workers read them and reused by every
restart and rerun. Either way training holds one model's weights. data.reference copy keeps a frozen copy on
each worker instead (twice the weights' memory, said in the log).

Metrics, under TRL's names: rewards/chosen and rewards/rejected (beta x the policy's log-ratio to the reference,
mean over pairs), rewards/accuracies (pairs whose chosen reward is the higher), rewards/margins, logps/chosen and
logps/rejected (the policy's sums), nll_loss, per report window; the same over the held-out pairs with val_ before them,
and val_loss, which picks the best checkpoint.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import torch

from behemoth.config import JobConfig
from behemoth.data.chat.chat import REJECTED, START, TRAIN, split_flags
from behemoth.data.chat.preference import PreferenceData
from behemoth.errors import ConfigError, DataError
from behemoth.hosts.console import console
from behemoth.storage.store import Store
from behemoth.tasks.chat import ChatLM
from behemoth.tasks.dpo import PAIR_SUMS, dpo_losses, made_up, pair_metrics, pairs_per_row, sequence_logps
from behemoth.tasks.preference_reference import precompute_reference

class PreferenceLM(ChatLM):
    data_config = PreferenceData
    best = ("val_loss", "min")
    reported = {"val_loss": "min", "val_rewards/accuracies": "max", "val_rewards/margins": "max", "loss": "min"}
    samples_are = "pairs"

    # --- driver side ------------------------------------------------------------------------------------
    @classmethod
    def check_model(cls, cfg: JobConfig) -> None:
        super().check_model(cfg)
        if cfg.model.lora is not None and cfg.train.init_from:
            raise ConfigError("data.kind preference with model.lora takes its reference as the model with the "
                              "adapters off, which would not be the model train.init_from loads: name the SFT "
                              "model as model.pretrained (a chat run's `behemoth export` folder, its weights "
                              "merged) and leave train.init_from empty")
        if cfg.data.reference == "adapters_off" and cfg.model.lora is None:
            raise ConfigError("data.reference adapters_off needs model.lora (the reference is the model with its "
                              "adapters switched off): set model.lora, or data.reference auto")
        if cfg.scaling.strategy != "ddp" and reference_kind(cfg) != "precomputed":
            raise ConfigError(f"data.kind preference with scaling.strategy {cfg.scaling.strategy} reads its reference "
                              f"precomputed (data.reference precomputed; auto is that without model.lora): a "
                              f"reference model's forward beside the sharded one ({reference_kind(cfg)}) is not "
                              f"built")

    @classmethod
    def prepare(cls, cfg: JobConfig, units):
        """Chat's preparation (the pairs packed into blocks), then the precomputed reference's table."""
        import time

        index = super().prepare(cfg, units)
        if reference_kind(cfg) == "precomputed":
            started = time.time()
            meta, computed = precompute_reference(cls, cfg, index)
            index.stats["reference"] = meta
            how = (f"computed in {time.time() - started:.1f} s by a pass on the workers' resources" if computed else
                   "found, computed before for these tokens and weights")
            print(f"[behemoth] DPO reference: the starting weights' log-probabilities of every pair, {how} "
                  f"({meta['folder']}): training holds one model", flush=True)
        else:
            said = {"adapters_off": "the model with its adapters off (model.lora): one model, no pass",
                    "copy": "a frozen copy of the starting weights on every worker (data.reference copy)"}
            print(f"[behemoth] DPO reference: {said[reference_kind(cfg)]}", flush=True)
        return index

    @classmethod
    def describe(cls, cfg: JobConfig, units) -> str:
        d = cfg.data
        files = d.hf_dataset or f"{len({u.path for u in units})} files in {len(units)} work units"
        return (f"preference (DPO): {files}; pairs of replies ({d.prompt_field} / {d.chosen_field} / "
                f"{d.rejected_field}) packed whole into blocks of {d.seq_len}; beta {d.beta:g}, label smoothing "
                f"{d.label_smoothing:g}, rpo_alpha {d.rpo_alpha:g}; the reference {reference_kind(cfg)}")

    @staticmethod
    def summary_lines(m: dict) -> list[str]:
        if "val_rewards/accuracies" not in m:
            return []
        return [(f"final val preference accuracy: {m['val_rewards/accuracies']:.3f} (margin "
                 f"{m['val_rewards/margins']:.3f}, val_loss {m['val_loss']:.4f} over {m['val_pairs']} pairs)")]

    @staticmethod
    def progress_fields(m: dict) -> list[str]:
        return [f"acc {m['rewards/accuracies']:.2f}"] if "rewards/accuracies" in m else []

    # --- worker side ------------------------------------------------------------------------------------
    eval_sum_names = PAIR_SUMS
    window_sum_names = PAIR_SUMS

    def __init__(self, cfg: JobConfig, index):
        super().__init__(cfg, index)
        self._window: torch.Tensor | None = None
        self._reference: torch.nn.Module | None = None

    def build_model(self):
        """The model with its dropout off (TRL's disable_dropout, its default): the loss compares the policy's
        log-probabilities with the reference's, which are taken without dropout; with it on, the policy's side is
        noise and the step-0 log-ratio is not 0. (nn.Dropout modules, and attention's dropout where a model keeps
        it as a number: Llama's config.attention_dropout.)"""
        model = super().build_model()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0
        return model

    def loss_items(self, batch):
        return pairs_per_row(batch["input_ids"]).sum()

    def loss(self, model, batch):
        """(the mean loss over the micro-batch's pairs, their count)."""
        stored, d = batch["input_ids"], self.cfg.data
        policy = sequence_logps(self._logits(model, stored), stored, counts=True)
        with torch.no_grad():
            reference = self._reference_logps(model, stored, "train", batch.get("sample_id"))
        losses, sums = dpo_losses(policy, reference, d.beta, d.label_smoothing, d.rpo_alpha)
        if not made_up(batch):  # (example_batch's made-up blocks, the step's cost measured on them, are no pairs)
            vector = torch.stack([sums[name] for name in PAIR_SUMS]).to(torch.float64)
            self._window = vector if self._window is None else self._window + vector
        count = sums["pairs"]
        return losses.sum() / count.clamp(min=1), count

    def take_window_sums(self) -> torch.Tensor:
        from behemoth import hosts

        out = self._window if self._window is not None else torch.zeros(len(PAIR_SUMS), dtype=torch.float64,
                                                                          device=hosts.device())
        self._window = None
        return out

    def window_metrics(self, sums: dict[str, float]) -> dict:
        return pair_metrics(sums) if sums["pairs"] else {}

    def eval_batches(self, indices, batch_size: int, split: str = "val"):
        self._eval_split = split  # (the split whose precomputed reference the next evaluation reads)
        return super().eval_batches(indices, batch_size, split)

    def eval_sums(self, model, batch):
        stored = batch["input_ids"]
        policy = sequence_logps(self._logits(model, stored), stored, counts=True)
        reference = self._reference_logps(model, stored, getattr(self, "_eval_split", "val"), batch.get("sample_id"))
        d = self.cfg.data
        _, sums = dpo_losses(policy, reference, d.beta, d.label_smoothing, d.rpo_alpha)
        return {name: value.to(torch.float64) for name, value in sums.items()}

    def eval_metrics(self, sums):
        pairs = max(sums["pairs"], 1.0)
        return {"val_loss": sums["loss"] / pairs, "val_pairs": int(sums["pairs"]), **pair_metrics(sums, "val_")}

    def example_batch(self, batch_size: int):
        from behemoth import hosts

        length = self.cfg.data.seq_len
        block = torch.full((batch_size, length), TRAIN, dtype=torch.long, device=hosts.device())
        block[:, length // 2:] |= REJECTED
        block[:, 0] |= START
        block[:, length // 2] |= START
        # (-1: a made-up block, the step's cost measured on it; a precomputed reference gives it zeros)
        return {"input_ids": block, "sample_id": torch.full((batch_size,), -1, dtype=torch.long)}

    def _logits(self, model, stored: torch.Tensor) -> torch.Tensor:
        ids, _, starts = split_flags(stored)
        inputs = self.document_inputs(model, ids, starts, ids)
        inputs.pop("labels")  # (no labels: the model's own loss is not wanted, its logits are)
        return model(input_ids=ids, use_cache=False, **inputs).logits

    def _reference_logps(self, model, stored: torch.Tensor, split: str,
                         sample_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) sums: precomputed (read by block), the model with its adapters
        off, or the frozen copy."""
        kind = reference_kind(self.cfg)
        if kind == "precomputed":
            return self._precomputed(split, sample_ids, stored)
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        if kind == "adapters_off":
            with inner.disable_adapter():
                return sequence_logps(self._logits(inner, stored), stored)
        return sequence_logps(self._logits(self._frozen_copy(inner), stored), stored)

    def starting_model(self) -> torch.nn.Module:
        """The weights the run starts from, built anew: the job's model as the workers build it (model.pretrained's
        weights, or the seed's), with train.init_from's loaded. The process's random state is left as it was."""
        from behemoth.storage import weights

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.train.seed)
            model = self.build_model()
        if self.cfg.train.init_from:
            weights.load_weights(model, weights.read_state_dict(self.cfg.train.init_from), self.cfg.train.init_from,
                                 self.reinit_ok)
        # in model.dtype, as the loop holds the policy (worker/precision.py master_weights: from_pretrained keeps a
        # checkpoint's stored dtype)
        return model.to(torch.float32 if self.cfg.model.dtype == "float32" else torch.bfloat16)

    def _frozen_copy(self, inner: torch.nn.Module) -> torch.nn.Module:
        """data.reference copy: the starting weights, built once per worker, never trained."""
        if self._reference is None:
            self._reference = self.starting_model().to(next(inner.parameters()).device).eval().requires_grad_(False)
            size = sum(p.numel() * p.element_size() for p in self._reference.parameters())
            console(f"DPO reference: a frozen copy of the starting weights ({size / 2**20:.1f} MiB more; "
                    f"data.reference auto would need none)")
        return self._reference

    def _precomputed(self, split: str, sample_ids, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The precomputed reference's sums of these blocks' pairs, in block order (as sequence_logps orders
        them)."""
        if sample_ids is None:
            raise DataError("the precomputed DPO reference is read by block: this batch carries no sample_id")
        ids = sample_ids.tolist()
        if min(ids) < 0:  # example_batch's
            zeros = torch.zeros(int(pairs_per_row(stored).sum()), device=stored.device)
            return zeros, zeros
        offsets, logps = self._table(split)
        if max(ids) >= len(offsets) - 1:  # (a block the table has no row for: another token cache's table)
            raise DataError(f"the precomputed DPO reference holds {len(offsets) - 1} {split} blocks, the batch "
                            f"asks for block {max(ids)}: it was not computed for this token cache; delete "
                            f"{self.index.stats['reference']['folder']} and rerun")
        rows = np.concatenate([logps[offsets[i]:offsets[i + 1]] for i in ids]).reshape(-1, 2)
        expected = int(pairs_per_row(stored).sum())
        if len(rows) != expected:
            raise DataError(f"the precomputed DPO reference holds {len(rows)} pairs for {split} blocks {ids[:8]}, the "
                            f"blocks {expected}: it was not computed for this token cache; delete "
                            f"{self.index.stats['reference']['folder']} and rerun")
        out = torch.from_numpy(rows).to(stored.device)
        return out[:, 0], out[:, 1]

    def _table(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, logps) of a split's precomputed reference, read once per worker and checked against the
        sha256 the driver recorded."""
        tables = self.__dict__.setdefault("_tables", {})
        if split not in tables:
            meta = self.index.stats["reference"]
            where = f"{meta['folder']}/{meta[split]['file']}"
            data = Store(where).read_bytes()
            if hashlib.sha256(data).hexdigest() != meta[split]["sha256"]:
                raise DataError(f"{where} does not hold the DPO reference the run computed (its sha256 differs): "
                                f"delete {meta['folder']} and rerun to compute it again")
            with np.load(io.BytesIO(data)) as npz:
                tables[split] = (npz["offsets"], npz["logps"])
        return tables[split]


def reference_kind(cfg: JobConfig) -> str:
    """adapters_off (model.lora: the same model with its adapters off), precomputed, or copy (a frozen copy)."""
    if cfg.data.reference == "auto":
        return "adapters_off" if cfg.model.lora is not None else "precomputed"
    return cfg.data.reference
