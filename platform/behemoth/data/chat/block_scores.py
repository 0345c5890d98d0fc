"""A pass over a split's packed blocks with a model, before training: Ray Data actors on the training workers'
resources (a GPU each where the run trains on GPUs), each building its scorer once, each batch of blocks scored
into one float32 array per block. DPO's reference log-probabilities are computed this way (tasks/preference.py),
so a full fine-tune never holds a second model while it trains.

The scorer comes from `factory()` (a picklable callable, run once in each actor): it takes the blocks' stored
tokens ([n, seq_len] int64) and returns one 1-D float32 array per block, at most `width` long (the rows travel
padded with NaN to that width: a tensor column).
"""

from __future__ import annotations

import numpy as np


def _gathered(batch: dict, blocks: list) -> dict:
    """A batch of block ids with the blocks' stored tokens (`blocks`: the store's object reference, in a list so
    that it travels as a reference)."""
    import ray

    ids = np.asarray(batch["id"], dtype=np.int64)
    return {"id": ids, "tokens": np.asarray(ray.get(blocks[0])[ids]).astype(np.int64)}


class _ScoringActor:
    def __init__(self, factory, width: int):
        self.score, self.width = factory(), width

    def __call__(self, batch: dict) -> dict:
        rows = np.full((len(batch["id"]), self.width), np.nan, np.float32)
        for row, s in zip(rows, self.score(np.array(batch["tokens"], dtype=np.int64))):  # (writable: torch wants it)
            row[:len(s)] = s
        return {"id": batch["id"], "scores": rows}


def score_blocks(blocks, factory, width: int, actors: int, batch_size: int, num_gpus: float = 0.0,
                 num_cpus: float = 1.0) -> list[np.ndarray]:
    """Each block's scores, in block order (`blocks`: a split's token store, `len` and `blocks[ids]`). Needs Ray."""
    import ray
    import ray.data

    from behemoth.data.pipeline import ordered_data_context

    ordered_data_context()
    if len(blocks) == 0:
        return []
    ds = ray.data.range(len(blocks), override_num_blocks=max(1, min(len(blocks) // batch_size, 4 * actors)))
    # (the tokens gathered by tasks: an actor whose arguments hold an object reference is one Ray will not
    # restart, and says so)
    gathered = ds.map_batches(_gathered, fn_kwargs={"blocks": [ray.put(blocks)]}, batch_size=batch_size,
                              batch_format="numpy", num_cpus=0.25)
    scored = gathered.map_batches(_ScoringActor, fn_constructor_kwargs={"factory": factory, "width": width},
                                  batch_size=batch_size, batch_format="numpy", num_gpus=num_gpus, num_cpus=num_cpus,
                                  compute=ray.data.ActorPoolStrategy(size=actors))
    out: list[np.ndarray | None] = [None] * len(blocks)
    for batch in scored.iter_batches(batch_format="numpy", batch_size=None):
        for i, row in zip(batch["id"].tolist(), batch["scores"]):
            out[i] = row[~np.isnan(row)]
    return out
