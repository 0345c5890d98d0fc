"""Weights & Biases tracking (tracking.wandb.project): one W&B run per behemoth run, continued by every resume.

The driver picks the run's id once and keeps it in RUN_FOLDER/wandb.json; Ray Train's controller (or a sweep
lane's recorder) opens that run (`resume="allow"`) and logs every report's curves, the same names as
TensorBoard's and MLflow's (train/loss, train/grad_norm, val/accuracy, speed/samples_per_s, ...), with its step.
W&B keeps a run's steps increasing: steps trained again after a restart from a checkpoint are not logged twice
(their first values stay; TensorBoard's curves show the retrained ones). `mode: offline` writes the run under
the run folder's wandb/ (a local run folder; else ~/.cache/behemoth/wandb) for `wandb sync` later, and needs
no network. W&B's own console capture and system-metrics sampling stay off: behemoth's lines and speed figures
are the run's. A failure is reported once, then W&B tracking stops; training goes on.
"""

from __future__ import annotations

import json
import os
import uuid

from behemoth.errors import ConfigError
from behemoth.storage import paths
from behemoth.storage.store import Store
from behemoth.tracking.records import read_text, write_text

RUN_FILE = "wandb.json"


def check_installed() -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("tracking.wandb.project is set but wandb is not installed: pip install 'behemoth[wandb]' "
                          "(or unset tracking.wandb.project)") from None


def run_id(run_dir: str) -> str:
    """The W&B run id of this behemoth run: the one recorded in the run folder (a resume), else a new one."""
    record = paths.join(run_dir, RUN_FILE)
    text = read_text(record)
    if text:
        return json.loads(text)["id"]
    new = uuid.uuid4().hex[:12]
    write_text(record, json.dumps({"id": new}))
    return new


def local_dir(run_dir: str) -> str:
    """Where W&B writes its files: the run folder where it is local, else a cache folder of this machine."""
    if Store(run_dir).is_local:
        return run_dir
    folder = os.path.expanduser("~/.cache/behemoth/wandb")
    os.makedirs(folder, exist_ok=True)
    return folder


class WandbMetrics:
    """The run's W&B run, opened at its first report (in Ray Train's controller), closed with the recorder."""

    def __init__(self, target: dict):
        """`target`: project, entity, mode, id, name, dir, config (the job as a nested mapping)."""
        self.target, self.run, self.last_step = target, None, -1

    def log(self, values: dict[str, float], step: int) -> None:
        if step <= self.last_step:
            return
        if self.run is None:
            self.run = self._open()
        self.run.log(values, step=step)
        self.last_step = step

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ended in an error (W&B shows it failed, as MLflow does), not finished."""
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
            _wait_for_the_files()

    def _open(self):
        import wandb

        t = self.target
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False,
                                  disable_git=True)
        return wandb.init(project=t["project"], entity=t["entity"], id=t["id"], name=t["name"], mode=t["mode"],
                          dir=t["dir"], config=t["config"], resume="allow", reinit="create_new", settings=settings)


def _wait_for_the_files() -> None:
    """`finish()` returns before W&B's service has written the run's files: the service writes a run's
    transaction log (the .wandb file `wandb sync` reads) when it closes the run's stream, which `finish()` only
    asks for (a live offline run's .wandb file holds its 7-byte header alone). A Ray Train controller may be
    ended right after the recorder closes, taking the service and the unwritten run with it. Where no other W&B
    run is open in this process, `wandb.teardown()` waits until the service has closed every stream (the next
    `wandb.init` starts a new one); where one is, its own finish or the process's exit waits instead."""
    import wandb

    if wandb.setup().most_recent_active_run is None:
        wandb.teardown()
