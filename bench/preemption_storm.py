"""Benchmark: goodput under a fair preemption storm (issues 67 and 73). A local multi-node Ray cluster
(`ray.cluster_utils.Cluster`: a head that trains nothing and one 1-CPU node per training worker) trains a small
Llama-style LM for `--steps` steps while a storm preempts the node of rank 0, the same storm for both sides:

- keyed by training progress: preemption k falls when the run first reaches step S_k (the --preemptions steps
  spread evenly over the run, each moved at random by up to half the plain script's checkpoint interval either
  way, drawn anew for each repeat and the same for every side of it), alternately with a notice (each node's
  fake cloud metadata service announces the reclaim `--notice` seconds ahead, `behemoth spot-watch` on every
  node turns it into Ray's drain, and the node is removed at the deadline) and without one (removed at once);
- a replacement node joins `--replacement-delay` seconds after the autoscaler launched it (a cloud takes minutes
  to launch one; the delay is the same for both sides): at the node's drain, where a notice drained it, as Ray's
  autoscaler v2 does (`ray up`'s default; `--launch-at removal`: at the node's removal, as v1 does), and every
  side meets every preemption.

The sides, alternating (ABBA) over `--repeats`: behemoth as a spot user runs it (`train`, `checkpoint.every_n_steps:
auto` with `checkpoint.hold_budget` the share of its calm run's time the plain script's checkpoints held its
loop (`--hold-budget`: the same blocking budget), elastic `scaling.num_workers: [1, 2]` so that it trains on with
the workers it has while the replacement comes, `elastic_resize_interval_s: 5`, a report every 2 steps, and its
default rescue checkpoint (a live worker's state when Ray Train stops its group: a peer lost, the regrow);
`--behemoth-set KEY=VALUE` adds overrides),
optionally behemoth-fixed (the same with 2 workers: it waits for the replacement, as the plain script does), and
the plain Ray Train script a careful user would write from Ray's docs (the same model,
data order and optimizer; a `torch.save` checkpoint every `--checkpoint-every` steps through `ray.train.report`;
resume from `ray.train.get_checkpoint()`; `FailureConfig(max_failures=-1)`). Each side also trains once without
a storm first (its step rate and start-up, so recovery is told apart from step speed).

Printed per side and repeat, one JSON line: goodput = steps x the no-storm median step / the wall time from the
first step to the last, and per paid node-second (`goodput_paid`: the same over the worker-node seconds a cloud
bills in that time, every node the cluster had, idle or not; a node the storm took away is not billed until its
replacement joins); steps redone; the checkpoint time that blocked training (periodic and, for behemoth,
the notices'; the run's last checkpoint left out) and its share of the time in the loop (`checkpoint_share`:
the budget's measure; each calm run's `hold_share` is the periodic ones' budget); and per preemption its kind, steps
redone, the seconds from the notice (or the loss) to the next new step, and where they went (`phases`: until
the old group ended, the restart to the new group's training function, its set-up to the loop, the first step).
Also per run: `lost_s`, the seconds not spent training new steps at the full group's rate (time not stepping,
redone steps, half of each step a lone worker trained), and `share_new`, 1 - lost_s / wall: the step's speed left
out. Then one line of medians (min, max) per side and the ratios (goodput, share_new, time lost, steps redone
without notice, recovery).

    .venv/bin/python bench/preemption_storm.py [--steps 1500] [--preemptions 4] [--notice 6] \\
        [--replacement-delay 60] [--launch-at drain|removal] [--checkpoint-every 150] [--repeats 3] \\
        [--sides behemoth,plain] [--pin-cores] \\
        [--hold-budget plain|none|SHARE] [--behemoth-set KEY=VALUE ...]
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
WORKER_NODES = 2  # one 1-CPU node per worker of the plain script (behemoth's elastic run: 1 to 2 workers)
sys.path.insert(0, str(REPO / "platform"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))


def plain_train_func(config):
    """The plain Ray Train script's worker. Rank 0 logs each step, its training function's start ("start") and
    the end of its set-up ("ready") to config["log"], and how long each checkpoint held the loop ("ckpt_s")."""
    import tempfile

    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    from behemoth.job import config_from_dict
    from behemoth.tasks.causal_lm import build_lm

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    group = os.urandom(6).hex()  # this worker group's (a restart is another)
    log = _plain_log(config["log"], rank, group)
    from behemoth.metrics import proc_start_time

    log({"event": "start", "process": proc_start_time()})
    cfg = config_from_dict(config["job"])
    tokens = config["tokens"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_lm(cfg, config["vocab"], config["eos"], None, train=True, chunked_loss=False)  # (transformers' own loss)
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
    log({"event": "ready", "resumed_from": start})
    for step in range(start + 1, config["steps"] + 1):
        at = ((step - 1) * batch) % (len(order) - batch)
        ids = torch.from_numpy(tokens[order[at + rank * per_rank:at + (rank + 1) * per_rank]].astype(np.int64))
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        log({"step": step})
        if step % config["every"] == 0 or step == config["steps"]:
            held = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
            log({"ckpt_s": time.perf_counter() - held})


def _plain_log(path: str, rank: int, group: str):
    import ray

    node = ray.get_runtime_context().get_node_id()

    def log(row: dict) -> None:
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps({**row, "time": time.time(), "node": node, "group": group}) + "\n")

    return log


class Storm:
    """The cluster's worker nodes, each with its fake metadata service and its `behemoth spot-watch`, and the
    autoscaler's part: a lost node's replacement joins `delay_s` after the autoscaler launched it, at the node's
    drain (`launch_at="drain"`: Ray's autoscaler v2, `ray up`'s default since Ray 2.50, counts a draining node as
    gone against Ray Train's standing request for its group, so a noticed node's replacement is launched at the
    notice; measured with ray.cluster_utils.AutoscalingCluster, BENCHMARKS.md) or at its removal (`"removal"`:
    the v1 autoscaler, which counts a node until it is dead)."""

    def __init__(self, cluster, notice_s: float, delay_s: float, launch_at: str = "drain", pin: bool = False):
        self.cluster, self.notice_s, self.delay_s, self.launch_at = cluster, notice_s, delay_s, launch_at
        # --pin-cores: worker node k's processes on CPU k only (its replacement's too), as a machine of its own
        # would be: without it the nodes share every core, and one left alone trains nearly as fast as two
        self.cores = sorted(os.sched_getaffinity(0))[:WORKER_NODES] if pin else None
        self.core_of: dict[str, int] = {}
        self.nodes = {}  # node id -> (node, FakeMetadata, watcher process)
        self.events = []  # {time, kind, node, deadline, drained, launched, removed, replaced}
        self.doomed: dict[int, tuple] = {}  # event index -> (node, metadata, watcher): noticed, not yet removed
        self.pending: list[dict] = []  # events whose replacement is launched and has yet to join

    def add(self, core: int | None = None):
        """A worker node (on `core` where the storm pins them: the lost node's, or the first no node holds)."""
        from fake_metadata import FakeMetadata

        if self.cores is None:
            node = self.cluster.add_node(num_cpus=1)
        else:
            core = core if core is not None else min(set(self.cores) - set(self.core_of.values()))
            every = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {core})  # (this thread's: the raylet, its agents and its workers inherit it)
            try:
                node = self.cluster.add_node(num_cpus=1)
            finally:
                os.sched_setaffinity(0, every)
            self.core_of[node.node_id] = core
        metadata = FakeMetadata()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "behemoth", "spot-watch", "--cloud", "aws", "--metadata-url", metadata.url,
             "--address", self.cluster.address, "--node-id", node.node_id, "--interval", "0.5"],
            env={**os.environ, "PYTHONPATH": str(REPO / "platform")}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self.nodes[node.node_id] = (node, metadata, watcher)

    def preempt(self, node_id: str, notice: bool) -> None:
        """Reclaim the node: at once, or announce the reclaim `notice_s` ahead (tick() removes it then)."""
        node, metadata, watcher = self.nodes.pop(node_id)
        now = time.time()
        event = {"time": now, "kind": "notice" if notice else "no notice", "node": node_id,
                 "deadline": now + (self.notice_s if notice else 0.0)}
        self.events.append(event)
        self.doomed[len(self.events) - 1] = (node, metadata, watcher)
        if notice:
            deadline = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=self.notice_s)
            metadata.aws_action = {"action": "terminate", "time": deadline.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        self.tick()

    def _draining(self) -> set[str]:
        from ray._raylet import GcsClient
        from ray.core.generated import gcs_pb2

        draining = gcs_pb2.NodeSnapshot.State.Value("DRAINING")
        infos = GcsClient(address=self.cluster.address).get_all_node_info()
        return {node_id.hex() for node_id, info in infos.items() if info.state_snapshot.state == draining}

    def tick(self) -> None:
        """Remove the nodes whose deadline came, launch replacements (at a drain or a removal) and add those due
        (from the main thread: Ray's node start sets signal handlers)."""
        now = time.time()
        if self.launch_at == "drain" and any("launched" not in self.events[i] for i in self.doomed):
            draining = self._draining()
            for i in self.doomed:
                if "launched" not in self.events[i] and self.events[i]["node"] in draining:
                    self.events[i]["drained"] = self.events[i]["launched"] = now
                    self.pending.append(self.events[i])
        for i in [i for i in self.doomed if now >= self.events[i]["deadline"]]:
            node, metadata, watcher = self.doomed.pop(i)
            self.cluster.remove_node(node)
            event = self.events[i]
            event["removed"] = time.time()
            watcher.kill()
            metadata.close()
            if "launched" not in event:
                event["launched"] = event["removed"]
                self.pending.append(event)
        for event in [e for e in self.pending if time.time() >= e["launched"] + self.delay_s]:
            self.add(self.core_of.pop(event["node"], None))
            event["replaced"] = time.time()
            self.pending.remove(event)

    def settle(self) -> None:
        """The noticed nodes went and the replacements under way joined (the next side starts on a whole
        cluster)."""
        while self.pending or self.doomed:
            self.tick()
            time.sleep(0.1)
        self.cluster.wait_for_nodes()

    def close(self):
        self.settle()
        for node, metadata, watcher in self.nodes.values():
            watcher.kill()
            metadata.close()


def step_log(path: Path) -> list[dict]:
    """Rank 0's steps, in time order: the plain script's log file (its step rows), or behemoth's sample ledger
    (a folder)."""
    if path.is_dir():
        from integration.ledger_audit import read_ledger

        rows = [{"step": r["step"], "time": r["time"], "node": r["node"], "group": r["group"], "world": r["world"]}
                for r in read_ledger(path) if r["rank"] == 0]
        return sorted(rows, key=lambda r: r["time"])
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # (a line still being written is read next time)
    return [row for row in map(json.loads, lines) if "step" in row]


def schedule(steps: int, preemptions: int, every: int, seed: int) -> list[int]:
    """The steps at which the storm strikes, the same for every side of a repeat: spread evenly over the run,
    each moved by up to half the plain script's checkpoint interval either way (drawn from `seed`), so that a
    preemption falls anywhere in that interval, not always just before its checkpoint (its worst case)."""
    import random

    rng = random.Random(seed)
    return [round(steps * (k + 1) / (preemptions + 1)) + rng.randint(-(every // 2), every - every // 2 - 1)
            for k in range(preemptions)]


class StepTail:
    """Rank 0's steps as the run writes them (the plain script's log, or behemoth's ledger's rank0.jsonl), read
    incrementally: each poll parses only the lines added since the last. (Re-reading the whole log ten times a
    second took a share of the two CPUs the run trains on that grew with the log, more of behemoth's: its ledger
    keeps every rank's sample ids; its steps in the storm were 1.1-1.8x its calm ones.)"""

    def __init__(self, path: Path):
        self.path = path if path.suffix == ".jsonl" else path / "rank0.jsonl"
        self.offset, self.rest = 0, b""
        self.groups: dict[str, dict] = {}  # group -> {first: time, top: step, last: time, node}

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")  # (a line still being written is read next time)
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:  # (empty, or the start of a record its killed writer left; the ledger's next
                continue        # writer begins on a new line)
            if "step" in row:
                g = self.groups.setdefault(row["group"], {"first": row["time"], "top": row["step"]})
                g.update(top=max(g["top"], row["step"]), last=row["time"], node=row["node"])

    def newest_since(self, since: float) -> tuple[int, str] | None:
        """(the highest step of the worker groups started after `since`, the node of the newest of their steps),
        or None before one has trained: a group that outlives its node for a moment, or trains on through a
        notice, is not struck twice (run_storm strikes again only once the noticed node is gone)."""
        groups = [g for g in self.groups.values() if g["first"] > since]
        if not groups:
            return None
        return max(g["top"] for g in groups), max(groups, key=lambda g: g["last"])["node"]


def run_storm(storm: Storm, log: Path, train, at_steps: list[int]) -> list[dict]:
    """Run `train` in a thread while the storm preempts the node of rank 0's newest step when the run first
    reaches each of `at_steps` (alternately with and without a notice); returns the step log."""
    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    tail = StepTail(log)
    for k, at in enumerate(at_steps):
        while thread.is_alive():
            storm.tick()
            tail.poll()
            newest = tail.newest_since(max((e.get("removed", e["time"]) for e in storm.events), default=0.0))
            if not storm.doomed and newest and newest[0] >= at and newest[1] in storm.nodes:
                break
            time.sleep(0.1)
        if not thread.is_alive():
            print(f"[storm] the run ended before step {at}: preemption {k + 1} not met", flush=True)
            break
        victim = newest[1]
        print(f"[storm] step {at}: preempting rank 0's node {victim[:8]} {'with' if k % 2 == 0 else 'without'} "
              f"a notice", flush=True)
        storm.preempt(victim, notice=k % 2 == 0)
    while thread.is_alive():
        storm.tick()
        thread.join(timeout=0.1)
    storm.settle()
    return step_log(log)


def _phases_plain(events_log: list[dict], new_group: str, first_new: dict) -> dict:
    start = next((r for r in events_log if r.get("event") == "start" and r["group"] == new_group), {})
    ready = next((r["time"] for r in events_log if r.get("event") == "ready" and r["group"] == new_group), None)
    return {"to_process_start": start.get("process"), "to_function_start": start.get("time"), "to_loop": ready,
            "to_first_step": first_new["time"]}


def _phases_behemoth(run_dir: Path, new_group_rows: list[dict]) -> dict:
    """The new group's training function start and loop start on rank 0, from the run's records."""
    from behemoth.tracking.records import read_jsonl

    reports = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r.get("group_id") and "wall_time" in r]
    first_step = new_group_rows[0]["time"]
    report = min((r for r in reports if r["wall_time"] >= first_step), key=lambda r: r["wall_time"], default={})
    return {"to_process_start": report.get("mark_process"), "to_function_start": report.get("mark_started"),
            "to_loop": report.get("mark_loop_started"), "to_first_step": first_step}


def figures(side: str, rows: list[dict], events: list[dict], steps: int, step_s: float, phases_of) -> dict:
    """The side's goodput and each preemption's cost, from its step log and the storm's events."""
    times = [r["time"] for r in rows]
    wall = times[-1] - times[0]
    per_event = []
    for event in events:
        at = event["time"]
        hit = next(r["group"] for r in reversed(rows) if r["time"] <= at)
        reached = max(r["step"] for r in rows if r["group"] == hit)  # (with a notice it may train on)
        ended = max(r["time"] for r in rows if r["group"] == hit)
        after = [r for r in rows if r["time"] > ended and r["group"] != hit]
        new = next((r for r in after if r["step"] > reached), None)
        restarted = [r for r in after if after and r["group"] == after[0]["group"]]
        phases = {}
        if restarted:
            marks = phases_of(restarted)
            last = max(at, ended)
            for name in ("to_process_start", "to_function_start", "to_loop", "to_first_step"):
                if marks.get(name):
                    phases[name] = round(marks[name] - last, 1)
                    last = marks[name]
            phases = {"until_group_ended": round(ended - at, 1), **phases}
        per_event.append({"kind": event["kind"], "redone": sum(r["step"] <= reached for r in restarted),
                          "replaced_s": round(event["replaced"] - at, 1) if "replaced" in event else None,
                          "to_next_new_step_s": round(new["time"] - at, 1) if new else None, "phases": phases})
    redone = steps_redone(rows)
    paid = paid_node_s(events, times[0], times[-1])
    lost = time_lost(rows)
    out = {"side": side, "wall_s": round(wall, 1), "steps": steps, "steps_redone": redone,
           "step_s": round(step_s, 4), "goodput": round(steps * step_s / wall, 3),
           "lost_s": round(lost, 1), "share_new": round(1 - lost / wall, 3),
           "paid_node_s": round(paid, 1), "goodput_paid": round(steps * step_s * WORKER_NODES / paid, 3),
           "preemptions": per_event}
    return out


def time_lost(rows: list[dict]) -> float:
    """Seconds of the wall time not spent training new steps at the full group's rate, whatever the step's speed
    (the calm run's step, goodput's measure, wanders as much as the losses on a shared VM): the time not stepping
    (restarts, waits, holds), the redone steps at the run's median step, and half of each step a lone worker
    trained in place of two (here one worker of this tiny model steps nearly as fast as two; on GPUs, half)."""
    wall = rows[-1]["time"] - rows[0]["time"]
    gaps = step_gaps(rows)
    stepping = sum(g for g, _ in gaps)
    alone = sum(g for g, world in gaps if world < WORKER_NODES)
    full = [g for g, world in gaps if world >= WORKER_NODES] or [0.0]
    return wall - stepping + steps_redone(rows) * statistics.median(full) + alone / 2


def steps_redone(rows: list[dict]) -> int:
    """Steps the ledger holds more than once (each retraining of a step after a restart counts)."""
    return len(rows) - len({r["step"] for r in rows})


def paid_node_s(events: list[dict], start: float, end: float) -> float:
    """The worker-node seconds a cloud bills from the run's first step to its last: every worker node the
    cluster had, training or idle (the storm takes one away at each preemption until its replacement joins; a
    replacement launched at a notice may join before the noticed node goes: both are billed meanwhile)."""
    def within(a: float, b: float) -> float:
        return max(0.0, min(b, end) - max(a, start))

    paid = WORKER_NODES * (end - start)
    for event in events:
        gone, back = event.get("removed", end), event.get("replaced", end)
        paid += within(back, gone) - within(gone, back)
    return paid


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--preemptions", type=int, default=4, help="alternating with and without a notice")
    p.add_argument("--notice", type=float, default=6.0, help="seconds from a notice to the node's removal")
    p.add_argument("--replacement-delay", type=float, default=60.0,
                   help="seconds from the replacement's launch to its joining (a cloud launches a node and starts "
                        "Ray on it in minutes: 60 s is the short end)")
    p.add_argument("--launch-at", choices=["drain", "removal"], default="drain",
                   help="when the autoscaler launches a lost node's replacement: at its drain, the notice (Ray's "
                        "autoscaler v2, `ray up`'s default), or at its removal (the v1 autoscaler)")
    p.add_argument("--pin-cores", action="store_true",
                   help="each worker node's processes on one CPU of their own (the head's float), as on machines of "
                        "their own: a node left alone then trains at its own CPU's speed, not at the whole machine's")
    p.add_argument("--checkpoint-every", type=int, default=150, help="the plain script's checkpoint interval")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sides", default="behemoth,plain", help="behemoth (elastic: scaling.num_workers [1, 2]), "
                   "behemoth-fixed (2 workers: waits for the replacement, as the plain script does), plain")
    p.add_argument("--hold-budget", default="plain",
                   help="behemoth's checkpoint.hold_budget: 'plain' (the share of its calm run's time the plain "
                        "script's checkpoints held its loop: the same blocking budget), a number, or 'none' "
                        "(auto's Young/Daly interval)")
    p.add_argument("--behemoth-set", action="append", default=[], help="KEY=VALUE overrides of behemoth's job")
    args = p.parse_args()

    import ray
    from _common import lm_corpus, lm_job
    from behemoth.config.load import apply_override
    from behemoth.data.text.text_packing import prepare_text
    from behemoth.job import config_from_dict
    from ray.cluster_utils import Cluster

    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "1"
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.5"
    work = Path(tempfile.mkdtemp(prefix="bench-storm-"))
    corpus = lm_corpus()
    # behemoth's checkpoint.hold_budget (none: Young/Daly); 'plain': set from the plain script's calm run below
    budget = {"share": None if args.hold_budget in ("plain", "none") else float(args.hold_budget)}

    def behemoth_job(name: str, steps: int, elastic: bool = True) -> dict:
        job = lm_job(corpus, work, name, hidden=64, layers=2, batch=16, steps=steps, workers=2, threads=1,
                     log_every=2, train={"sample_ledger": str(work / name / "ledger"), "epochs": 100_000},  # (steps end it)
                     checkpoint={"every_n_steps": "auto", "hold_budget": budget.get("share")},
                     failure={"max_failures": -1})
        job["scaling"]["cpus_per_worker"] = 1.0
        if elastic:  # as a spot user runs it: on the workers it has while a replacement comes, grown back soon after
            job["scaling"].update(num_workers=[1, 2], elastic_resize_interval_s=5.0)
        for item in args.behemoth_set:
            apply_override(job, item)
        return job

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    storm = Storm(cluster, args.notice, args.replacement_delay, args.launch_at, pin=args.pin_cores)
    for _ in range(WORKER_NODES):
        storm.add()
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="error",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO / "platform")}})
    tokens = prepare_text(config_from_dict(behemoth_job("corpus", 10)).data, seed=0)
    sides = args.sides.split(",")
    results: dict[str, list[dict]] = {side: [] for side in sides}
    try:  # (the watchers and the cluster are ended whatever fails, the calm runs included)
        calm = {}
        for side in sorted(sides, key=lambda s: s != "plain"):  # (the plain script's first: its hold share)
            calm[side] = _calm_run(side, behemoth_job, tokens, args, work)
            if side == "plain" and args.hold_budget == "plain":
                budget["share"] = calm["plain"]["hold_share"]
            print(f"[storm] calm {side}: {json.dumps(calm[side])}", flush=True)
        for r in range(args.repeats):
            at_steps = schedule(args.steps, args.preemptions, args.checkpoint_every, seed=r)
            print(f"[storm] repeat {r}: preemptions at steps {at_steps}", flush=True)
            for side in (sides if r % 2 == 0 else sides[::-1]):
                storm.events.clear()
                name = f"{side}-{r}"
                train, log, phases_of = _side(side, name, behemoth_job, tokens, args, work)
                rows = run_storm(storm, log, train, at_steps)
                out = figures(side, rows, storm.events, args.steps, calm[side]["step_s"], phases_of)
                blocked = _blocked(side, work / name, log, args.steps)
                # the budget is a share of the time in the loop: a side training on one worker while the other
                # waits for the replacement has twice the seconds per step, the other none
                out.update(repeat=r, at_steps=at_steps, checkpoint_blocked_s=round(blocked, 2),
                           checkpoint_share=round(blocked / loop_s(rows), 5), calm=calm[side])
                print(json.dumps(out), flush=True)
                results[side].append(out)
    finally:
        storm.close()
        ray.shutdown()
        cluster.shutdown()
    _summary(results, args)


