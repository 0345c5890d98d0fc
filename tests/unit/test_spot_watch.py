"""`behemoth spot-watch` against a fake metadata service (tests/fake_metadata.py): EC2's IMDSv2 notice (token,
404 until scheduled, the interruption's time as the deadline, a token renewed after a 401) and GCE's preempted
flag; a service it cannot reach is one error naming it. What a service may send that no cloud does (issue 72): a
deadline a year ahead or in 1900, a notice that is not one, an answer a byte at a time or without end; the
worker's hold bounded whatever deadline reaches it. Its drain of a real Ray node mid-run:
tests/integration/test_fault_tolerance.py R7."""

import datetime
import re
import threading
import time

import pytest
from behemoth.driver.commands import spot_watch
from behemoth.driver.commands.cli import build_parser
from behemoth.errors import ConfigError
from fake_metadata import STREAM_LIMIT, FakeMetadata


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.close()


def _iso(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


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
    when = _iso(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60))
    timer = threading.Timer(0.3, lambda: setattr(metadata, "aws_action", {"action": "stop", "time": when}))
    timer.start()
    notice = spot_watch.wait_for_notice(reader, 0.05, stop_after_s=10)
    assert notice.detail == f"spot instance-action stop at {when}"  # (a minute ahead: the deadline as given)
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
    monkeypatch.setattr(ray_session, "set_ray_train_env", lambda elastic=False: None)
    monkeypatch.setattr(ray_session, "torch_trainer", lambda fn, **kwargs: seen.update(kwargs))
    trainer.build_trainer(config_from_dict(job_dict(tmp_path, tmp_path, failure={"max_failures": 2,
                                                                                 "max_preemptions": 5})), data=None)
    budget = seen["run_config"].failure_config
    assert (budget.max_failures, budget.max_preemption_failures) == (2, 5)
    assert config_from_dict(job_dict(tmp_path, tmp_path)).failure.max_preemptions == -1  # spot runs: unlimited
    with pytest.raises(ConfigError, match="failure.max_preemptions must be >= 0"):
        config_from_dict(job_dict(tmp_path, tmp_path, failure={"max_preemptions": -2}))


def test_an_elastic_run_sizes_its_next_group_again_after_10_s_not_60(monkeypatch, tmp_path):
    """Issue 73: Ray Train sizes an elastic run's next group from the resources Ray lists, a node lost a moment
    ago among them, and that group waited 60 s for its placement (every restart in the storm). The elastic run's
    driver sets Ray Train's placement wait to 10 s (propagated to its controller); a fixed-size run keeps Ray's;
    a value the user sets wins."""
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import trainer
    from behemoth.job import config_from_dict
    from conftest import job_dict
    import ray

    env = ray_session.PLACEMENT_WAIT_ENV
    monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(ray_session, "_placement_wait_set_here", False)
    monkeypatch.setattr(ray, "put", lambda value: value)
    propagated = {}

    def trainer_made(fn, **kwargs):  # what Ray Train hands its controller: the driver's RAY_TRAIN_* variables
        from ray.train.v2._internal.constants import get_env_vars_to_propagate

        propagated.clear()
        propagated.update(get_env_vars_to_propagate())

    monkeypatch.setattr(ray_session, "torch_trainer", trainer_made)
    elastic = config_from_dict(job_dict(tmp_path, tmp_path, scaling={"num_workers": [1, 2]}))
    fixed = config_from_dict(job_dict(tmp_path, tmp_path))
    trainer.build_trainer(elastic, data=None)
    assert propagated[env] == "10"
    trainer.build_trainer(fixed, data=None)
    assert env not in propagated  # Ray's own 60 s
    monkeypatch.setenv(env, "33")
    trainer.build_trainer(elastic, data=None)
    assert propagated[env] == "33"


