"""`behemoth check`'s feed line: whether the job's CPUs can feed its workers, by the per-CPU rate `behemoth data
bench` measured on this machine for this data (kept in data.cache_dir/data_bench.json); nothing guessed."""

import os
import re

import pytest
import yaml

from behemoth.driver.commands.cli import main
from behemoth.driver.commands.data_bench import DataBench, feed_check, record
from behemoth.job import config_from_dict
from conftest import job_dict


def bench(per_cpu: float, step_rate: float | None) -> DataBench:
    return DataBench(samples_per_s=2 * per_cpu, cpus_busy=2.0, bytes_per_sample=3072.0, bytes_by_key={},
                     per_worker_batch=8, workers=2, startup_s=1.0, window_s=10.0, step_rate=step_rate)


def test_feed_check_says_what_it_knows_and_warns_when_the_cpus_fall_short(image_root, tmp_path, capsys):
    job = job_dict(image_root, tmp_path / "runs", data={"cache_dir": str(tmp_path / "cache")})
    cfg = config_from_dict(job)
    line, warning = feed_check(cfg)
    assert line.startswith("not checked: no per-CPU rate measured on this machine") and warning is None
    record(cfg, bench(per_cpu=500.0, step_rate=None))
    line, warning = feed_check(cfg)
    assert line.startswith("not checked: 500 samples/s per CPU measured here, but no step rate") and not warning

    left = os.cpu_count() - 2 * 0.5  # two workers reserving 0.5 CPU each
    record(cfg, bench(per_cpu=500.0, step_rate=2.0))  # the job needs 16 x 2 = 32 samples/s
    line, warning = feed_check(cfg)
    assert line == (f"ok: {left:g} CPUs left to the data ({os.cpu_count()} - 2 workers x 0.5) x 500 samples/s per "
                    f"CPU (measured here) = {left * 500:,.0f} samples/s; the workers need 16 x 2 steps/s = 32")
    assert warning is None
    record(cfg, bench(per_cpu=1.0, step_rate=100.0))  # 1,600 samples/s needed, a few fed
    line, warning = feed_check(cfg)
    assert warning.startswith("the CPUs cannot feed the workers") and "need 16 x 100 steps/s = 1,600" in warning

    # what the bench measured with other CPUs per task or prefetch is the same work per sample: it counts;
    # another image size is other work: not measured
    assert feed_check(config_from_dict({**job, "data": {**job["data"], "cpus_per_task": 1.0}}))[1] == warning
    assert feed_check(config_from_dict({**job, "data": {**job["data"], "image_size": 8}}))[0].startswith("not checked")

    # `behemoth check`: the line on stdout, the warning on stderr, exit 0
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"# feed: {line}" in out and f"behemoth: warning: {warning}" in err


def test_cpus_sizes_only_a_local_instance(monkeypatch):
    """`behemoth data bench --cpus N` starts a local Ray of N CPUs; against a running cluster (RAY_ADDRESS) it
    is refused with one line before anything connects."""
    import pytest

    from behemoth.driver.ray_cluster.session import ensure_ray
    from behemoth.errors import ConfigError

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="--cpus 4 sizes a local Ray instance; RAY_ADDRESS names a running"):
        ensure_ray(num_cpus=4)


def test_cpus_against_an_instance_this_process_holds_must_be_its_size(monkeypatch):
    """A Python caller already connected (ray.init before the bench): --cpus other than the instance's CPUs is
    refused in one line (it was ignored: the figure said N CPUs and ran on the instance's); its own size goes on."""
    import pytest
    import ray

    from behemoth.driver.ray_cluster import output_filter, session
    from behemoth.errors import ConfigError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(output_filter, "install", lambda: None)
    with pytest.raises(ConfigError, match="--cpus 4 sizes a local Ray instance, but this process is connected to "
                                          "one with 2 CPUs already"):
        session.ensure_ray(num_cpus=4)
    session.ensure_ray(num_cpus=2)
    session.ensure_ray()


def test_a_job_on_a_running_cluster_carries_the_whole_package(monkeypatch):
    """Against RAY_ADDRESS the job's `py_modules` is behemoth's package folder, the one a node without behemoth
    installed imports it from (tests/integration/test_job_submit.py runs such a cluster). It was once derived from
    the session module's depth and uploaded driver/ instead when the module moved one folder down."""
    from pathlib import Path

    import ray

    import behemoth
    from behemoth.driver.ray_cluster import output_filter, session

    asked = {}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: asked.update(options))
    monkeypatch.setattr(output_filter, "install", lambda: None)
    monkeypatch.setattr(session, "tighten_token_file", lambda: None)
    monkeypatch.setattr(session, "_RAY_STARTED_HERE", False)
    session.ensure_ray()
    (folder,) = asked["runtime_env"]["py_modules"]
    assert Path(folder) == Path(behemoth.__file__).resolve().parent
    assert (Path(folder) / "__init__.py").is_file() and (Path(folder) / "driver" / "run" / "trainer.py").is_file()


