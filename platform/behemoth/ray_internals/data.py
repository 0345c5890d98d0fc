"""Ray Data's internals behemoth relies on. Read against Ray 2.60.0 (ray/data/_internal/...;
ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py).

On a Ray upgrade: the streaming executor's scheduling loop step and consumer-idle test (pace_scheduling_loop
leaves a Ray without them as it is), the stats actor's getter, the coordinator's actor name, the progress
logger's name, the coordinator's tick and its `recompute` (refresh_elastic_view).
"""

from __future__ import annotations

import logging
import time

# Ray's autoscaling coordinator: one detached actor per cluster, (name, namespace)
AUTOSCALING_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")


def refresh_elastic_view(coordinator=None) -> bool:
    """Make the cluster view Ray Train's elastic scaling policy sizes worker groups from current, now.

    The policy (train/v2/_internal/execution/scaling_policy/elastic.py) reads Ray Data's AutoscalingCoordinator
    actor's reservations every second, but that actor re-reads the cluster's nodes only every 20 s
    (DefaultAutoscalingCoordinator.TICK_INTERVAL_S): a node gone or joined is seen up to 20 s late, so an elastic
    run's next group is sized with a node that is gone (and waits out its placement timeout) and a replacement
    node stays unused. `get_reserved_resources(..., recompute=True)` runs the actor's tick at once. `coordinator`:
    that actor's handle (default: Ray's named one). False where none exists yet (Ray Train creates it with an
    elastic run's first group) or this Ray has no such call."""
    import ray

    if coordinator is None:
        try:
            coordinator = ray.get_actor(AUTOSCALING_COORDINATOR[0], namespace=AUTOSCALING_COORDINATOR[1])
        except ValueError:
            return False
    try:
        ray.get(coordinator.get_reserved_resources.remote("behemoth-elastic-view", recompute=True), timeout=10)
    except TypeError:  # (a Ray without `recompute`)
        return False
    return True


# Ray Data runs a dataset's scheduling loop in a thread of the process that iterates it: for behemoth's
# pipelines, the training worker. Ray 2.60's loop blocks only in ray.wait on running tasks, which returns at
# once when finished tasks' outputs are held back by backpressure (the consumer, training, is the slow side):
# it then spins, updating resource budgets and Prometheus gauges without pause, and competes with the training
# thread for the GIL and the core. While the consumer has batches waiting (it is not idle), nothing the loop
# could do is urgent: behemoth paces it to one step per SCHEDULER_PAUSE_S. When the consumer waits for data,
# the loop runs at full speed.
SCHEDULER_PAUSE_S = 0.02


def pace_scheduling_loop() -> None:
    """Install the pacing above (once per process; a Ray without this private loop is left as it is)."""
    try:
        from ray.data._internal.execution.streaming_executor import StreamingExecutor
    except ImportError:
        return
    step = getattr(StreamingExecutor, "_scheduling_loop_step", None)
    if step is None or getattr(step, "paced_by_behemoth", False) or not hasattr(StreamingExecutor, "_consumer_idling"):
        return

    def paced_step(self, topology):
        go_on = step(self, topology)
        if go_on and not self._consumer_idling():
            time.sleep(SCHEDULER_PAUSE_S)
        return go_on

    paced_step.paced_by_behemoth = True
    StreamingExecutor._scheduling_loop_step = paced_step


def quiet_progress_notice() -> None:
    """With the bars off, Ray Data says once per process how to turn them back on: not news in a behemoth run."""
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def start_stats_actor() -> None:
    """Ray Data's named, detached stats actor, created (or found) from this process; returns at once."""
    from ray.data._internal.stats import get_or_create_stats_actor

    get_or_create_stats_actor()
