"""Restoring a run: every rank continues from the same checkpoint."""

import json
import shutil
import socket
import tempfile
from pathlib import Path

import torch

from behemoth.storage.checkpoint import TrainState
from behemoth.checkpoints import live_state


def _restore_rank(rank: int, port: int, root: str) -> None:
    """One of 2 gloo ranks, each a node of its own (its own temp folder, so its own node copies), restoring
    from an object store (a pyarrow filesystem that is not the local one: restore downloads per node) through
    restore_first_verified; writes the step each scenario restored to root/rank{rank}.json.
    "damaged": this rank's view of the store is root/store{rank} (rank 1's newest checkpoint has a changed
    byte in model.pt); "unlisted": the same store for both, but rank 1's listing lacks the newest checkpoint."""
    import datetime
    import os

    import pyarrow.fs
    import ray.train
    import torch.distributed as dist

    from behemoth.checkpoints.restore import restore_first_verified
    from behemoth.checkpoints.trainables import Trainables

    tempfile.tempdir = f"{root}/node{rank}"
    os.makedirs(tempfile.tempdir)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a rank left waiting fails, not hangs
    seen = {}
    for scenario, store, listed in (("damaged", f"store{rank}", (2, 1)),
                                    ("unlisted", "store0", (2, 1) if rank == 0 else (1,))):
        fs = pyarrow.fs.SubTreeFileSystem(f"{root}/{store}", pyarrow.fs.LocalFileSystem())
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = Trainables(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), scaler=None)
        state, _ = restore_first_verified([ray.train.Checkpoint(f"run/checkpoint_{s}", filesystem=fs)
                                           for s in listed], run, fs, rank == 0)
        seen[scenario] = {"step": state.step, "weight": model.weight.sum().item()}
    Path(root, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_every_rank_restores_the_same_checkpoint_when_one_nodes_copy_fails_verification(tmp_path):
    """Two real gloo processes, each a node restoring a full (DDP) checkpoint from a store. Rank 1's copy of
    the newest checkpoint (2) does not match its manifest, rank 0's does: both restore checkpoint 1 (each rank
    checking its own copy alone, rank 0 took 2 and rank 1 took 1: the replicas diverge silently, and a later
    collective hangs). Where rank 1's listing of the run folder lacks checkpoint 2 (a shared mount's stale
    listing), both restore 2: the ranks try rank 0's list of candidates, in step."""
    import torch.multiprocessing as mp

    weights = {}
    for s in (1, 2):
        torch.manual_seed(s)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        live_state.save(tmp_path / "store0" / "run" / f"checkpoint_{s}", model=model, optimizer=opt,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                           state=TrainState(step=s), task_files={}, job_yaml="")
        weights[s] = model.weight.sum().item()
    shutil.copytree(tmp_path / "store0", tmp_path / "store1")
    damaged = tmp_path / "store1" / "run" / "checkpoint_2" / "model.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1  # same size, other bytes: only the hash tells
    damaged.write_bytes(bytes(data))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_restore_rank, args=(port, str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["damaged"]["step"] for r in seen] == [1, 1], seen
    assert [r["damaged"]["weight"] for r in seen] == [weights[1]] * 2
    assert [r["unlisted"]["step"] for r in seen] == [2, 2], seen
    assert [r["unlisted"]["weight"] for r in seen] == [weights[2]] * 2