def test_an_elastic_runs_fit_keeps_ray_trains_view_of_the_cluster_fresh(monkeypatch, tmp_path):
    """Issue 73 item 2: Ray Train sizes an elastic run's groups from a view of the nodes Ray refreshes every 20 s
    (a lost node counted, a replacement unused, for up to that long). While an elastic run's fit runs, the driver
    refreshes it every ELASTIC_VIEW_REFRESH_S, on through a failed refresh; a fixed-size run starts no thread."""
    import threading
    import time

    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import trainer
    from behemoth.job import config_from_dict
    from behemoth.ray_internals import data as ray_data_internals
    from conftest import job_dict

    calls = []

    def refresh():
        calls.append(time.time())
        if len(calls) == 2:
            raise RuntimeError("the coordinator restarting")
        return True

    monkeypatch.setattr(ray_data_internals, "refresh_elastic_view", refresh)
    monkeypatch.setattr(ray_session, "ELASTIC_VIEW_REFRESH_S", 0.05)
    running = {}

    class Fit:
        def fit(self):
            running["threads"] = {t.name for t in threading.enumerate()}
            time.sleep(0.5)
            return type("Result", (), {"best_checkpoints": [], "return_value": {}})()

    monkeypatch.setattr(trainer, "build_trainer", lambda *a, **k: Fit())
    monkeypatch.setattr(trainer, "withdraw_killed_drivers_requests", lambda *a: None)
    monkeypatch.setattr(ray_session, "warm_up_data_processes", lambda *a: [])
    tracking = type("Tracking", (), {"run_dir": tmp_path, "invocation": None, "callbacks": lambda self: []})()
    launcher = trainer.RayTrainLauncher(tracking, None, False, None)
    for workers, refreshed in (([1, 2], True), (2, False)):
        calls.clear()
        cfg = config_from_dict(job_dict(tmp_path, tmp_path, scaling={"num_workers": workers}))
        launcher.launch(type("Run", (), {"cfg": cfg})(), None)
        assert ("behemoth-elastic-view" in running["threads"]) == refreshed
        assert (len(calls) >= 4) == refreshed, calls  # (on past the failed second)
        time.sleep(0.2)
        assert not any(t.name == "behemoth-elastic-view" for t in threading.enumerate())  # ended with the fit


def test_a_deadline_a_year_ahead_is_taken_as_ten_minutes_and_one_in_1900_as_now(metadata):
    """Issue 72 item 3: a notice a year ahead drained the node with a 31,536,000 s deadline (the run held for a
    year); one in 1900 is a deadline Ray refuses. Both are moved into [now, now + 600 s], the line says so. (An
    `action` holding a newline is said by its repr: the line stays one.)"""
    reader = spot_watch.source("aws", metadata.url)
    now = datetime.datetime.now(datetime.timezone.utc)
    metadata.aws_action = {"action": "terminate", "time": _iso(now + datetime.timedelta(days=365))}
    notice = spot_watch.wait_for_notice(reader, 0.05)
    assert notice.deadline - time.time() == pytest.approx(600, abs=5)  # (spot_watch.MAX_NOTICE_AHEAD_S)
    assert re.fullmatch(r"spot instance-action terminate at \S+Z \(3153[56]\d{3} s ahead, more than any cloud's "
                        r"notice: taken as 600 s\)", notice.detail), notice.detail
    metadata.aws_action = {"action": "terminate\n[behemoth spot-watch] a line of its own",
                           "time": "1900-01-01T00:00:00Z"}
    notice = spot_watch.wait_for_notice(reader, 0.05)
    assert notice.deadline == pytest.approx(time.time(), abs=5)
    assert re.fullmatch(r"spot instance-action 'terminate\\n[^\n]{28} at 1900-01-01T00:00:00Z \(\d+ s ago: taken as "
                        r"now\)", notice.detail), notice.detail  # (the action on the one line: its repr, 40 characters)


