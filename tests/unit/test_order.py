"""The global sample order: exact resume and world-size independence are properties of these functions."""

import numpy as np

from behemoth.data.order import epoch_order, rank_eval_indices, rank_train_indices, steps_per_epoch

N, B = 103, 12  # 8 steps per epoch, 7 samples of the permutation's tail left out


def global_batches(world, epoch, start_step=0):
    """Reassemble the global batches from what each rank gets."""
    per_rank = [rank_train_indices(N, B, 7, epoch, r, world, start_step).reshape(-1, B // world)
                for r in range(world)]
    return np.concatenate(per_rank, axis=1)  # steps x B


def test_epoch_covers_each_sample_at_most_once_and_changes_per_epoch():
    batches = global_batches(world=3, epoch=0)
    assert batches.shape == (steps_per_epoch(N, B), B) == (8, 12)
    assert len(np.unique(batches)) == 96  # no repeats; the 7 left out are the permutation's tail
    np.testing.assert_array_equal(batches.reshape(-1), epoch_order(N, 7, 0)[:96])
    assert not np.array_equal(global_batches(3, 0), global_batches(3, 1))


def test_ranks_are_disjoint_slices_of_each_global_batch():
    parts = [rank_train_indices(N, B, 7, 0, r, 4) for r in range(4)]
    assert all(len(p) == 8 * 3 for p in parts)
    assert len(set(np.concatenate(parts))) == 96


def test_world_size_does_not_change_the_global_batches():
    for world in (1, 2, 3, 4, 6, 12):
        np.testing.assert_array_equal(global_batches(world, epoch=2), global_batches(1, epoch=2))


def test_resume_continues_with_exactly_the_remaining_samples():
    full = global_batches(2, epoch=1)
    for start in range(9):
        np.testing.assert_array_equal(global_batches(2, epoch=1, start_step=start), full[start:])
    # and resuming on a different world size gives the same remainder
    np.testing.assert_array_equal(global_batches(3, epoch=1, start_step=5), full[5:])


def test_eval_indices_cover_everything_once():
    for world in (1, 2, 5, 30):
        parts = [rank_eval_indices(24, r, world) for r in range(world)]
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(24))