def test_the_bench_window_starts_once_every_consumer_has_its_first_batch():
    """A consumer started first keeps pulling steps until `seconds` after the *last* consumer's first batch
    (StartGate): on a loaded machine consumers start seconds apart, and a window counted from each one's own
    first batch left the two too little overlap to measure (a full-tier failure: 0.97 s of a 3 s window)."""
    import time

    from behemoth.driver.commands.data_bench import StartGate, _consume
    from behemoth.storage.checkpoint import TrainState

    class Feed:
        epoch_steps, cfg = 10**6, type("C", (), {"train": type("T", (), {"global_batch_size": 1})})()

        def start(self, state):
            pass

        def ahead(self, state, total_steps):
            pass

        def steps(self, state):
            def gen():
                while True:
                    time.sleep(0.01)
                    yield [{"sample_id": __import__("torch").zeros(2)}]
            return gen()

    gate = StartGate(world=2)
    calls = []

    def window_start(at):
        # the second consumer's first batch comes 0.5 s after this one's (counted from this one's, not from when
        # the test started: a slow machine's first batch may come late; issue 65)
        calls.append(at)
        if time.time() >= calls[0] + 0.5:
            gate.arrived(1, calls[0] + 0.5)
        return gate.arrived(0, at)

    result = _consume(Feed(), TrainState(), 0.3, window_start)
    assert calls[0] == result["times"][0]
    # measured past the late one's start + 0.3 (a window from this one's own first batch: 0.3 s); the slack is
    # the Python between a step's time and the deadline's check, microseconds
    assert result["times"][-1] - result["times"][0] >= 0.5 + 0.3 - 0.02
    assert StartGate(world=1).arrived(0, 5.0) == 5.0


def _bench_job(image_root, tmp_path):
    job = job_dict(image_root, tmp_path / "runs", data={"cache_dir": str(tmp_path / "cache")})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return job, path


@pytest.mark.parametrize("content", ["[1, 2]", '{"h/k": {"per_cpu": "fast"}}', '{"h/k": 5}', "{not json",
                                     '{"h/k": {"per_cpu": NaN}}', '{"h/k": {"per_cpu": 3, "step_rate": -1}}'])
def test_a_malformed_data_bench_file_is_one_line_and_the_new_measurement_is_kept(image_root, tmp_path, capsys,
                                                                                  content):
    """Issue 65 item 8: `[1,2]` was an AttributeError traceback from `behemoth check`, a string per_cpu a
    TypeError; record() on a bad file lost the measurement just made. Now check names the file and what to do,
    and record() moves the file aside (said so) and keeps the new figures."""
    job, path = _bench_job(image_root, tmp_path)
    file = tmp_path / "cache" / "data_bench.json"
    file.parent.mkdir()
    file.write_text(content)
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"# feed: not checked: {file} is not" in out and "Traceback" not in err
    assert err.startswith(f"behemoth: warning: {file} is not") and "moves it aside" in err and err.count("\n") == 1
    said = []
    assert record(config_from_dict(job), bench(per_cpu=500.0, step_rate=2.0), log=said.append) == file
    aside = list(file.parent.glob("data_bench.json.bad-*"))
    assert len(aside) == 1 and aside[0].read_text() == content and said == [said[0]] and str(aside[0]) in said[0]
    assert feed_check(config_from_dict(job))[0].startswith("ok: ")  # the new measurement, kept


def test_data_bench_records_are_written_under_a_lock_with_a_name_of_their_own(image_root, tmp_path, monkeypatch):
    """Issue 65 item 8: the read-modify-write had no lock (two benches sharing a cache_dir lost one's figures)
    and a pid-only temporary name (the same pid on two hosts of a shared folder): now flock on a lock file
    beside it, and a temporary name of host, pid and a random part."""
    import fcntl
    import socket
    import threading
    import time

    job, _ = _bench_job(image_root, tmp_path)
    cfg = config_from_dict(job)
    file = tmp_path / "cache" / "data_bench.json"
    file.parent.mkdir()
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(str(a)), replace(a, b))[1])
    with open(file.with_name("data_bench.json.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        writer = threading.Thread(target=record, args=(cfg, bench(per_cpu=500.0, step_rate=2.0)))
        writer.start()
        time.sleep(0.5)
        assert not file.exists() and writer.is_alive()  # waiting for the lock
    writer.join(timeout=30)
    assert file.exists() and not writer.is_alive()
    assert len(renamed) == 1 and re.fullmatch(rf".*/data_bench\.json\.tmp-{re.escape(socket.gethostname())}-"
                                              rf"{os.getpid()}-[0-9a-f]{{12}}", renamed[0])


@pytest.mark.parametrize("lines, expected", [
    (['{"step": 10, "wall_time": 5.0, "samples_per_s": 1}', '{"step": 20, "wall_time": 5.0, "samples_per_s": 1}'],
     "the first and last training reports (steps 10 and 20) are 0 s apart"),
    (['{"step": 10, "wall_time": 5.0, "samples_per_s": 1}', '{"step": 20, "wall_ti'],
     "fewer than two training reports"),
    (["[1]", '{"step": 10, "samples_per_s": 1}', "{}"], "fewer than two training reports"),
])
def test_data_bench_run_with_a_cut_or_timeless_metrics_file_is_one_line(image_root, tmp_path, capsys, lines,
                                                                       expected):
    """Issue 65 item 8: `data bench --run` with a truncated metrics.jsonl was a JSONDecodeError, equal wall times
    a ZeroDivisionError; a line cut short is skipped (as the report does), a span of nothing is one line."""
    _, path = _bench_job(image_root, tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines))
    capsys.readouterr()
    assert main(["data", "bench", str(path), "--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and f"--run {run}: " in err and "give --step-rate" in err


def test_a_metrics_line_cut_by_a_kill_is_skipped(tmp_path):
    """The run's last line cut short (a killed run): the rate is timed from the lines before it."""
    from behemoth.driver.commands.data_bench import measured_step_rate

    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "wall_time": 5.0, "samples_per_s": 1}\n'
                                            '{"step": 30, "wall_time": 15.0, "samples_per_s": 1}\n{"step": 4')
    assert measured_step_rate(str(tmp_path)) == 2.0