@pytest.mark.parametrize("sent, what", [
    ('[{"action": "terminate", "time": "2026-11-27T10:00:00Z"}]', "not a JSON object with a string 'time'"),
    ('{"action": "terminate", "time": 1795000000}', "not a JSON object with a string 'time'"),
    ("[" * 60000, "not JSON"),  # (a RecursionError in json; 100,000 deep is now refused by its size)
    ('{"action": "terminate", "time": "soon"}', "its 'time' is not an ISO time"),
], ids=["list", "numeric-time", "deep", "not-a-time"])
def test_a_malformed_notice_is_one_line_naming_it_and_the_watch_goes_on(metadata, capsys, sent, what):
    """Issue 72 item 5: a notice that is a list, a numeric `time` or JSON nested 60,000 deep ended the watcher
    (a TypeError, AttributeError, RecursionError: its loop caught none), leaving its node unwatched; one whose time
    is no time was an error blaming --cloud at the first read and nothing at the next. Now one line naming what
    the service sent, once, and the watch goes on to the notice that follows."""
    metadata.aws_action = sent
    reader = spot_watch.source("aws", metadata.url)
    when = _iso(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60))
    timer = threading.Timer(0.5, lambda: setattr(metadata, "aws_action", {"action": "terminate", "time": when}))
    timer.start()
    notice = spot_watch.wait_for_notice(reader, 0.05, stop_after_s=10)
    assert notice.detail == f"spot instance-action terminate at {when}" and metadata.reads >= 4
    err = capsys.readouterr().err
    shown = repr(sent[:100]) + ("..." if len(sent) > 100 else "")
    assert err.count("\n") == 1 and err.endswith(f"the aws metadata service at {metadata.url} sent a notice this "
                                                  f"watcher cannot read ({shown}: {what}); watching on\n"), err


def test_an_endless_answer_is_read_no_further_than_its_bound(metadata, capsys):
    """An answer without end (a body of '[' sent as fast as loopback takes it) is read to MAX_ANSWER_BYTES + 1 and
    the connection dropped, one line saying so (before: read to its end, all of it in memory; here the server's
    STREAM_LIMIT, then a RecursionError ended the watcher)."""
    metadata.stream = ("body", b"[" * 65536, 0.0)
    reader = spot_watch.source("aws", metadata.url)
    with pytest.raises(Exception) as e:
        reader.read()
    assert metadata.stream_ended.wait(10)
    assert metadata.stream_cut and metadata.streamed < STREAM_LIMIT, f"the read took {metadata.streamed} bytes"
    assert e.type.__name__ == "MalformedNotice" and re.match(r"more than 65536 bytes, beginning '\[\[\[", str(e.value))
    assert spot_watch.wait_for_notice(reader, 0.05, stop_after_s=0.2) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read (more than {spot_watch.MAX_ANSWER_BYTES} bytes, beginning '[[[" in err


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_read_is_bounded_whole_against_a_server_sending_a_byte_at_a_time(metadata, part):
    """Issue 72 item 5: a server sending a byte every 1.5 s held the watcher for good: urllib's timeout (2 s) bounds
    each socket read, not the request. Here a byte every 0.3 s, in the headers or the body, against a 1 s deadline
    for the whole read: a TimeoutError within it (then retried quietly; at the first read, the error naming the
    service)."""
    metadata.stream = (part, b"x", 0.3)
    reader = spot_watch.GceNotice(metadata.url, timeout_s=1.0)
    outcome = {}

    def read():
        try:
            outcome["notice"] = reader.read()
        except Exception as e:  # noqa: BLE001 - looked at below
            outcome["error"] = e

    began = time.monotonic()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), f"a byte every 0.3 s in the {part} held a read with a 1 s deadline past 10 s"
    assert isinstance(outcome.get("error"), TimeoutError) and time.monotonic() - began < 3, outcome
    with pytest.raises(ConfigError, match=rf"the gce metadata service at {metadata.url} cannot be read \(no whole "
                                          r"answer within the read's deadline\)"):
        spot_watch.wait_for_notice(reader, 0.05)


