"""`behemoth tune SWEEP.yaml`: a sweep of a job's keys with Ray Tune; its table and best trial printed."""

from __future__ import annotations


def add_command(sub) -> None:
    p = sub.add_parser("tune", help="sweep a job's keys (batch size, learning rate, ...) with Ray Tune; rerun "
                       "the same sweep name to resume it")
    p.add_argument("sweep", help="sweep YAML, e.g. jobs/configs/sweep_demo.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a sweep key, e.g. --set name=lr2, or a job key for every trial, e.g. --set "
                   "data.root=/abs/path (repeatable)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    import pandas as pd

    from behemoth.driver.sweep.config import load_sweep
    from behemoth.driver.sweep.tuner import run_sweep

    result = run_sweep(load_sweep(args.sweep, args.overrides))
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
        print(result.table.drop(columns=["run_dir"]).to_string(index=False))
    print("\n".join([
        f"[behemoth] sweep finished: best {result.metric} {result.best_value:.4f} with "
        + ", ".join(f"{k}={v}" for k, v in result.best_params.items()),
        f"  results:         {result.results_csv}",
        f"  best job config: {result.best_yaml}   (behemoth train {result.best_yaml})",
        f"  best checkpoint: {result.best_checkpoint}"]))
    return 0
