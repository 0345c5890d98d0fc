"""`behemoth check JOB.yaml` (or a sweep's YAML): the config and its data checked without starting Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from behemoth.config.load import load_yaml
from behemoth.driver.commands.args import add_config_args


def add_command(sub) -> None:
    p = sub.add_parser("check", help="validate a job config and its data without starting Ray; print it (a sweep "
                       "YAML: the sweep, every trial's job and each data)")
    add_config_args(p)
    p.set_defaults(handler=handle)


def handle(args) -> int:
    """The data checked, the config shown, what a joining node needs, the feed."""
    from behemoth.config import dump_yaml
    from behemoth.driver.commands.data_bench import feed_check
    from behemoth.job import load_config

    if _is_sweep(args.config):
        from behemoth.driver.sweep.config import check_sweep_file

        return check_sweep_file(args.config, args.overrides)
    cfg = load_config(args.config, args.overrides)
    checked = _check_data(cfg)  # (before the config is shown: a data error is then the one line printed)
    print(dump_yaml(cfg), end="")
    print(f"# data: {checked}")
    print(f"# nodes: {_node_paths_line(cfg)}")
    line, warning = feed_check(cfg)
    print(f"# feed: {line}")
    if warning:
        print(f"behemoth: warning: {warning}", file=sys.stderr)
    return 0


def _is_sweep(path: str) -> bool:
    """A sweep YAML (job: or space: at its top) rather than a job's."""
    try:
        raw = load_yaml(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # (the job loader says what is wrong with it)
    return isinstance(raw, dict) and ("job" in raw or "space" in raw)  # (the sweep's loader says what is missing)


def _node_paths_line(cfg) -> str:
    """What a node that joins later (a spot replacement) must hold itself: the job's local paths (object-store
    URIs and Hub names each node fetches)."""
    from behemoth.driver.commands.node_check import job_paths

    paths = job_paths(cfg)
    if not paths:
        return "a node that joins needs none of the job's paths on its disk (all in object storage or the Hub)"
    held = [f"{k} {v}" + (" (or the folder it is made in)" if k == "data.cache_dir" else "") for k, v in paths.items()]
    return (f"a node that joins must hold {', '.join(held)} (on its image or a shared filesystem; "
            f"`behemoth check-nodes` asks every node of a running cluster)")


def _check_data(cfg) -> str:
    """What the task can check without Ray (images: indexed; text: files, columns and the tokenizer), and what
    the preflight can (driver/run/preflight.py: model and tokenizer sources, init_from, an epoch's steps)."""
    from behemoth.driver.run.sequence import check_data
    from behemoth.tasks import task_of

    task = task_of(cfg)
    return task.describe(cfg, check_data(cfg, task))
