"""What Ray Train's per-run processes cost a short run, and what behemoth's lean trainer saves (issue 49, item 4).

Ray Train 2.60 starts, for every TorchTrainer run: a TrainController actor, a SynchronizationActor, a
PlacementGroupCleaner, a DatasetManager (whatever the trainer's datasets) and the workers (a PreemptionWatcher
too, off on behemoth's local instance). behemoth's trainer (ray_session.torch_trainer) leaves the DatasetManager
out: it passes no dataset to the trainer. This bench runs the same tiny 2-worker job (the demo images, 2 steps)
through both, alternating, in one local Ray (as a sweep's trials share one), and prints per run: its wall time,
the whole machine's CPU-seconds during it, and the Ray Train actors it started; then where the last lean
run's time went, from its timeline.jsonl (BENCHMARKS.md, "Where a tiny fit's time goes").

    .venv/bin/python bench/ray_train_processes.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

from _common import MachineCpu, spread

REPO = Path(__file__).resolve().parents[1]


def run(cfg, lean: bool) -> tuple[float, float, dict]:
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import trainer
    from ray.util.state import list_actors

    plain = ray_session.torch_trainer
    if not lean:  # Ray Train's own TorchTrainer, every default callback
        from ray.train.torch import TorchTrainer

        ray_session.torch_trainer = TorchTrainer
    before = {a.actor_id for a in list_actors(limit=10_000, raise_on_missing_output=False)}
    try:
        t0 = time.time()
        trainer.train(cfg, lock=False)
        t1 = time.time()
    finally:
        ray_session.torch_trainer = plain
    started = [a for a in list_actors(limit=10_000, raise_on_missing_output=False) if a.actor_id not in before]
    return t1 - t0, (t0, t1), collections.Counter(a.class_name for a in started)


# (label, the mark it starts at, the mark it ends at): the invocation's marks and the worker group's clock
_PHASES = (("Ray Train's controller up, our first callback run", "fit_called", "controller_start"),
           ("to the workers' processes", "controller_start", "mark_process"),
           ("the workers' start-up to the loop's first line", "mark_process", "mark_started"),
           ("the task and the model", "mark_started", "mark_model_built"),
           ("DDP's construction, restore, the data feed", "mark_model_built", "mark_restored"),
           ("the steps, the evaluation, the end", "mark_restored", "invocation_end"))


def phases(run_dir: Path) -> list[tuple[str, float]]:
    """Where a run's one invocation went, in seconds per phase, from its timeline.jsonl."""
    from behemoth.tracking.records import read_jsonl

    events = read_jsonl(str(run_dir / "timeline.jsonl"))
    start = next(e for e in events if e["event"] == "invocation_start")
    end = next(e for e in events if e["event"] == "invocation_end")
    at = {**start["marks"], "controller_start": next(e["time"] for e in events if e["event"] == "controller_start"),
          **{k: v for k, v in end["clock"].items() if k.startswith("mark_")}, "invocation_end": end["time"]}
    return [(label, at[b] - at[a]) for label, a, b in _PHASES]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from behemoth.driver.ray_cluster.session import ensure_ray
    from behemoth.job import load_config

    ensure_ray()
    cpu = MachineCpu()
    walls, cpus, actors = {True: [], False: []}, {True: [], False: []}, {}
    with tempfile.TemporaryDirectory(prefix="bench-train-processes-") as storage:
        for i in range(args.repeats):
            for lean in ((True, False) if i % 2 == 0 else (False, True)):
                cfg = load_config(REPO / "jobs/configs/demo_images.yaml", [
                    "train.max_steps=2", "eval.per_epoch=false", "tracking.report=false",
                    f"checkpoint.storage_path={storage}", f"checkpoint.run_name={'lean' if lean else 'plain'}{i}",
                    f"data.root={REPO / 'data/demo_images'}"])
                wall, (t0, t1), started = run(cfg, lean)
                time.sleep(2)  # the run's processes exit (their CPU would count in the next run)
                walls[lean].append(wall)
                cpus[lean].append(cpu.seconds(t0, t1 + 2))
                actors[lean] = started
                print(f"repeat {i} {'lean ' if lean else 'plain'}: wall {wall:.1f} s, machine CPU {cpus[lean][-1]:.1f} s, "
                      f"actors started {dict(started)}", flush=True)
        last = Path(storage, f"lean{args.repeats - 1}")
        print(f"  where the last lean run's {sum(s for _, s in phases(last)):.1f} s went:")
        for label, seconds in phases(last):
            print(f"    {label:52s} {seconds:5.1f} s")
    cpu.stop()
    for lean, name in ((False, "TorchTrainer as Ray Train makes it"), (True, "behemoth's (no DatasetManager)")):
        print(f"  {name:36s} wall {spread(walls[lean], '{:.1f}')} s; machine CPU {spread(cpus[lean], '{:.1f}')} s; "
              f"actors {dict(actors[lean])}")
    print(f"  ratio lean / plain: wall {statistics.median(walls[True]) / statistics.median(walls[False]):.3f}, CPU "
          f"{statistics.median(cpus[True]) / statistics.median(cpus[False]):.3f} (medians)")


if __name__ == "__main__":
    main()