def test_the_metadata_url_must_be_plain_http():
    """The watcher speaks plain HTTP to its instance's own service (a bounded request of its own, no proxy)."""
    for url in ("https://169.254.169.254", "169.254.169.254", "http://host:99999", "http://:80"):
        with pytest.raises(ConfigError, match=rf"^--metadata-url '{re.escape(url)}': give the metadata service's "
                                              r"plain HTTP address"):
            spot_watch.source("aws", url)


@pytest.mark.parametrize("interval", ["-1", "nan", "0", "inf", "31"])
def test_an_interval_that_is_not_one_is_refused_in_one_line(capsys, interval):
    """Issue 72 item 5: `--interval -1` or `nan` ended the watcher at its first sleep (a ValueError), after it had
    found its node; 0 asks the service without pause; more than 30 s could read GCE's notice after its VM went."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["spot-watch", "--cloud", "aws", "--interval", interval])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"behemoth spot-watch: error: argument --interval: "
                                                       f"{interval!r}: give seconds between two reads, more than 0 "
                                                       f"and at most 30")
    assert build_parser().parse_args(["spot-watch", "--cloud", "aws", "--interval", "0.2"]).interval == 0.2


def _refused(capsys, *args) -> str:
    from behemoth.driver.commands.cli import main

    assert main(["spot-watch", "--cloud", "aws", "--metadata-url", "http://127.0.0.1:9", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("behemoth: config error: ") and err.count("\n") == 1, err
    return err


def test_no_ray_on_this_node_or_an_address_that_is_not_one_is_one_line_saying_what_to_do(monkeypatch, capsys):
    """Started before `ray start`: Ray's raw ConnectionError ("Could not find any running Ray instance"); `--address
    foo` (or RAY_ADDRESS=foo): its raw ValueError ("Invalid address format"). No Ray is started: the node's own
    Ray is looked for where Ray looks (its processes, its session file), here found empty."""
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    assert ("Could not find any running Ray instance on this node: start the watcher after `ray start` on this "
            "node" in _refused(capsys))
    for address in ("foo", "host:port", "host:0", ":6379"):
        assert (f"--address {address!r}: give the cluster's GCS address as HOST:PORT"
                in _refused(capsys, "--address", address))
    monkeypatch.setenv("RAY_ADDRESS", "foo")
    assert "RAY_ADDRESS 'foo': Invalid address format: foo: give the cluster's GCS address as HOST:PORT" in _refused(
        capsys)


def test_a_node_id_that_is_not_one_is_refused_before_the_watch_starts(capsys, monkeypatch):
    """Ray reads a malformed id as the nil node's, whose drain GCS accepts: the watcher said "drained" while its
    node trained on. A well-formed id must name an alive node of the cluster (GCS's node table: faked here; R7
    in tests/integration/test_fault_tolerance.py gives a real one), else the mistake showed only at a notice."""
    from behemoth.ray_internals import core

    for node_id in ("abc", "z" * 56, "a" * 57):
        with pytest.raises(ConfigError, match=rf"^--node-id '{node_id}' is not a Ray node id \(56 hex digits\)"):
            spot_watch.own_node("10.0.0.1:6379", node_id)
    assert "--node-id 'abc' is not a Ray node id" in _refused(capsys, "--address", "10.0.0.1:6379", "--node-id", "abc")
    asked = []
    monkeypatch.setattr(core, "alive_nodes_at", lambda address, ip: asked.append((address, ip)) or ["0f" * 28])
    assert spot_watch.own_node("10.0.0.1:6379", "0F" * 28) == "0f" * 28 and asked == [("10.0.0.1:6379", None)]
    with pytest.raises(ConfigError, match=rf"^--node-id {'0e' * 28} names no alive node of the cluster at "
                                          rf"10.0.0.1:6379 \(alive: {'0f' * 28}\): copy this node's id"):
        spot_watch.own_node("10.0.0.1:6379", "0e" * 28)
