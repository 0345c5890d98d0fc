"""A training worker killed with SIGKILL mid-run: Ray Train restarts the group, behemoth resumes from the
latest checkpoint, and the run ends on exactly the weights of a run that never failed."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from behemoth.checkpoint import read_state
from behemoth.config import config_from_dict
from behemoth.trainer import train
from conftest import job_dict

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]
STEPS = 18


def _job(image_root, storage, name):
    return config_from_dict(job_dict(
        image_root, storage, name,
        train={"max_steps": STEPS, "epochs": 10, "warmup_steps": 3, "log_every": 5},
        checkpoint={"every_n_steps": 3, "keep": 3},
        failure={"max_failures": 1},
    ))


def _train_worker_pids() -> list[int]:
    """Processes Ray titles `ray::RayTrainWorker...` (the training workers), from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _kill_a_worker_after_checkpoint(run_dir: Path, min_step: int, timeout_s: float = 240) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        steps = [read_state(p).step for p in run_dir.glob("checkpoint_*") if (p / "manifest.json").is_file()]
        if steps and max(steps) >= min_step:
            pids = _train_worker_pids()
            if pids:
                os.kill(max(pids), signal.SIGKILL)
                return max(steps)
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint at step >= {min_step} in {run_dir} within {timeout_s} s")


def test_sigkilled_worker_resumes_from_latest_checkpoint_exactly(image_root, tmp_path):
    storage = tmp_path / "runs"
    result = {}
    runner = threading.Thread(target=lambda: result.update(summary=train(_job(image_root, storage, "killed"))))
    runner.start()
    checkpoint_step_at_kill = _kill_a_worker_after_checkpoint(storage / "killed", min_step=6)
    runner.join(timeout=400)
    assert not runner.is_alive()
    killed = result["summary"]
    assert killed.metrics["step"] == STEPS
    # The newest checkpoint on disk at the kill may not be registered with Ray Train yet (the worker is
    # killed between the upload and the report reaching the controller): the restore is from it or from
    # the one before, so at most one checkpoint interval (3 steps) beyond the steps since it is redone.
    assert checkpoint_step_at_kill - 3 <= killed.resumed_from_step < STEPS
    assert killed.resumed_from_step % 3 == 0 and killed.resumed_from_step > 0

    straight = train(_job(image_root, storage, "straight"))
    assert straight.resumed_from_step == 0
    a = torch.load(Path(killed.latest_checkpoint) / "model.pt")
    b = torch.load(Path(straight.latest_checkpoint) / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
