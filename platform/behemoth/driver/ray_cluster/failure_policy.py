"""Ray Train's failure policy, with one rule added: an error a retry cannot fix ends the run at once.

Ray Train restarts the worker group after any worker error, up to `failure.max_failures` times. For a corrupt
image over its budget, invalid UTF-8 in a text file or a config a worker rejects, every restart fails the same
way (the same samples come in the same order): the restarts only delay the one clear message, and print Ray's
tracebacks each time. `FailFastPolicy` raises at once when a worker failure carries one of
`errors.NOT_RETRIED` (found in the text of Ray's wrapped exceptions, as the CLI finds the message it prints),
and otherwise decides as Ray's default policy does (worker deaths, preemptions, controller errors).
For an elastic run it first refreshes the cluster view the next group is sized from (ray_internals/data.py
`refresh_elastic_view`): refreshed every 2 s while the run trains, it may still count the node just lost, and a
group sized with it waits out its placement timeout (10 s) before it is sized again (in the preemption storm: a
node lost 2 s after its replacement had joined; the next group asked for both).

Ray 2.60 has no public hook for a failure policy (FailureConfig only counts); `install()` replaces the
factory its trainer calls. The Ray version is pinned to that line (pyproject.toml).
"""

from __future__ import annotations

import time

from behemoth.ray_internals.core import node_logs_dir
from behemoth.ray_internals.data import refresh_elastic_view
from behemoth.ray_internals.train_v2 import (DefaultFailurePolicy, FailureDecision, node_terminated,
                                             preemption_error, set_failure_policy_factory, waiting_for_nodes)

from behemoth.errors import NOT_RETRIED, PreemptionExit, user_facing_error


class FailFastPolicy(DefaultFailurePolicy):
    """`replacement_wait_s` (failure.replacement_wait_s): how long the run may wait for the nodes a worker group
    needs (after a preemption or a lost node: a replacement the autoscaler has to launch, or spot capacity that
    is not there) before it fails; None waits as long as it takes (Ray Train's default)."""

    def __init__(self, failure_config, replacement_wait_s: float | None = None, clock=time.monotonic,
                 elastic: bool = False):
        super().__init__(failure_config)
        self.replacement_wait_s, self.clock, self.elastic = replacement_wait_s, clock, elastic
        self.waiting_since: float | None = None

    def make_decision(self, training_failed_error) -> FailureDecision:
        if self.elastic:
            _refresh_view()
        if (user_facing_error(training_failed_error, (PreemptionExit,)) is not None
                or node_terminated(training_failed_error)):
            # the group ended itself for a notice's preemption (worker/reporting.py), or a node of it was shut down
            # by its owner (a SIGTERM: a pod evicted, which Ray drains for preemption first; its worker's death is
            # marked preempted or not by a race in Ray): a preemption, as Ray Train counts those
            # (failure.max_preemptions), not a failure
            return super().make_decision(preemption_error())
        message = user_facing_error(training_failed_error, NOT_RETRIED)
        if message is not None:
            print(f"[behemoth] not retried (a restart would fail the same way; failure.max_failures is left "
                  f"unused): {message}{_where_tracebacks_are()}", flush=True)
            return FailureDecision.RAISE
        if not waiting_for_nodes(training_failed_error):
            self.waiting_since = None
        elif self.replacement_wait_s is not None:
            now = self.clock()
            self.waiting_since = now if self.waiting_since is None else self.waiting_since
            if now - self.waiting_since >= self.replacement_wait_s:
                print(f"[behemoth] no nodes for the worker group for {now - self.waiting_since:.0f} s, more than "
                      f"failure.replacement_wait_s={self.replacement_wait_s:g}: the run stops here (it resumes from "
                      f"its latest checkpoint when run again)", flush=True)
                return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


def _where_tracebacks_are() -> str:
    """Where Ray keeps the failed worker's full traceback (its log folder on the worker's node), as a suffix
    for the policy's line; the console leaves that traceback out (driver/ray_cluster/output_filter.py)."""
    try:
        logs = node_logs_dir()
        return f" (the worker's traceback: worker-*.err in {logs} of its node)" if logs else ""
    except Exception:  # noqa: BLE001 - a private Ray API: without it the line only lacks the pointer
        return ""


def _refresh_view() -> None:
    try:
        refresh_elastic_view()
    except Exception:  # noqa: BLE001  (a view not refreshed costs at most the placement timeout, as before)
        pass


def install(replacement_wait_s: float | None = None, elastic: bool = False) -> None:
    """Make Ray Train's trainers (created after this, in this process) use FailFastPolicy."""
    set_failure_policy_factory(lambda failure_config: FailFastPolicy(failure_config, replacement_wait_s,
                                                                     elastic=elastic))
