"""Chaos: one training run on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head with 0 CPUs,
two 1-CPU worker nodes, one training worker on each) while training workers are SIGKILLed and whole nodes
removed (and replaced) at random steps, one failure per worker group, until N failures have been survived.
Then the checks the failure tests make, on the whole run:

- it ends at its last step, on final weights equal (torch.equal) to an uninterrupted run's;
- the sample ledger (train.sample_ledger): every step's surviving record holds exactly the global batch the
  uninterrupted order assigns to it (so no sample is trained twice or skipped in the kept history), and the
  steps trained more than once are exactly the redone intervals: after each failure, at most from the
  restored checkpoint to the step the failure hit.

The job is the failure tests' tiny causal LM (tests/integration: the same builders and ledger audit are
imported from there). Not in the test suite (minutes); its figures are in BENCHMARKS.md (RELIABILITY).

    .venv/bin/python bench/chaos.py                  # 10 failures, 400 steps, seed 0
    .venv/bin/python bench/chaos.py --kills 12 --seed 3
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "integration")]



def job(corpus: Path, storage: Path, name: str, steps: int, max_failures: int) -> dict:
    """The failure tests' job (a small Llama, a checkpoint every 10 steps, the sample ledger on), `steps` long."""
    from test_fault_tolerance import job as failure_test_job

    return failure_test_job(corpus, storage, name, train={"max_steps": steps, "epochs": 100, "log_every": 50},
                            failure={"max_failures": max_failures})


def chaos(cluster, nodes: list, ledger: Path, kills: int, rng: random.Random, out: dict) -> list[dict]:
    """Wait for each new worker group to train a random 5-25 steps past where it started, then hit it with
    a random failure: SIGKILL one training worker, or remove the node of one rank and add a new node."""
    import os

    from conftest import train_worker_pids
    from ledger_audit import read_ledger

    events, seen_groups = [], set()
    while len(events) < kills and "value" not in out and "error" not in out:
        records = read_ledger(ledger) if ledger.is_dir() else []
        groups = list(dict.fromkeys(r["group"] for r in records if r["rank"] == 0))
        current = groups[-1] if groups else None
        if current is None or current in seen_groups:
            time.sleep(0.05)
            continue
        first = min(r["step"] for r in records if r["group"] == current)
        target = first + rng.randint(5, 25)
        while max((r["step"] for r in read_ledger(ledger) if r["group"] == current), default=0) < target:
            if "value" in out or "error" in out:
                return events
            time.sleep(0.02)
        seen_groups.add(current)
        mine = [r for r in read_ledger(ledger) if r["group"] == current]
        at = max(r["step"] for r in mine)
        if rng.random() < 0.5:
            victim = rng.choice(train_worker_pids())
            os.kill(victim, signal.SIGKILL)
            what = f"SIGKILL training worker pid {victim}"
        else:
            rank = rng.randrange(2)
            node_id = next(r["node"] for r in mine if r["rank"] == rank)
            node = next(n for n in nodes if n.node_id == node_id)
            cluster.remove_node(node)
            nodes.remove(node)
            nodes.append(cluster.add_node(num_cpus=1))
            what = f"node of rank {rank} removed, a new node added"
        events.append({"group": current, "started_at": first, "hit_at": at, "what": what, "time": time.time()})
        print(f"[chaos] failure {len(events)}/{kills} at step {at} (group started at step {first}): {what}",
              flush=True)
    return events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import ray
    from behemoth.data.text.synth_text import write_synth_text
    from behemoth.data.tokenizer import train_tokenizer
    from behemoth.driver.run.trainer import train
    from behemoth.job import config_from_dict
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="behemoth-chaos-"))
    corpus = work / "text"
    write_synth_text(corpus, train_documents=240, val_documents=40, seed=3)
    train_tokenizer([str(corpus / "train.jsonl")], corpus / "tokenizer", vocab_size=400)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning",
             runtime_env={"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}})
    try:
        t0 = time.time()
        straight = train(config_from_dict(job(corpus, work / "straight", "straight", args.steps, 0)))
        straight_s = time.time() - t0
        print(f"[chaos] uninterrupted run: {args.steps} steps in {straight_s:.0f} s", flush=True)

        storage = work / "chaos"
        cfg = config_from_dict(job(corpus, storage, "chaos", args.steps, args.kills + 5))
        out: dict = {}

        def run() -> None:
            try:
                out["value"] = train(cfg)
            except BaseException as e:  # noqa: BLE001 - reported below
                out["error"] = e

        t0 = time.time()
        trainer = threading.Thread(target=run)
        trainer.start()
        events = chaos(cluster, nodes, storage / "ledger-chaos", args.kills, random.Random(args.seed), out)
        trainer.join()
        chaos_s = time.time() - t0
        if "error" in out:
            raise SystemExit(f"[chaos] the run failed after {len(events)} failures: {out['error']}")
        summary = out["value"]

        check_and_print(events, summary, straight, storage, args.steps, f"Wall: {chaos_s:.0f} s (uninterrupted "
                        f"{straight_s:.0f} s)")
    finally:
        ray.shutdown()
        cluster.shutdown()


def check_and_print(events: list[dict], summary, straight, storage: Path, steps: int, timing: str) -> None:
    """The ledger audit (every step's kept batch exact), the redone steps inside the failures' intervals, the
    final weights equal to the uninterrupted run's; then the per-failure lines and the summary line."""
    import torch
    from ledger_audit import audit
    from test_fault_tolerance import BATCH

    result = audit(storage / "ledger-chaos", _blocks(storage), steps, BATCH)  # exact batch of every step
    groups = list(dict.fromkeys(r["group"] for r in result["records"] if r["rank"] == 0))
    # The steps each failure cost: its group's steps past the checkpoint the next group restored.
    restored = {g: min(r["step"] for r in result["records"] if r["group"] == g) - 1 for g in groups}
    allowed = set()
    for e in events:
        nxt = groups[groups.index(e["group"]) + 1]
        allowed |= set(range(restored[nxt] + 1, e["hit_at"] + 2))  # the step in flight when hit too
        e["restored_from"] = restored[nxt]
    redone = result["redone"]
    assert set(redone) <= allowed, sorted(set(redone) - allowed)
    wa = torch.load(Path(summary.latest_checkpoint) / "model.pt")
    wb = torch.load(Path(straight.latest_checkpoint) / "model.pt")
    equal = all(torch.equal(wa[k], wb[k]) for k in wa)
    assert summary.metrics["step"] == steps and equal

    print()
    for i, e in enumerate(events, 1):
        print(f"  {i:2d}. step {e['hit_at']:3d}: {e['what']}; restored from step {e['restored_from']} "
              f"({e['hit_at'] - e['restored_from']} steps redone at most)")
    print(f"[chaos] {len(events)} failures survived ({sum('SIGKILL' in e['what'] for e in events)} workers "
          f"killed, {sum('node' in e['what'] for e in events)} nodes removed), {len(redone)} steps redone "
          f"(each within its failure's interval), {len(groups)} worker groups; final weights torch.equal to "
          f"the uninterrupted run's: {equal}; every step's kept batch exact. {timing}")


def _blocks(storage: Path) -> int:
    import json

    return json.loads(next((storage / "cache").glob("*/meta.json")).read_text())["train"]["blocks"]


if __name__ == "__main__":
    main()
