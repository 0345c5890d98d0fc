"""DPO's reference log-probabilities computed once before training (data.reference precomputed, a full fine-tune's
default), on the driver's side: a Ray Data pass over the packed pairs (data/chat/block_scores.py) with the weights the
run starts from, in the run's precision, written beside the token cache under a fingerprint of the tokens and
those weights; the workers read it by block (tasks/preference.py).
"""

from __future__ import annotations

import hashlib
import io
import json
from types import SimpleNamespace

import numpy as np
import torch

from behemoth.config import JobConfig
from behemoth.errors import DataError
from behemoth.storage.paths import is_inside
from behemoth.storage.store import Store
from behemoth.tasks.dpo import pairs_per_row, sequence_logps

REFERENCE_VERSION = 1  # (in the fingerprint: a change of how the table is computed or stored)


class ReferenceScorer:
    """In a scoring actor (data/chat/block_scores.py): the starting weights on the actor's device, and a function from
    stored blocks to each block's pairs' (chosen, rejected) sums, flattened, under the run's precision."""

    def __init__(self, task_class, cfg: JobConfig, vocab_size: int, eos_id: int, bos_id: int | None):
        self.task_class, self.cfg = task_class, cfg  # (the task: PreferenceLM, whose starting weights are built)
        self.vocab = dict(vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)

    def __call__(self):
        cfg = self.cfg
        device = torch.device("cuda" if cfg.scaling.use_gpu and torch.cuda.is_available() else "cpu")
        if cfg.scaling.torch_threads:
            torch.set_num_threads(cfg.scaling.torch_threads)
        if device.type == "cuda":  # (train.tf32, as the loop sets it)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.train.tf32
        task = self.task_class(cfg, SimpleNamespace(train=[], val=[], stats={}, **self.vocab))
        model = task.starting_model().to(device).eval()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

        def score(stored: np.ndarray) -> list[np.ndarray]:
            blocks = torch.from_numpy(stored).to(device)
            with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                chosen, rejected = sequence_logps(task._logits(model, blocks), blocks)
            pairs = torch.stack([chosen, rejected], dim=1).float().cpu().numpy()
            if not np.isfinite(pairs).all():
                raise DataError("the DPO reference's log-probabilities are not finite (NaN or Inf) for some pairs: "
                                "the starting weights or the run's precision cannot score them; train.precision "
                                "fp32, or check the model")
            ends = np.cumsum(pairs_per_row(blocks).cpu().numpy())
            return [p.reshape(-1) for p in np.split(pairs, ends[:-1])]

        return score


def reference_identity(cfg: JobConfig, index) -> dict:
    """What the precomputed reference depends on: the token cache, the model as built (its config, the seed),
    train.init_from's folder and its files (names, sizes, modification times, a URI's folder's as listed: a
    folder rewritten in place changes it), the precision and the device kind."""
    source = cfg.train.init_from
    files = Store(source).file_stamps() if source else None
    return {"version": REFERENCE_VERSION, "tokens": index.stats["cache"], "model": cfg.model.name,
            "pretrained": cfg.model.pretrained, "hf_config": cfg.model.hf_config, "seed": cfg.train.seed,
            "init_from": source, "init_from_files": files, "precision": cfg.train.precision,
            "dtype": cfg.model.dtype, "tf32": cfg.train.tf32, "gpu": cfg.scaling.use_gpu}


def reference_folder(identity: dict, index) -> str:
    """Where the reference of this identity is kept: beside the token cache, under its fingerprint."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{index.stats['cache']}/reference-{key}"


def precompute_reference(task_class, cfg: JobConfig, index) -> tuple[dict, bool]:
    """The reference's table per split as the workers read it, {folder, train: {file, sha256}, val: {...}}, and
    whether it was computed now (a Ray Data pass, written) rather than found. Needs Ray."""
    from behemoth.data.chat.block_scores import score_blocks

    if cfg.train.init_from:  # (a run folder as its chosen checkpoint, as the run resolves it: a sweep's
        # preparation comes before any trial's run resolves it)
        import dataclasses

        from behemoth.storage import weights

        chosen, _ = weights.resolve(cfg.train.init_from, cfg.train.init_from_checkpoint,
                                    task_class.best, task_class.reported)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=chosen))
    identity = reference_identity(cfg, index)
    folder = reference_folder(identity, index)
    try:
        found = Store(f"{folder}/meta.json").read_bytes()
    except FileNotFoundError:
        found = None
    if found is not None:
        return {**_found_files(folder, found), "folder": folder}, False
    workers = cfg.scaling.min_workers
    per_worker = cfg.train.global_batch_size // workers  # (the run's micro-batch: the pass holds whole logits too)
    micro = cfg.train.micro_batch_size
    batch = micro if isinstance(micro, int) else max(1, per_worker // cfg.train.grad_accum_steps)
    files = {}
    with Store(folder).built_here("behemoth-reference-", last="meta.json") as local:
        local.mkdir(parents=True, exist_ok=True)
        for split in ("train", "val"):
            scores = score_blocks(getattr(index, split), ReferenceScorer(task_class, cfg, index.vocab_size, index.eos_id,
                                                                         index.bos_id),
                                  width=cfg.data.seq_len // 2, actors=workers, batch_size=batch,
                                  num_gpus=1.0 if cfg.scaling.use_gpu else 0.0,
                                  num_cpus=cfg.scaling.cpus_per_worker)
            buffer = io.BytesIO()
            np.savez(buffer, offsets=np.cumsum([0] + [len(s) for s in scores]).astype(np.int64),
                     logps=np.concatenate(scores) if scores else np.empty(0, np.float32))
            data = buffer.getvalue()
            (local / f"{split}.npz").write_bytes(data)
            files[split] = {"file": f"{split}.npz", "sha256": hashlib.sha256(data).hexdigest()}
        (local / "meta.json").write_text(json.dumps({"identity": identity, "files": files}, default=str))
    return {**files, "folder": folder}, True


def _found_files(folder: str, raw: bytes) -> dict:
    """The {train, val} table a found meta.json records, each file one plain name inside `folder`: the workers
    read f"{folder}/{file}", so a name with a '/' or '..' (or a key that is not a split, "folder" among them)
    would read a file outside the reference; else DataError, the reference damaged."""
    try:
        files = json.loads(raw)["files"]
        ok = isinstance(files, dict) and set(files) == {"train", "val"} and all(
            isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and is_inside(entry.get("file"))
            and "/" not in entry["file"] for entry in files.values())
    except (ValueError, TypeError, KeyError):  # (not JSON, or not an object holding "files")
        ok = False
    if not ok:
        raise DataError(f"{folder}/meta.json is not a DPO reference's table (train and val, each one file named "
                        f"plainly inside its folder, and its sha256): the reference is damaged; delete {folder} "
                        f"and rerun to compute it again")
    return {split: {"file": entry["file"], "sha256": entry["sha256"]} for split, entry in files.items()}
