"""The sweep room (driver side): a job's keys swept with Ray Tune, each trial a behemoth training run.

  tuner.py    the sweep: its checks, Ray Tune's Tuner, resuming a killed sweep, the sweep's tracking
  config.py   the sweep YAML's schema, the trials' job configs, the checks before Ray, which trials train in a
              lane, one trial's resources
  trial.py    one trial in its Tune actor: in a warm lane (one worker) or through a TorchTrainer (several)
  lane.py     the warm lane: a one-worker trial trained in its Tune actor, reused from trial to trial
  reaper.py   frees the placement groups a stopped trial's Ray Train controller leaves behind
  results.py  results.csv (a row per trial, best first) and best.yaml
  process_state.py the global state a lane puts back before every trial, as a fresh worker has it

Python API: `behemoth.sweep(job, space, ...)` (this package's `sweep`), `run_sweep(load_sweep(path))`.
"""

from behemoth.driver.sweep.config import SweepConfig, load_sweep
from behemoth.driver.sweep.results import SweepResult
from behemoth.driver.sweep.tuner import run_sweep, sweep

__all__ = ["SweepConfig", "SweepResult", "load_sweep", "run_sweep", "sweep"]
