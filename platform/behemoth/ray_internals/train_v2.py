"""Ray Train V2's internals behemoth builds on. Read against Ray 2.60.0
(ray/train/v2/_internal/...; ray/train/v2/api/data_parallel_trainer.py).

Ray Train 2.60 has no public interface for these: callbacks inside its controller and worker context (the run
recorder, the lease fence), a failure policy (FailureConfig only counts), the default callbacks a trainer
starts, and the environment its workers get. On a Ray upgrade, check each name below still means the same.
"""

from __future__ import annotations

import logging

from ray.train.v2._internal.callbacks import DatasetsCallback, placement_group_callback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.callback import (ControllerCallback, ReportCallback, TrainContextCallback,
                                                       WorkerCallback)
from ray.train.v2._internal.execution.controller import placement_group_cleaner
from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

__all__ = ["ControllerCallback", "DatasetsCallback", "DefaultFailurePolicy", "FailureDecision",
           "WorkerGroupStartupTimeoutError", "waiting_for_nodes",
           "PlacementGroupCleaner", "PlacementGroupCleanerCallback", "ReportCallback", "TrainContextCallback",
           "WorkerCallback",
           "cleaner_reads_gcs", "launch_placement_group_cleaner", "node_terminated", "preemption_error",
           "preemption_notice",
           "quiet_report_log",
           "set_failure_policy_factory",
           "worker_environment"]


def waiting_for_nodes(training_failed_error) -> bool:
    """Whether Ray Train's controller gave up one attempt to place a worker group (its placement group not ready
    within RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S: the nodes are not there yet); it retries such attempts without
    limit by default (controller_failure_limit -1)."""
    return isinstance(getattr(training_failed_error, "controller_failure", None), WorkerGroupStartupTimeoutError)


# How Ray 2.60 says a worker died with its node when the node was shut down by a SIGTERM (its raylet's death
# message, in the ActorDiedError the worker's health check wraps). `ray start` drains a node for preemption on
# SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: Kubernetes evicting a pod) and ends it at the drain's deadline;
# whether the worker's error is then marked preempted depends on which reaches the control store first, the
# raylet's own "received SIGTERM" or the drain's deadline (AUTOSCALER_DRAIN_PREEMPTED).
NODE_TERMINATED_BY_SIGTERM = "node was terminated expectedly: received SIGTERM"


def node_terminated(training_failed_error) -> bool:
    """Whether a worker group failed because a node of it was shut down by a SIGTERM (its owner took it back)."""
    failures = getattr(training_failed_error, "worker_failures", None) or {}
    return any(NODE_TERMINATED_BY_SIGTERM in str(error) for error in failures.values())


def preemption_error():
    """Ray Train's PreemptionError (what its controller raises after waiting out a preemption), for a group that
    ended itself before the deadline: a failure policy charges it to the preemption budget."""
    from ray.train.v2.api.exceptions import PreemptionError
    from ray.train.v2.api.preemption import PreemptionInfo

    return PreemptionError(PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={}), drain_timed_out=False)


def set_failure_policy_factory(create) -> None:
    """Make Ray Train's trainers (created after this, in this process) build their failure policy with
    `create(failure_config)` (the factory DataParallelTrainer calls)."""
    from ray.train.v2.api import data_parallel_trainer

    data_parallel_trainer.create_failure_policy = create


def launch_placement_group_cleaner(cleaner_class) -> None:
    """The class PlacementGroupCleanerCallback launches as its cleaner actor (read when the controller starts)."""
    placement_group_callback.PlacementGroupCleaner = cleaner_class


def cleaner_reads_gcs() -> None:
    """Make Ray Train's placement-group cleaner, in this process (the cleaner actor's own), ask GCS's actor table
    whether the run's controller is alive. Ray 2.60's cleaner asks the state API (`is_actor_alive`, imported into
    its module), which needs Ray's dashboard: on an instance without one every check raised, the cleaner logged
    "Failed to query Ray Train Controller actor state" to the driver's console once a second for the whole run,
    and never saw a dead controller (whose workers' resources it exists to free). GCS answers without the
    dashboard; an actor it does not know counts as dead, as in Ray's check. A failed read is raised as the state
    API's error, which Ray's loop logs before it checks again (anything else would end its monitor thread)."""
    from ray.util.state.exception import RayStateApiException

    from behemoth.ray_internals.core import gcs_state

    def alive(actor_id: str, timeout: float) -> bool:  # (timeout: Ray's state API call's; GCS's own applies)
        try:
            return gcs_state().actor_table(actor_id).get("State", "DEAD") != "DEAD"
        except Exception as e:  # noqa: BLE001 - GCS unreachable for a moment (a head restarting)
            raise RayStateApiException(f"GCS's actor table: {e}") from e

    placement_group_cleaner.is_actor_alive = alive


def worker_environment() -> dict:
    """The variables Ray Train gives its training workers (DataParallelTrainer._initialize_and_run_controller,
    WorkerGroup._get_worker_runtime_env): the RAY_TRAIN_* variables it propagates from the driver and the
    one its controller adds."""
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                                                  get_env_vars_to_propagate)

    return {RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR: DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            **get_env_vars_to_propagate()}


def preemption_notice():
    """This Ray Train worker's own preemption notice: a PreemptionInfo (deadline_ms, preempted nodes and ranks)
    once Ray Train's watcher saw a drain of a node of its worker group (it tells every worker), else None.
    ray.train.get_preemption_info returns the same after broadcasting rank 0's through an actor barrier;
    behemoth's ranks agree in the all-reduce their report step makes anyway (worker/reporting.py)."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


def quiet_report_log() -> None:
    """Ray Train logs every report at INFO from a logger named by its worker context module's file path (not
    under `ray.train`, so RunConfig's LoggingConfig cannot filter it): WARNING and up only."""
    from ray.train.v2._internal.execution import context as train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
