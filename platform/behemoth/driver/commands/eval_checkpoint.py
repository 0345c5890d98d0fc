"""`behemoth eval JOB.yaml --checkpoint ...`: a checkpoint evaluated with the job's data pipeline and workers."""

from __future__ import annotations

from behemoth.driver.commands.args import add_config_args


def add_command(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint with the job's data pipeline and workers; print the "
                       "metrics and write them as JSON next to the checkpoint")
    add_config_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder, a run folder (its best checkpoint; "
                   "--latest: its latest) or a Hugging Face folder whose weights fit the job's model; local or a URI "
                   "(s3://...)")
    p.add_argument("--split", choices=["val", "train"], default="val", help="what to evaluate (train: the "
                   "training samples without augmentation)")
    p.add_argument("--latest", action="store_true", help="a run folder's latest checkpoint instead of its best")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from behemoth.driver.run.evaluation import evaluate_checkpoint
    from behemoth.job import load_config

    cfg = load_config(args.config, args.overrides)
    metrics, written = evaluate_checkpoint(cfg, args.checkpoint, args.split, "latest" if args.latest else "best")
    print("\n".join(["[behemoth] evaluation finished", *[f"  {k}: {v}" for k, v in metrics.items()],
                     f"  written to {written}"]))
    return 0
