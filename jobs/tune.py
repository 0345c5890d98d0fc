"""Entry script for `ray job submit`: run (or resume) a Ray Tune sweep on the cluster the job runs in.

    ray job submit --working-dir . -- python jobs/tune.py --config jobs/configs/sweep_demo.yaml

Thin on purpose: all logic lives in the behemoth package (see behemoth.driver.sweep.tuner and behemoth.driver.commands.cli).
"""

import argparse
import sys
from pathlib import Path

# With `--working-dir .` the repository is the job's working directory; make the package importable
# without an install on the cluster (platform/ is a source root, never a package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

import behemoth  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="sweep YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a sweep key (name=...), or a job key for every trial (data.root=...)")
    args = parser.parse_args()
    behemoth.cli(["tune", args.config] + [f"--set={o}" for o in args.overrides])