def _side(side: str, name: str, behemoth_job, tokens, args, work: Path, steps: int | None = None):
    """(the side's training call, its step log, how to read a new group's phases)."""
    steps = steps or args.steps
    if side.startswith("behemoth"):
        from behemoth.driver.run.trainer import train
        from behemoth.job import config_from_dict

        cfg = config_from_dict(behemoth_job(name, steps, elastic=side == "behemoth"))
        run_dir = work / name
        return (lambda: train(cfg)), run_dir / "ledger", lambda rows: _phases_behemoth(run_dir, rows)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log = work / f"{name}.jsonl"
    plain = TorchTrainer(
        plain_train_func, train_loop_config={
            "job": behemoth_job(name, steps), "tokens": tokens.train[:], "vocab": tokens.vocab_size,
            "eos": tokens.eos_id, "steps": steps, "every": args.checkpoint_every, "log": str(log)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(work / "plain"),
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))

    def phases_of(rows):
        events = [json.loads(line) for line in log.read_text().splitlines()]
        return _phases_plain(events, rows[0]["group"], rows[0])

    def fit():  # as its user runs it: Ray Train's own placement wait (60 s), not the one behemoth set for its run
        os.environ.pop("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", None)
        return plain.fit()

    return fit, log, phases_of


def _calm_run(side: str, behemoth_job, tokens, args, work: Path) -> dict:
    """A run of the side without a storm: its median step and its start-up (the call to the first step)."""
    steps = max(args.steps // 3, 200)
    train, log, _ = _side(side, f"{side}-calm", behemoth_job, tokens, args, work, steps=steps)
    called = time.time()
    train()
    rows = step_log(log)
    gaps = [g for g, _ in step_gaps(rows)]
    # the share of its training time its checkpoints held the loop (the blocking budget; no notice in a calm run)
    share = _blocked(side, work / f"{side}-calm", log, steps) / loop_s(rows)
    return {"step_s": statistics.median(gaps), "startup_s": round(rows[0]["time"] - called, 1),
            "hold_share": round(share, 5)}


def step_gaps(rows: list[dict]) -> list[tuple[float, int]]:
    """(seconds, workers) from each step to the next one of the same worker group (a checkpoint's hold inside
    them; restarts, and the steps a restart went back over, left out: a group resumed at exactly the next step,
    as after a notice, is a restart too)."""
    return [(b["time"] - a["time"], b.get("world", WORKER_NODES)) for a, b in zip(rows, rows[1:])
            if b["step"] == a["step"] + 1 and b["group"] == a["group"]]


def loop_s(rows: list[dict]) -> float:
    """Seconds rank 0 spent in its training loop (step_gaps)."""
    return sum(g for g, _ in step_gaps(rows))


def _blocked(side: str, run_dir: Path, log: Path, steps: int) -> float:
    """Seconds the side's checkpoints took from its training (rank 0), summed over the run: the plain script's
    `torch.save` and report; behemoth's hold on the loop and its background writes' CPU seconds (its workers
    train on their one CPU, which the writes share). The run's last checkpoint, at step `steps`, is not counted:
    it ends the run rather than protecting it, and behemoth's last report is sent before it."""
    if side.startswith("behemoth"):
        from behemoth.tracking.records import read_jsonl

        last = {}  # each group's last report: its clock's checkpoint time and its writes' CPU time so far
        for r in read_jsonl(str(run_dir / "metrics.jsonl")):
            if r.get("group_id"):
                last[r["group_id"]] = r
        return sum(r.get("time_checkpoint_s", 0.0) + r.get("checkpoint_write_cpu_s", 0.0) for r in last.values())
    total, step = 0.0, None
    for row in map(json.loads, log.read_text().splitlines()):
        step = row.get("step", step)  # (a checkpoint's row follows its step's)
        if "ckpt_s" in row and step != steps:
            total += row["ckpt_s"]
    return total


def _summary(results: dict[str, list[dict]], args) -> None:
    def spread(values):
        values = [v for v in values if v is not None]
        return (f"{statistics.median(values):.3g} (min {min(values):.3g}, max {max(values):.3g})" if values
                else "n/a")

    lines = {}
    for side, outs in results.items():
        no_notice = [e["redone"] for o in outs for e in o["preemptions"] if e["kind"] == "no notice"]
        noticed = [e["redone"] for o in outs for e in o["preemptions"] if e["kind"] == "notice"]
        recovery = [e["to_next_new_step_s"] for o in outs for e in o["preemptions"]]
        lines[side] = {"goodput": statistics.median(o["goodput"] for o in outs),
                       "goodput_paid": statistics.median(o["goodput_paid"] for o in outs),
                       "redone_no_notice": statistics.median(no_notice) if no_notice else None,
                       "redone_notice": statistics.median(noticed) if noticed else None,
                       "recovery_s": statistics.median([x for x in recovery if x is not None] or [0]),
                       "wall_s": statistics.median(o["wall_s"] for o in outs),
                       "lost_s": statistics.median(o["lost_s"] for o in outs),
                       "share_new": statistics.median(o["share_new"] for o in outs),
                       "checkpoint_share": statistics.median(o["checkpoint_share"] for o in outs)}
        print(f"{side}: goodput {spread([o['goodput'] for o in outs])} (per paid node-second "
              f"{spread([o['goodput_paid'] for o in outs])}); steps redone per noticed preemption "
              f"{spread(noticed)}, per preemption without notice {spread(no_notice)}; seconds to the next new "
              f"step {spread(recovery)}; checkpoints took from training {spread([o['checkpoint_blocked_s'] for o in outs])} s, "
              f"a share {spread([o['checkpoint_share'] for o in outs])} of its time in the loop",
              flush=True)
    if "behemoth" in lines and "plain" in lines:
        b, r = lines["behemoth"], lines["plain"]
        ratio = {key: round(b[key] / r[key], 3) if b[key] is not None and r[key] else None
                 for key in ("redone_no_notice", "recovery_s")}
        print(json.dumps({"medians": lines, "goodput_ratio": round(b["goodput"] / r["goodput"], 3),
                          # (the share of the wall time training new steps, and the time lost: the step's speed
                          # left out, see time_lost)
                          "share_new_ratio": round(b["share_new"] / r["share_new"], 3),
                          "lost_ratio": round(b["lost_s"] / r["lost_s"], 3) if r["lost_s"] else None,
                          "goodput_paid_ratio": round(b["goodput_paid"] / r["goodput_paid"], 3),
                          "redone_no_notice_ratio": ratio["redone_no_notice"], "recovery_ratio": ratio["recovery_s"],
                          # (goodput counts each side's steps at its own calm step: the same steps' wall time is
                          # the user's bill whatever the step's speed; > 1: behemoth finished sooner)
                          "wall_ratio_plain_over_behemoth": round(r["wall_s"] / b["wall_s"], 3),
                          "notice_s": args.notice, "replacement_delay_s": args.replacement_delay,
                          "launch_at": args.launch_at, "pin_cores": args.pin_cores,
                          "preemptions": args.preemptions, "repeats": args.repeats}), flush=True)


if __name__ == "__main__":
    main()
