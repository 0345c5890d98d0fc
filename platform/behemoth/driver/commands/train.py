"""`behemoth train JOB.yaml`: train (or resume) a job on Ray; the run's summary printed."""

from __future__ import annotations

from behemoth.driver.commands.args import add_config_args


def add_command(sub) -> None:
    p = sub.add_parser("train", help="train (or resume, same checkpoint.run_name) a job on Ray")
    add_config_args(p)
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from behemoth.driver.run.trainer import train
    from behemoth.job import load_config
    from behemoth.tracking.invocation import process_start

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, process_start=process_start(), end_ray=True)
    print("\n".join(["[behemoth] run finished"] + [f"  {line}" for line in summary.lines()]))
    return 0
