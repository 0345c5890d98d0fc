"""Deliberately broken data pipelines, for showing that the sample-ledger audit catches one.

Ray Train workers import this module by name (the tests' Ray instance puts tests/ on their PYTHONPATH).
"""

from behemoth.worker.loop import train_loop_per_worker
from behemoth.tasks.causal_lm import CausalLM

BROKEN_AT = 3  # the 4th batch of every epoch pass is the one the pipeline gets wrong


def loop_with_a_repeated_batch(loop_config: dict) -> dict:
    """behemoth's own worker loop, over a text pipeline that delivers batch 3 again where batch 4 belongs
    (the real 4th is never delivered)."""
    return _loop_over(loop_config, lambda i, batch, previous: previous if i == BROKEN_AT else batch)


def loop_with_a_skipped_batch(loop_config: dict) -> dict:
    """behemoth's own worker loop, over a text pipeline that drops batch 4 (the later ones come a step early)."""
    return _loop_over(loop_config, lambda i, batch, previous: None if i == BROKEN_AT else batch)


def _loop_over(loop_config: dict, deliver_instead) -> dict:
    """The loop, its text batches passed through `deliver_instead(i, batch, previous)` (None: deliver none)."""
    deliver = CausalLM.train_batches

    def broken(self, indices, epoch, batch_size):
        previous = None
        for i, batch in enumerate(deliver(self, indices, epoch, batch_size)):
            instead = deliver_instead(i, batch, previous)
            if instead is not None:
                yield instead
            previous = batch

    CausalLM.train_batches = broken
    return train_loop_per_worker(loop_config)
