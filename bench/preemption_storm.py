"""Benchmark: a preemption storm (issue 67 item 5). A local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a
head and one 1-CPU node per training worker) trains a small Llama-style LM for a fixed number of steps while a
storm preempts the node of rank 0 after each worker group has trained `--every` seconds, alternately with a notice (each
node's fake cloud metadata service announces it `--notice` seconds ahead; `behemoth spot-watch`, running for every
node, drains the node through Ray; the node is removed at the deadline) and without one (the node is removed at
once: its processes are killed). Each lost node is replaced by a fresh one.

The same storm hits behemoth (`train`, a checkpoint every `--checkpoint-every` steps, a report every 2) and the
plain Ray Train script a careful user would write from Ray's docs (the same model, data order and optimizer; a
`torch.save` checkpoint every `--checkpoint-every` steps through `ray.train.report`; resume from
`ray.train.get_checkpoint()`; `FailureConfig(max_failures=-1)`). Printed per side: the wall time from the first
step to the last, the steps trained again, for each preemption the steps redone and the seconds from the notice
(or the loss) to the next new step, and goodput = (steps x the median step time) / that wall time.

    .venv/bin/python bench/preemption_storm.py [--steps 1500] [--preemptions 4] [--every 10] [--notice 6]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))


def plain_train_func(config):
    """The plain Ray Train script's worker: its step log (rank 0) is config["log"]."""
    import tempfile

    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    from behemoth.job import config_from_dict
    from behemoth.tasks.causal_lm import build_lm

    cfg = config_from_dict(config["job"])
    tokens = config["tokens"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_lm(cfg, config["vocab"], config["eos"], None, train=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"]
    model = ray.train.torch.prepare_model(model)
    batch = cfg.train.global_batch_size
    order = np.random.default_rng(0).permutation(len(tokens))
    per_rank = batch // world
    node = ray.get_runtime_context().get_node_id()
    group = os.urandom(6).hex()  # this worker group's (a restart is another)
    for step in range(start + 1, config["steps"] + 1):
        at = ((step - 1) * batch) % (len(order) - batch)
        ids = torch.from_numpy(tokens[order[at + rank * per_rank:at + (rank + 1) * per_rank]].astype(np.int64))
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "node": node, "group": group}) + "\n")
        if step % config["every"] == 0 or step == config["steps"]:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)


