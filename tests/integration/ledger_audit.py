"""The sample-ledger audit shared by the failure tests and the broken-pipeline test (train.sample_ledger).

A ledger records, per rank and trained step, the sample ids of the batches the step actually trained on.
For each step, the records of the last worker group that trained it are what the final weights were trained
on: the audit checks that they give every step exactly its global batch of the uninterrupted order (seed 0),
and counts the steps trained by more than one group.
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
    records = read_ledger(folder)
    groups = list(dict.fromkeys(r["group"] for r in records if r["rank"] == 0))  # rank 0's file: time order
    by_step = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_step[r["step"]][r["group"]].append(r)
    epoch_steps = steps_per_epoch(n_samples, batch)
    worlds, redone, losses, group_losses = {}, [], {}, {}
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
        epoch, g = divmod(step - 1, epoch_steps)
        expected = epoch_order(n_samples, 0, epoch)[g * batch:(g + 1) * batch]
        np.testing.assert_array_equal(got, expected, err_msg=f"step {step}")
        worlds[step] = world
    return {"redone": redone, "worlds": worlds, "records": records, "losses": losses,
            "group_losses": group_losses}
