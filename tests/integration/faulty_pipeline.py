"""A deliberately broken data pipeline, for showing that the sample-ledger audit catches one.

Ray Train workers import this module by name (the tests' Ray instance puts tests/ on their PYTHONPATH).
"""

from behemoth.worker.loop import train_loop_per_worker
from behemoth.tasks.causal_lm import CausalLM

REPEATED_AT = 3  # the 4th batch of every epoch pass is a second copy of the 3rd (and the real 4th is skipped)


def loop_with_a_repeated_batch(loop_config: dict) -> dict:
    """behemoth's own worker loop, over a text pipeline that delivers batch 3 where batch 4 belongs."""
    deliver = CausalLM.train_batches

    def repeating(self, indices, epoch, batch_size):
        previous = None
        for i, batch in enumerate(deliver(self, indices, epoch, batch_size)):
            yield previous if i == REPEATED_AT else batch
            previous = batch

    CausalLM.train_batches = repeating
    return train_loop_per_worker(loop_config)