class Storm:
    """The cluster's worker nodes, each with its fake metadata service and its `behemoth spot-watch`."""

    def __init__(self, cluster, notice_s: float):
        self.cluster, self.notice_s = cluster, notice_s
        self.nodes = {}  # node id -> (node, FakeMetadata, watcher process)
        self.events = []  # (time, "notice" | "no notice", node id)

    def add(self):
        from fake_metadata import FakeMetadata

        node = self.cluster.add_node(num_cpus=1)
        metadata = FakeMetadata()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "behemoth", "spot-watch", "--cloud", "aws", "--metadata-url", metadata.url,
             "--address", self.cluster.address, "--node-id", node.node_id, "--interval", "0.5"],
            env={**os.environ, "PYTHONPATH": str(REPO / "platform")}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self.nodes[node.node_id] = (node, metadata, watcher)

    def preempt(self, node_id: str, notice: bool) -> None:
        node, metadata, watcher = self.nodes.pop(node_id)
        self.events.append((time.time(), "notice" if notice else "no notice", node_id))
        if notice:
            deadline = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=self.notice_s)
            metadata.aws_action = {"action": "terminate", "time": deadline.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
            time.sleep(self.notice_s)
        self.cluster.remove_node(node)
        watcher.kill()
        metadata.close()
        self.add()

    def close(self):
        for node, metadata, watcher in self.nodes.values():
            watcher.kill()
            metadata.close()


def step_log(path: Path) -> list[dict]:
    """Rank 0's steps, in time order: the plain script's log file, or behemoth's sample ledger (a folder)."""
    if path.is_dir():
        from integration.ledger_audit import read_ledger

        rows = [{"step": r["step"], "time": r["time"], "node": r["node"], "group": r["group"]}
                for r in read_ledger(path) if r["rank"] == 0]
        return sorted(rows, key=lambda r: r["time"])
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # (a line still being written is read next time)
    return [json.loads(line) for line in lines]


def run_storm(storm: Storm, log: Path, train, preemptions: int, every_s: float) -> tuple[list[dict], float]:
    """Run `train` in a thread while the storm preempts the node of the newest step's rank 0 after every
    `every_s` seconds of new steps; returns the step log and the events' times."""
    done = {}
    thread = threading.Thread(target=lambda: done.update(result=train()), daemon=True)
    thread.start()
    first = len(storm.events)
    for k in range(preemptions):
        while thread.is_alive():  # `every_s` seconds of steps by a worker group started after the last event
            rows = step_log(log)
            since = storm.events[-1][0] if len(storm.events) > first else 0
            fresh = [r for r in rows if r["time"] > since]
            current = [r for r in fresh if fresh and r["group"] == fresh[-1]["group"]]
            if len(current) > 2 and current[-1]["time"] - current[0]["time"] >= every_s and \
                    (not since or current[0]["group"] not in {r["group"] for r in rows if r["time"] <= since}):
                break
            time.sleep(0.2)
        if not thread.is_alive():
            break
        victim = step_log(log)[-1]["node"]
        print(f"[storm] preempting rank 0's node {victim[:8]} {'with' if k % 2 == 0 else 'without'} a notice",
              flush=True)
        storm.preempt(victim, notice=k % 2 == 0)
    thread.join()
    return step_log(log), done.get("result")


def figures(name: str, rows: list[dict], events: list[tuple], steps: int) -> dict:
    times = [r["time"] for r in rows]
    wall = times[-1] - times[0]
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
    step_s = statistics.median(gaps)
    per_event = []
    for at, kind, _ in events:
        hit = next(r["group"] for r in reversed(rows) if r["time"] <= at)
        reached = max(r["step"] for r in rows if r["group"] == hit)  # (with a notice it trains on to its checkpoint)
        after = [r for r in rows if r["time"] > at and r["group"] != hit]
        restarted = [r for r in after if r["group"] == after[0]["group"]] if after else []
        new = next((r for r in restarted if r["step"] > reached), None)
        per_event.append({"kind": kind, "redone": sum(r["step"] <= reached for r in restarted),
                          # None: the restarted group was itself preempted before it reached a new step
                          "to_next_new_step_s": round(new["time"] - at, 1) if new else None})
    redone = len(rows) - len({r["step"] for r in rows})
    out = {"side": name, "wall_s": round(wall, 1), "steps": steps, "steps_redone": redone,
           "median_step_s": round(step_s, 3), "goodput": round(steps * step_s / wall, 3), "preemptions": per_event}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--preemptions", type=int, default=4, help="half with a notice, half without, alternating")
    p.add_argument("--every", type=float, default=10.0, help="seconds a worker group trains before its preemption")
    p.add_argument("--notice", type=float, default=6.0, help="seconds from a notice to the node's removal")
    p.add_argument("--checkpoint-every", type=int, default=150)
    args = p.parse_args()

    import ray
    from _common import lm_corpus, lm_job
    from behemoth.data.text_packing import prepare_text
    from behemoth.driver.run.trainer import train
    from behemoth.job import config_from_dict
    from ray.cluster_utils import Cluster

    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "1"
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.5"
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "60"
    work = Path(tempfile.mkdtemp(prefix="bench-storm-"))
    corpus = lm_corpus()
    job = lm_job(corpus, work, "storm", hidden=64, layers=2, batch=16, steps=args.steps, workers=2, threads=1,
                 log_every=2, checkpoint_every=args.checkpoint_every,
                 train={"sample_ledger": str(work / "ledger")}, failure={"max_failures": -1})
    job["scaling"]["cpus_per_worker"] = 1.0
    cfg = config_from_dict(job)

    # the head trains nothing (no CPU for a worker): every training worker is on a node the storm can hit
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    storm = Storm(cluster, args.notice)
    for _ in range(2):
        storm.add()
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="error",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO / "platform")}})
    tokens = prepare_text(cfg.data, seed=0)
    results = []
    try:
        ledger = work / "ledger"

        def behemoth_side():
            return train(cfg)

        rows, _ = run_storm(storm, ledger, behemoth_side, args.preemptions, args.every)
        results.append(figures("behemoth", rows, storm.events, args.steps))
        storm.events.clear()

        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        log = work / "plain.jsonl"
        plain = TorchTrainer(
            plain_train_func, train_loop_config={
                "job": job, "tokens": tokens.train[:], "vocab": tokens.vocab_size, "eos": tokens.eos_id,
                "steps": args.steps, "every": args.checkpoint_every, "log": str(log)},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="plain", storage_path=str(work / "plain"),
                                 failure_config=FailureConfig(max_failures=-1),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)))
        rows, _ = run_storm(storm, log, plain.fit, args.preemptions, args.every)
        results.append(figures("plain Ray Train", rows, storm.events, args.steps))
    finally:
        storm.close()
        ray.shutdown()
        cluster.shutdown()
    b, r = results
    print(f"goodput: behemoth {b['goodput']:.3f} vs plain Ray Train {r['goodput']:.3f}; steps redone {b['steps_redone']} "
          f"vs {r['steps_redone']}; wall {b['wall_s']} s vs {r['wall_s']} s ({args.preemptions} preemptions, half "
          f"with a {args.notice:.0f} s notice; a checkpoint every {args.checkpoint_every} steps)")


if __name__ == "__main__":
    main()
