"""A worker failure that a restart would repeat (behemoth's data and config errors) ends the run at once; any
other failure is retried as Ray Train's default policy does (failure.max_failures)."""

from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

from behemoth.driver.failure_policy import FailFastPolicy, install


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
