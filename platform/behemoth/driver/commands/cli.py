"""`behemoth train|tune|eval|export|generate|report|check|check-cluster|check-nodes|spot-watch|data ...`: the
command line, a table. Each command's module adds its parser (`add_command(sub)`, setting the handler its
arguments run) and holds that handler; the arguments several take are in args.py. Here: the table, and how a
command's error ends the process (2: a config error or bad arguments; 1: a data error, a damaged checkpoint or a
failed run; one line says which)."""

from __future__ import annotations

import argparse
import sys

from behemoth.driver.commands import (check, cluster_check, data_tools, eval_checkpoint, export, generate, node_check,
                                      report, spot_watch, train, tune)
from behemoth.errors import ConfigError, user_facing_error
from behemoth.version import __version__

# `behemoth --help` lists them in this order
COMMANDS = (train, tune, eval_checkpoint, export, generate, report, check, cluster_check, node_check, spot_watch,
            data_tools)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="behemoth", description="Fault-tolerant distributed training on Ray (Ray Data + Ray Train: DDP or FSDP).",
        epilog="Exit status: 0 success; 1 a data error, a damaged checkpoint, a file the system refused or a failed "
               "run (one line says which); 2 a config error or bad arguments. Also: python -m behemoth ...")
    parser.add_argument("--version", action="version", version=f"behemoth {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as e:
        print(f"behemoth: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # data errors and training failures: one clear line, then the exit code
        message = user_facing_error(e) or _file_error(e)
        if message is None:
            raise
        print(f"behemoth: error: {message}", file=sys.stderr)
        return 1


def _file_error(e: BaseException) -> str | None:
    """A file the command was pointed at that the system refused (missing, a file where a folder goes, no
    permission), said as the system says it with the path, where no check before it caught the case; None for
    anything else (a traceback: a bug to see whole)."""
    if not isinstance(e, OSError) or e.filename is None or e.strerror is None:
        return None
    return f"{e.strerror}: {e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")


def run(argv: list[str] | None = None) -> None:
    """The `behemoth` command and `python -m behemoth`: main(), then the process ends at once."""
    exit_at_once(main(argv))


def run_command(argv: list[str]) -> None:
    """`behemoth.cli(argv)`: the `behemoth` command with these arguments, in this process (jobs/*.py under
    `ray job submit`), which then ends with its status (2: a config error, 1: a data or run failure)."""
    if isinstance(argv, (str, bytes)):  # (list("train x") is one argument per character)
        raise ConfigError(f"behemoth.cli takes the arguments as a list, e.g. {str(argv).split()!r}, got a string")
    run(list(argv))


def exit_at_once(status: int) -> None:
    """End this process with `status` once everything written is out: streams flushed, the atexit handlers run
    (behemoth's console, logging's, Ray's shutdown). What it skips is the interpreter's own teardown, which
    with Ray's, torch's and gloo's native libraries loaded takes seconds after the last handler, with no
    Python frame left to run and nothing written: a wait for nothing at every run's end."""
    import atexit
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run()
