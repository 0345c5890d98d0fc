"""The checkpoints room: taking a run's state into a checkpoint and continuing from one, on the worker side.

Its face is what the loop (worker/loop.py, worker/reporting.py) talks to, and nothing behind it:

- `Trainables`: the run's objects a checkpoint holds (model, optimizer, scheduler, scaler, compression state, EMA).
- save: `CheckpointSaver(cfg, rank, task_files).save_and_report(metrics, state, run)` (synchronously, or with
  only a snapshot in the step's way; the manifest last), and `send_report(metrics)` for a report without one;
  `Rescue(cfg, run, state, ...)`: the loop's rescue checkpoint (told of each update through the saver, of an
  error and of the loop's end by `around_the_loop`); `why_no_rescue(cfg, run, rank)`: why a rank could not
  write one (None: it could; checkpoint.every_n_steps auto stretches the interval where every rank could).
- `MemoryCopy(link, run)`: a lone worker's copies of its state to the driver's memory (checkpoint.memory_copy;
  when: worker/memory_copies.py), restored by `restore_latest(run, copies=link)` where newer than the checkpoint.
- restore: `restore_latest(run)` (the checkpoint a (re)started worker group continues from: the newest that
  verifies, partial uploads removed) and `load_init_from(model, cfg, task, rank, world)` (train.init_from's weights).
- latest: `complete_checkpoints(folder)` (a run folder's complete checkpoints by step; which are kept:
  `retention`, below).
- verify: `verify(folder)` (every file against the manifest's sizes and checksums).

Its modules:

- `trainables`: Trainables, the objects one run trains with, held together.
- `live_state`: live objects <-> host snapshot <-> checkpoint folder (either layout and strategy).
- `saver`: checkpoints through the host's report, sync or async; host buffers; manifest last.
- `sharded`: sharded checkpoints: each rank's DCP shards, the manifest over all by rank 0.
- `restore`: which checkpoint a (re)started worker group continues from; init_from's weights.
- `rescue`: the rescue checkpoint, a live worker's state when its group is stopped under it (a peer lost
  without notice, an elastic resize).
- `memory_copy`: a lone worker's state copied to the run's keeper in the driver's memory (hosts/state_keeper.py),
  and loaded back.
- `retention`: which checkpoints checkpoint.keep keeps (the rule Ray Train's CheckpointConfig applies for a
  TorchTrainer's run, and a sweep's lane itself), and the removal, when a run ends, of complete checkpoints Ray
  Train never registered (the driver's: behind the face).

The format itself stays on the floor in storage/ (`storage/checkpoint.py`: files, TrainState, manifest,
complete_checkpoints, verify; `storage/shard_reader.py`, `storage/dcp_index.py`): the driver (resume checks,
retention, export, eval), tracking and the tasks read checkpoints too and must not import the worker-side
room that writes them. This room builds on that format and on hosts/ (the report, the run's storage, the
collectives); it needs the model, the process group and the step, which storage/ does not.
"""

from behemoth.checkpoints.memory_copy import MemoryCopy
from behemoth.checkpoints.rescue import Rescue
from behemoth.checkpoints.rescue import why_not as why_no_rescue
from behemoth.checkpoints.restore import load_init_from, restore_latest
from behemoth.checkpoints.saver import CheckpointSaver, send_report
from behemoth.checkpoints.trainables import Trainables
from behemoth.storage.checkpoint import complete_checkpoints, verify

__all__ = ["CheckpointSaver", "MemoryCopy", "Rescue", "Trainables", "complete_checkpoints", "load_init_from", "restore_latest",
           "send_report", "verify", "why_no_rescue"]
