"""Worker side: the sample ledger (train.sample_ledger), an audit trail of what each step trained on."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from behemoth import hosts
from behemoth.storage.checkpoint import TrainState
from behemoth.hosts.collectives import distributed
from behemoth.worker.step_callbacks import Callback


class SampleLedger(Callback):
    """Appends {"step", "epoch", "rank", "world", "group", "node", "pid", "time", "ids", "loss_sum", "samples"}
    per trained step to FOLDER/rank<r>.jsonl (loss_sum: this rank's loss summed over its samples of the step;
    time: the wall clock when the step's update was done, a clock of the audit's own, apart from the run's
    phase counters).

    An audit trail of the data order (train.sample_ledger). `ids` are the `sample_id`s of the batches the
    step actually trained on, as the data pipeline delivered them (not the slice of the planned order it
    asked for): an image row's id travels with it through Ray Data, a text block's is stored with its tokens
    and read back by the same gather (data/token_store.py). An audit against the planned order thus catches
    a pipeline that skips, repeats or reorders samples, a gather that reads the wrong rows, and a wrong
    resume position. `group` names the worker group (rank 0's pid and
    start time, the same on every rank): after a failure or a resize, the steps that were redone appear
    under two groups, and for each step the records of the last group that trained it are what the final
    weights were trained on.
    """

    def __init__(self, folder: str | None, rank: int, world: int):
        self.file = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{rank}.jsonl")
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115
            if _ends_mid_line(path):  # the last writer was killed mid-record: start our records on a new line
                self.file.write("\n")
        self.rank, self.world = rank, world
        self.node = hosts.current().node_id()
        group = [f"{os.getpid()}-{time.time():.3f}"]
        if folder and distributed():
            dist.broadcast_object_list(group, src=0)
        self.group = group[0]

    def after_update(self, ctx, state: TrainState, micro_batches: list[dict], loss_sum, n_valid) -> None:
        self.record(state, micro_batches, loss_sum, n_valid)  # (an audit: it reads them on the host)

    def record(self, state: TrainState, micro_batches: list[dict], loss_sum, samples) -> None:
        if self.file is not None:
            ids = torch.cat([batch["sample_id"].reshape(-1).cpu() for batch in micro_batches]).tolist()
            line = {"step": state.step + 1, "epoch": state.epoch, "rank": self.rank, "world": self.world,
                    "group": self.group, "node": self.node, "pid": os.getpid(), "time": time.time(), "ids": ids,
                    "loss_sum": float(loss_sum), "samples": float(samples)}
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()


def _ends_mid_line(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
