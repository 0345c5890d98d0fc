"""`behemoth check-nodes JOB.yaml`: on a running Ray cluster (RAY_ADDRESS, or the cluster `ray start` made on
this machine), whether every alive node sees the local paths the job names: its data (data.root, the train and
val files, the tokenizer, the cache folder's parent), model.pretrained and train.init_from when they are local
folders, and checkpoint.storage_path when it is not a URI. A run reads them on whichever node its workers or
decode tasks land, so a path that only the head has fails mid-run, on one node, after Ray Train has started.

One zero-CPU task per node (pinned to it), each answering for its node; nothing is written.
"""

from __future__ import annotations

import os

from behemoth.config import JobConfig
from behemoth.storage.store import Store
from behemoth.driver.commands.args import add_config_args


def job_paths(cfg: JobConfig) -> dict[str, str]:
    """The job's local paths every node must see: config key -> path (URIs and Hub names left out)."""
    from behemoth.models.sources import looks_local

    found = {}
    for key in type(cfg.data).path_keys:
        value = getattr(cfg.data, key, None)
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if not v or not Store(v).is_local:
                continue
            if key in ("tokenizer", "hf_dataset") and not looks_local(v):
                continue  # a Hub name: each node reads Hugging Face's cache or the network
            name = f"data.{key}" + (f"[{i}]" if isinstance(value, list) else "")
            found[name] = v
    for key, value in (("model.pretrained", cfg.model.pretrained), ("train.init_from", cfg.train.init_from),
                       ("checkpoint.storage_path", cfg.checkpoint.storage_path)):
        if value and Store(value).is_local and (key != "model.pretrained" or looks_local(value)):
            found[key] = value
    return found


def _seen(paths: dict[str, str]) -> dict:
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "host": os.uname().nodename,
            "missing": {key: path for key, path in paths.items() if not _sees(key, os.path.expanduser(path))}}


def _sees(key: str, path: str) -> bool:
    """The path is there; data.cache_dir where the folder it is made in is (the first run makes it)."""
    return os.path.exists(path) or (key == "data.cache_dir" and os.path.isdir(os.path.dirname(path.rstrip("/"))))


def check_nodes(cfg: JobConfig) -> list[dict]:
    """Every alive node's answer: {node, host, missing: {key: path}}."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    paths = job_paths(cfg)
    task = ray.remote(num_cpus=0)(_seen)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(paths)
            for node in ray.nodes() if node["Alive"]]
    return ray.get(refs, timeout=120)


def report_nodes(cfg) -> int:
    """`behemoth check-nodes`: one line per node; exit 1 where any node misses a path."""
    import os

    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="warning", log_to_driver=False)
    answers = check_nodes(cfg)
    for a in answers:
        lacks = "; ".join(f"{k} {v}" for k, v in a["missing"].items())
        print(f"node {a['node'][:12]} ({a['host']}): " + (f"MISSING {lacks}" if lacks else "sees every path"))
    print(f"# {len(answers)} node(s); paths checked: {', '.join(job_paths(cfg)) or 'none (all URIs or Hub names)'}")
    return 1 if any(a["missing"] for a in answers) else 0


def add_command(sub) -> None:
    p = sub.add_parser("check-nodes", help="on a running Ray cluster (RAY_ADDRESS, or this machine's `ray start`): "
                       "does every node see the job's local paths (data, model, init_from, checkpoint storage)?")
    add_config_args(p)
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from behemoth.job import load_config

    return report_nodes(load_config(args.config, args.overrides))
