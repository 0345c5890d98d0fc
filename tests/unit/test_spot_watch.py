"""`behemoth spot-watch` against a fake metadata service (tests/fake_metadata.py): EC2's IMDSv2 notice (token,
404 until scheduled, the interruption's time as the deadline, a token renewed after a 401) and GCE's preempted
flag; a service it cannot reach is one error naming it. Its drain of a real Ray node mid-run:
tests/integration/test_fault_tolerance.py R7."""

import datetime
import threading
import time

import pytest
from behemoth.driver.commands import spot_watch
from behemoth.errors import ConfigError
from fake_metadata import FakeMetadata


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.close()


def test_the_ec2_notice_is_read_through_imdsv2_with_its_deadline(metadata):
    reader = spot_watch.source("aws", metadata.url)
    assert reader.read() is None and metadata.tokens == {"token-0"}
    when = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) + datetime.timedelta(seconds=120)
    metadata.aws_action = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
    notice = reader.read()
    assert notice.deadline == when.timestamp() and "terminate" in notice.detail and notice.cloud == "aws"
    metadata.tokens.clear()  # the service forgot the session (restarted): a 401, then a new token
    assert reader.read() == notice and metadata.tokens == {"token-0"}


def test_the_gce_preempted_flag_is_a_notice_with_thirty_seconds(metadata):
    reader = spot_watch.source("gce", metadata.url)
    assert reader.read() is None
    metadata.gce_preempted = True
    notice = reader.read()
    assert notice.cloud == "gce" and notice.deadline == pytest.approx(time.time() + 30, abs=2)


def test_the_watch_is_quiet_until_the_notice_and_refuses_a_service_it_cannot_read(metadata):
    reader = spot_watch.source("aws", metadata.url)
    assert spot_watch.wait_for_notice(reader, 0.05, stop_after_s=0.3) is None and metadata.reads >= 3
    timer = threading.Timer(0.3, lambda: setattr(metadata, "aws_action", {"action": "stop",
                                                                         "time": "2026-11-27T10:00:00Z"}))
    timer.start()
    notice = spot_watch.wait_for_notice(reader, 0.05, stop_after_s=10)
    assert notice.detail == "spot instance-action stop at 2026-11-27T10:00:00Z"
    closed = FakeMetadata()
    closed.close()
    with pytest.raises(ConfigError, match=rf"the gce metadata service at {closed.url} cannot be read.*--cloud"):
        spot_watch.wait_for_notice(spot_watch.source("gce", closed.url), 0.05)


def test_preemptions_have_a_budget_of_their_own(monkeypatch, tmp_path):
    """failure.max_preemptions reaches Ray Train as its preemption budget, apart from failure.max_failures (R7
    restarts after a drain with max_failures 0)."""
    import ray

    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import trainer
    from behemoth.job import config_from_dict
    from conftest import job_dict

    seen = {}
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ray_session, "set_ray_train_env", lambda: None)
    monkeypatch.setattr(ray_session, "torch_trainer", lambda fn, **kwargs: seen.update(kwargs))
    trainer.build_trainer(config_from_dict(job_dict(tmp_path, tmp_path, failure={"max_failures": 2,
                                                                                 "max_preemptions": 5})), data=None)
    budget = seen["run_config"].failure_config
    assert (budget.max_failures, budget.max_preemption_failures) == (2, 5)
    assert config_from_dict(job_dict(tmp_path, tmp_path)).failure.max_preemptions == -1  # spot runs: unlimited
    with pytest.raises(ConfigError, match="failure.max_preemptions must be >= 0"):
        config_from_dict(job_dict(tmp_path, tmp_path, failure={"max_preemptions": -2}))
