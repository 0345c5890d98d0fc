"""`behemoth report FOLDER`: a run's (or a sweep's) report written again."""

from __future__ import annotations


def add_command(sub) -> None:
    p = sub.add_parser("report", help="write a run's (or a sweep's) report: FOLDER/report/report.html with its "
                       "plots embedded, and the PNGs (`behemoth train` writes it at the end of every run)")
    p.add_argument("folder", help="a run folder (STORAGE_PATH/RUN_NAME) or a sweep folder (with results.csv)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from behemoth.tracking.run_report import write_report

    print(f"[behemoth] report: {write_report(args.folder)}")
    return 0
