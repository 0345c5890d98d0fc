"""The decode-process warm-up (driver/ray_cluster/warmup.py) on and off, alternating, in one sitting.

    .venv/bin/python bench/warmup_ab.py first-step [--pairs 3]   # whole `behemoth train` processes of the demo
    .venv/bin/python bench/warmup_ab.py steady [--runs 8]        # P2's job in this process, back to back

`first-step`: the demo job (8 epochs) as whole processes, one with behemoth as it is and one with
`warm_up_data_processes` replaced by a no-op, alternating; prints each run's wall time and time from launch to
the end of the first step (rank 0's clock), then the medians. `steady`: P2's job (bench/ingest_vs_dataloader.py:
1 worker, 60 steps, batch 64) through `train` in this process, on and off alternating, with images/s over the
measured span and the whole machine's CPU per image (/proc/stat): the warm-up must not cost the steady state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import MachineCpu, REPO, read_metrics, steady_steps_per_s
from ingest_vs_dataloader import behemoth_job
from vs_ray_train import run_behemoth

# `python -c` with behemoth's command line after it, the warm-up replaced by a no-op
WITHOUT = ("-c", "import sys; from behemoth.driver import ray_session, cli; "
                 "ray_session.warm_up_data_processes = lambda cfg, data: []; sys.exit(cli.main(sys.argv[1:]))")


def first_step(pairs: int) -> None:
    runs = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-warmup-") as storage:
        for i in range(pairs):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                entry = ("-m", "behemoth") if mode == "on" else WITHOUT
                r = run_behemoth(8, storage, f"{mode}{i}", entry)
                runs[mode].append(r)
                print(f"warm-up {mode:3s} run {i}: wall {r['wall']:.1f} s, first step after {r['first_step']:.1f} s",
                      flush=True)
    for mode, rs in runs.items():
        print(f"median, warm-up {mode:3s}: wall {statistics.median(r['wall'] for r in rs):.1f} s, first step after "
              f"{statistics.median(r['first_step'] for r in rs):.1f} s "
              f"(min {min(r['first_step'] for r in rs):.1f}, max {max(r['first_step'] for r in rs):.1f})")


def steady(runs: int) -> None:
    from behemoth.job import config_from_dict
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import trainer
    warm_up = ray_session.warm_up_data_processes
    meter, seen = MachineCpu(), {"on": [], "off": []}
    storage = Path(tempfile.mkdtemp(prefix="bench-warmup-"))
    for i in range(runs):
        mode = "on" if i % 2 else "off"
        ray_session.warm_up_data_processes = warm_up if mode == "on" else (lambda cfg, data: [])
        summary = trainer.train(config_from_dict(behemoth_job(REPO / "data" / "demo_images", storage, f"r{i}",
                                                              64, 60, 10)))
        reports = [m for m in read_metrics(Path(summary.run_dir)) if "samples_per_s" in m]
        images = (reports[-1]["step"] - reports[0]["step"]) * 64
        rate = steady_steps_per_s(reports, 64) * 64
        ms = meter.seconds(reports[0]["wall_time"], reports[-1]["wall_time"]) / images * 1e3
        seen[mode].append((rate, ms))
        print(f"warm-up {mode:3s} run {i}: {rate:.0f} images/s, {ms:.2f} ms CPU per image", flush=True)
    meter.stop()
    for mode, xs in seen.items():
        print(f"warm-up {mode:3s}: {min(r for r, _ in xs):.0f}-{max(r for r, _ in xs):.0f} images/s, "
              f"{min(m for _, m in xs):.2f}-{max(m for _, m in xs):.2f} ms CPU per image")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["first-step", "steady"])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--runs", type=int, default=8)
    args = p.parse_args()
    if not (REPO / "data" / "demo_images" / "train").is_dir():
        sys.exit("make the demo images first: ./run.sh demo (or behemoth data synth-images --out data/demo_images)")
    first_step(args.pairs) if args.what == "first-step" else steady(args.runs)


if __name__ == "__main__":
    main()
