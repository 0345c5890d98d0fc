"""The global sample order: a pure function of (seed, epoch), sharded per global batch over the ranks.

Ray Data cannot checkpoint an iterator (2.60), so behemoth owns the order. Every epoch is a permutation of
the global sample indices drawn from (seed, epoch). Step g of the epoch trains on the global batch
order[g*B:(g+1)*B]; rank r of W takes the r-th of its W equal slices. Consequences:

- resuming at step g of an epoch continues with exactly the samples not yet trained on, in the same order;
- a different world size (elastic) trains on the same global batches in the same order;
- the last `num_samples % B` samples of each epoch's permutation are not trained on in that epoch (a
  different tail each epoch, since the permutation changes).
"""

from __future__ import annotations

import numpy as np


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    return num_samples // global_batch_size


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of global sample indices for one epoch."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def rank_train_indices(
    num_samples: int, global_batch_size: int, seed: int, epoch: int,
    rank: int, world_size: int, start_step: int = 0,
) -> np.ndarray:
    """Global sample indices rank `rank` trains on from `start_step` to the end of `epoch`, in order.

    The result holds (steps - start_step) consecutive micro-batches of global_batch_size // world_size.
    """
    if global_batch_size % world_size:
        raise ValueError(f"global batch {global_batch_size} does not split over {world_size} workers")
    steps = steps_per_epoch(num_samples, global_batch_size)
    per_rank = global_batch_size // world_size
    order = epoch_order(num_samples, seed, epoch)[: steps * global_batch_size]
    return order.reshape(steps, world_size, per_rank)[start_step:, rank].reshape(-1)


def rank_eval_indices(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """Contiguous, disjoint slices that together cover every evaluation sample exactly once."""
    return np.array_split(np.arange(num_samples), world_size)[rank]
