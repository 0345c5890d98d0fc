"""Driver side: `behemoth eval` — a checkpoint's model through the task's evaluation, with the job's Ray Data
preprocessing, worker count and batch size (the same numbers as the run's own evaluation), on Ray Train.

The metrics are printed and written as JSON next to the checkpoint: CHECKPOINT.eval_SPLIT.json.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

from behemoth.storage import weights
from behemoth.config import JobConfig
from behemoth.errors import ConfigError
from behemoth.tasks import task_of
from behemoth.tracking.records import write_text


def eval_batch_size(cfg: JobConfig, world: int) -> int:
    """The per-worker batch the run evaluated with: its micro-batch (auto: the plan without a search)."""
    if isinstance(cfg.train.micro_batch_size, int):
        return cfg.train.micro_batch_size
    return cfg.train.global_batch_size // (world * cfg.train.grad_accum_steps)


def evaluate_checkpoint(cfg: JobConfig, checkpoint: str, split: str = "val", which: str = "best") -> tuple[dict, str]:
    """(metrics, the JSON file written). `checkpoint`: a checkpoint folder, a run folder (its best or latest
    checkpoint, `which`) or a Hugging Face folder whose weights fit the job's model. The run sequence's steps
    (driver/run/sequence.py) up to its launch: the task resolved once, the data checked and prepared as a run's
    (an epoch's steps aside: nothing trains), then a TorchTrainer of the evaluation's workers."""
    import ray

    from behemoth.driver.run.resume import task_files_differ
    from behemoth.driver.run.sequence import prepare_data
    from behemoth.driver.run.trainer import torch_trainer
    from behemoth.worker.evaluate import evaluate_checkpoint_per_worker

    task = task_of(cfg)
    ckpt, how = weights.resolve(checkpoint, which, task.best, task.reported)
    weights.check(ckpt)  # damage it can see without the weights fails here, before Ray starts
    data = prepare_data(cfg, epoch=False, task=task)
    differs = task_files_differ(cfg, data, ckpt)
    if differs:  # its class indices would be scored against other names: a wrong accuracy, without a word
        raise ConfigError(f"checkpoint {ckpt} was trained on other data than this job's: {differs[0]}. Evaluate "
                          f"it with the data it was trained on (the job.yaml beside its weights)")
    world = cfg.scaling.max_workers
    print(f"[behemoth] evaluating {ckpt} ({how}) on the {split} split: {world} workers, batch "
          f"{eval_batch_size(cfg, world)} per worker", flush=True)
    storage = tempfile.mkdtemp(prefix="behemoth-eval-")  # Ray Train's bookkeeping only: nothing to keep
    try:
        result = torch_trainer(cfg, evaluate_checkpoint_per_worker, {
            "job": cfg, "data_ref": ray.put(data), "checkpoint": ckpt, "split": split,
            "batch_size": eval_batch_size(cfg, world)}, dict(name=f"eval-{int(time.time())}", storage_path=storage),
            num_workers=world).fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    metrics = result.return_value
    if split != "val":  # the task names its metrics for the validation split
        metrics = {k.replace("val_", f"{split}_", 1) if k.startswith("val_") else k: v for k, v in metrics.items()}
    out = f"{ckpt.rstrip('/')}.eval_{split}.json"  # beside the checkpoint folder, local or under a URI
    write_text(out, json.dumps({"checkpoint": ckpt, "split": split, "workers": world, "metrics": metrics}, indent=1))
    return metrics, out
