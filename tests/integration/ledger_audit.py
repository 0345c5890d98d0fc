"""The sample-ledger audit shared by the failure tests and the broken-pipeline test (train.sample_ledger).

A ledger records, per rank and trained step, the sample ids of the batches the step actually trained on.
For each step, the records of the last worker group that trained it are what the final weights were trained
on: the audit checks that they give every step exactly its global batch of the uninterrupted order (seed 0),
names every step that did not and what it trained instead, and counts the steps trained by more than one
group.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from behemoth.data.order import epoch_order, steps_per_epoch


def read_ledger(folder: Path) -> list[dict]:
    """The records of complete lines. The tests poll ledgers that live workers are appending to: text after
    the last newline is a line still being written (read next time). A line torn by a killed writer (the
    next group starts a new line after it, see SampleLedger) is not a record: it does not parse and is
    skipped; the step it was for is redone by the next group, whose record the audit uses."""
    records = []
    for f in sorted(folder.glob("rank*.jsonl")):
        for line in f.read_text().split("\n")[:-1]:
            try:
                records.append(json.loads(line))
            except ValueError:
                assert not line.endswith("}"), f"{f}: an unreadable ledger line that is not torn: {line!r}"
    return records


def audit(folder: Path, n_samples: int, steps: int, batch: int) -> dict:
    """The ledger's steps 1..steps against the planned order. A step missing from the ledger, or missing a
    rank, fails at once; every step that trained other samples than its planned batch is named, with what it
    trained instead (another step's batch, or samples of no planned batch), and so is every planned batch no
    step trained, in one AssertionError."""
    records = read_ledger(folder)
    groups = list(dict.fromkeys(r["group"] for r in records if r["rank"] == 0))  # rank 0's file: time order
    by_step = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_step[r["step"]][r["group"]].append(r)
    plan = planned_batches(n_samples, batch, steps + steps_per_epoch(n_samples, batch))  # a batch ahead is named
    worlds, redone, losses, group_losses, got_by_step = {}, [], {}, {}, {}
    for step in range(1, steps + 1):
        assert by_step[step], f"step {step} is missing from the ledger"
        trained_by = sorted(by_step[step], key=groups.index)
        redone += [step] if len(trained_by) > 1 else []
        ranks = sorted(by_step[step][trained_by[-1]], key=lambda r: r["rank"])
        world = ranks[0]["world"]
        assert [r["rank"] for r in ranks] == list(range(world)), f"step {step}: {ranks}"
        got = np.concatenate([r["ids"] for r in ranks])
        by_group = {g: by_step[step][g] for g in trained_by}
        group_losses[step] = [sum(r["loss_sum"] for r in rs) / sum(r["samples"] for r in rs)
                              for rs in by_group.values()]
        losses[step] = group_losses[step][-1]
        got_by_step[step] = got
        worlds[step] = world
    problems = order_problems(got_by_step, plan)
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise AssertionError(f"the ledger differs from the planned order: {shown}")
    return {"redone": redone, "worlds": worlds, "records": records, "losses": losses,
            "group_losses": group_losses}


def planned_batches(n_samples: int, batch: int, last_step: int) -> dict[int, np.ndarray]:
    """Step -> the sample ids of its global batch in the uninterrupted order (seed 0), steps 1..last_step."""
    epoch_steps, orders = steps_per_epoch(n_samples, batch), {}
    plan = {}
    for step in range(1, last_step + 1):
        epoch, g = divmod(step - 1, epoch_steps)
        order = orders.get(epoch)
        if order is None:
            order = orders[epoch] = epoch_order(n_samples, 0, epoch)
        plan[step] = order[g * batch:(g + 1) * batch]
    return plan


def order_problems(got_by_step: dict[int, np.ndarray], plan: dict[int, np.ndarray]) -> list[str]:
    """One line per step that trained other samples than its planned batch, saying what it trained (another
    step's batch: again, behind or ahead of its place; or samples of no planned batch), then one per planned
    batch that no step trained."""
    key = lambda ids: tuple(sorted(ids.tolist()))  # noqa: E731 (a batch's samples, whatever their order)
    step_of = {key(ids): step for step, ids in reversed(plan.items())}  # the first step wins
    trained = {key(got) for got in got_by_step.values()}
    problems = []
    for step, got in got_by_step.items():
        other = step_of.get(key(got))
        if np.array_equal(got, plan[step]):
            continue
        if other == step:
            problems.append(f"step {step} trained its batch in another order")
        elif other is not None and other < step and key(got_by_step[other]) == key(got):
            problems.append(f"step {step} trained step {other}'s batch again (a repeated batch)")
        elif other is not None:
            problems.append(f"step {step} trained step {other}'s batch, {'behind' if other < step else 'ahead of'} "
                            f"its place")
        else:
            foreign = sorted(set(got.tolist()) - set(plan[step].tolist()))
            problems.append(f"step {step} trained samples outside its planned batch: {foreign[:8]}")
    return problems + [f"step {step}'s batch was never trained (a skipped batch)" for step in got_by_step
                       if key(plan[step]) not in trained]
