"""A worker failure that a restart would repeat (behemoth's data and config errors) ends the run at once; any
other failure is retried as Ray Train's default policy does (failure.max_failures)."""

from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

from behemoth.driver.ray_cluster.failure_policy import FailFastPolicy, install


def failed(text: str) -> WorkerGroupError:
    # as the controller sees it: the worker's exception re-raised by Ray, its type and message in the text
    return WorkerGroupError("worker group failed", {1: RuntimeError(f"ray::RayTrainWorker.run_train_fn()\n{text}")})


def test_data_and_config_errors_are_not_retried(capsys):
    policy = FailFastPolicy(FailureConfig(max_failures=3))
    bad = "behemoth.errors.BadSampleError: cannot decode image /data/cat/1.png (data.max_bad_samples=0)"
    assert policy.make_decision(failed(bad)) == FailureDecision.RAISE
    assert "not retried" in capsys.readouterr().out
    assert policy.make_decision(failed("DataError: data.root /x: no such folder")) == FailureDecision.RAISE
    assert policy.make_decision(failed("ConfigError: model.name 'x' is unknown")) == FailureDecision.RAISE


def test_other_failures_use_max_failures():
    policy = FailFastPolicy(FailureConfig(max_failures=2))
    crash = failed("ray.exceptions.ActorDiedError: The actor died unexpectedly")
    assert [policy.make_decision(crash) for _ in range(3)] == [FailureDecision.RETRY] * 2 + [FailureDecision.RAISE]
    # a checkpoint error may be a full disk or a storage hiccup: retried
    assert FailFastPolicy(FailureConfig(max_failures=1)).make_decision(
        failed("CheckpointError: could not write")) == FailureDecision.RETRY


def test_installed_for_the_trainers_ray_builds():
    from ray.train.v2.api import data_parallel_trainer

    install()
    assert isinstance(data_parallel_trainer.create_failure_policy(FailureConfig()), FailFastPolicy)


def test_the_wait_for_nodes_is_bounded_by_failure_replacement_wait_s(capsys):
    """Ray Train retries a worker group it cannot place (its placement group not ready within
    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) without limit; failure.replacement_wait_s stops the run once the
    nodes have been missing that long. A group that started in between (any other failure) starts the count again;
    without the key the run waits as Ray Train does."""
    import pickle

    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2.api.exceptions import ControllerError

    now = [0.0]
    policy = FailFastPolicy(FailureConfig(max_failures=1), replacement_wait_s=150, clock=lambda: now[0])
    no_nodes = ControllerError(WorkerGroupStartupTimeoutError(num_workers=8))
    decisions = []
    for at in (0, 60, 120):
        now[0] = at
        decisions.append(policy.make_decision(no_nodes))
    assert decisions == [FailureDecision.RETRY] * 3
    assert policy.make_decision(failed("ray.exceptions.ActorDiedError: The actor died")) == FailureDecision.RETRY
    now[0] = 180
    assert policy.make_decision(no_nodes) == FailureDecision.RETRY  # counted again from here
    now[0] = 330
    assert policy.make_decision(no_nodes) == FailureDecision.RAISE
    assert "no nodes for the worker group for 150 s, more than failure.replacement_wait_s=150" in capsys.readouterr().out
    patient = FailFastPolicy(FailureConfig(max_failures=0), clock=lambda: now[0])
    assert all(patient.make_decision(no_nodes) == FailureDecision.RETRY for now[0] in (0, 10_000, 10**6))
    install(replacement_wait_s=30)  # what the trainer installs travels to Ray Train's controller (pickled)
    from ray.train.v2.api import data_parallel_trainer

    shipped = pickle.loads(pickle.dumps(data_parallel_trainer.create_failure_policy(FailureConfig())))
    assert isinstance(shipped, FailFastPolicy) and shipped.replacement_wait_s == 30


def test_a_group_that_ends_itself_for_a_preemption_is_charged_to_the_preemption_budget():
    """Issue 73: after a notice the workers train on, checkpoint before the deadline and end the group
    (PreemptionExit). Ray Train sees a worker error; the policy counts it as a preemption (failure.max_preemptions),
    never against failure.max_failures: a spot run with max_failures 0 goes on through it."""
    policy = FailFastPolicy(FailureConfig(max_failures=0, max_preemption_failures=2))
    ended = failed("behemoth.errors.PreemptionExit: the worker group ends for a preemption, its last checkpoint "
                   "at step 37 written before the node's deadline; the run goes on from it")
    assert [policy.make_decision(ended) for _ in range(3)] == [FailureDecision.RETRY] * 2 + [FailureDecision.RAISE]
    crash = failed("ray.exceptions.ActorDiedError: The actor died unexpectedly")
    assert FailFastPolicy(FailureConfig(max_failures=0)).make_decision(crash) == FailureDecision.RAISE


def test_a_worker_whose_node_was_shut_down_by_sigterm_is_a_preemption_where_ray_did_not_mark_it_preempted():
    """A pod evicted (R8): `ray start` drains its node for preemption on SIGTERM and ends it at the deadline. The
    worker there dies with its node; Ray marks its error preempted or not depending on which reaches its control
    store first (the drain's deadline, or the raylet's own "received SIGTERM": what the full tier met once, and
    a run with max_failures 0 failed). Unmarked, it is still a preemption (failure.max_preemptions); a node lost
    without a SIGTERM stays a failure."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    died = RuntimeError("The actor died unexpectedly before finishing this task.\nThe actor died because its node "
                        "has died. Node Id: 53ea146a\n\tthe actor's node was terminated expectedly: received SIGTERM")
    evicted = WorkerGroupError("worker group failed", {1: WorkerHealthCheckFailedError("A worker health check "
                                                                                        "failed.", died)})
    policy = FailFastPolicy(FailureConfig(max_failures=0, max_preemption_failures=1))
    assert [policy.make_decision(evicted) for _ in range(2)] == [FailureDecision.RETRY, FailureDecision.RAISE]
    lost = failed("The actor died because its node has died. Node Id: 53ea146a\n\tthe actor's node was terminated "
                  "unexpectedly: health check failed due to missing too many heartbeats")
    assert FailFastPolicy(FailureConfig(max_failures=0)).make_decision(lost) == FailureDecision.RAISE


def test_an_elastic_runs_policy_refreshes_the_cluster_view_before_each_decision(monkeypatch):
    """The next group of an elastic run is sized from the view refreshed at the failure (not one that may
    still count the node just lost); a refresh that fails leaves the decision as it was; a fixed-size run's
    policy never refreshes."""
    from behemoth.driver.ray_cluster import failure_policy

    calls = []
    monkeypatch.setattr(failure_policy, "refresh_elastic_view", lambda: calls.append(1) or True)
    crash = failed("ray.exceptions.ActorDiedError: The actor died unexpectedly")
    elastic = FailFastPolicy(FailureConfig(max_failures=2), elastic=True)
    assert [elastic.make_decision(crash) for _ in range(2)] == [FailureDecision.RETRY] * 2 and len(calls) == 2
    assert FailFastPolicy(FailureConfig(max_failures=2)).make_decision(crash) == FailureDecision.RETRY
    assert len(calls) == 2

    def down():
        raise RuntimeError("the coordinator is restarting")

    monkeypatch.setattr(failure_policy, "refresh_elastic_view", down)
    assert FailFastPolicy(FailureConfig(max_failures=0), elastic=True).make_decision(crash) == FailureDecision.RAISE
