"""Worker side: train.profile, a window of steps recorded by torch.profiler (and, on a GPU, CUDA's memory
history) into the run folder's profile/ folder, one file per rank: `rankR.steps-A-B.pt.trace.json` (Chrome trace
format: Perfetto's ui.perfetto.dev or chrome://tracing open it, TensorBoard's trace viewer too) and
`rankR.steps-A-B.memory.pickle` (pytorch.org/memory_viz). The report links them.

The window is steps start_step + 1 .. start_step + steps of the run (a resumed run records it only if it has
not trained past its start). Recording costs time: the window's steps are slower, and say so in their reports
only through their speed.
"""

from __future__ import annotations

import os
import tempfile

import torch

from behemoth import hosts
from behemoth.storage.checkpoint import TrainState
from behemoth.hosts.console import console
from behemoth.worker.step_callbacks import Callback

FOLDER = "profile"


class StepProfiler(Callback):
    def __init__(self, cfg, rank: int, device: torch.device):
        self.rule, self.rank, self.device = cfg.train.profile, rank, device
        self.profiler = None
        self.step_range = None  # the step being recorded, as a range in the trace

    def before_step(self, ctx, state: TrainState) -> None:
        """Start recording where the next step is the window's first; each step recorded is a range named
        ProfilerStep#N (N: the run's step, counted from 1), as torch's own step marks are named (Perfetto, HTA)."""
        if self.rule is not None and self.profiler is None and state.step == self.rule.start_step:
            self._start()
        if self.profiler is not None:
            self.step_range = torch.profiler.record_function(f"ProfilerStep#{state.step + 1}")
            self.step_range.__enter__()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.__enter__()

    def after_step(self, ctx, state: TrainState) -> None:
        """Stop and write the files once the window's last step is done."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.profiler is None or state.step < self.rule.start_step + self.rule.steps:
            return
        self.profiler.__exit__(None, None, None)
        name = f"rank{self.rank}.steps-{self.rule.start_step + 1}-{state.step}"
        with tempfile.TemporaryDirectory(prefix="behemoth-profile-") as tmp:
            files = {f"{name}.pt.trace.json": os.path.join(tmp, "trace.json")}
            self.profiler.export_chrome_trace(files[f"{name}.pt.trace.json"])
            if self.device.type == "cuda":
                files[f"{name}.memory.pickle"] = os.path.join(tmp, "memory.pickle")
                torch.cuda.memory._dump_snapshot(files[f"{name}.memory.pickle"])
                torch.cuda.memory._record_memory_history(enabled=None)
            written = _store(files)
        self.profiler = None
        if self.rank == 0:
            console(f"profile of steps {self.rule.start_step + 1}-{state.step}: {', '.join(written)} (every rank's "
                    f"beside it; open a .pt.trace.json in ui.perfetto.dev)")


def _store(files: dict[str, str]) -> list[str]:
    """Copy the local files into the run folder's profile/ (local or a URI); their places there."""
    fs, run_path = hosts.current().storage()
    folder = f"{run_path.rstrip('/')}/{FOLDER}"
    fs.create_dir(folder, recursive=True)
    placed = []
    for name, local in files.items():
        with open(local, "rb") as src, fs.open_output_stream(f"{folder}/{name}") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        placed.append(f"{folder}/{name}")
    return placed
