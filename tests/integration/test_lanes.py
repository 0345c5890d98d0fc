"""Sweeps in warm lanes (driver/sweep/lane.py): trials of one worker trained in their Tune actor, which Tune
reuses from trial to trial, on the shared local Ray instance.

One sweep of three trials, one at a time, so that all three run in one lane: each starts in the state the last
left (the same threads, open files and torch threads: nothing leaks), and the last, trained after two others
in that process, ends on the weights a 1-worker TorchTrainer run of its job ends on (`torch.equal`). A second
sweep of the same trials, with faults: the first trial's lane SIGKILLed after a checkpoint (Tune retries the
trial in a new lane; it resumes from its checkpoint and ends on the unbroken trial's weights), the second
trial's training raising an error (that trial ends, alone, in error; the third finishes).
"""

import json
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from behemoth.driver.ray_cluster import session as ray_session
from behemoth.driver.sweep import load_sweep, run_sweep
from behemoth.driver.sweep.config import base_job, trial_job
from behemoth.driver.run.trainer import train
from behemoth.hosts.faults import KILL_AT_STEP_ENV, RAISE_AT_STEP_ENV
from behemoth.storage.weights import read_state_dict
from conftest import job_dict

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]
LRS = [0.05, 0.02, 0.01]  # grid order = trial order: ..._00000, ..._00001, ..._00002


def write_sweep(tmp_path: Path, image_root: Path, name: str, lrs: list[float] = LRS, scheduler: dict | None = None
                ) -> Path:
    """2 epochs of 12 steps (96 images, batch 8), a checkpoint every 4 steps; FIFO (every trial trains to its
    end) unless `scheduler`."""
    job = job_dict(image_root, tmp_path / "unused", "unused",
                   data={"cache_dir": str(tmp_path / "cache")},
                   train={"epochs": 2, "global_batch_size": 8, "log_every": 4},
                   scaling={"num_workers": 1, "cpus_per_worker": 0.5},
                   checkpoint={"every_n_steps": 4, "keep": 2}, failure={"max_failures": 0})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    sweep = {"job": "job.yaml", "space": {"train.lr": {"grid": lrs}}, "metric": "val_accuracy",
             "scheduler": scheduler or {"kind": "fifo"}, "max_concurrent_trials": 1, "trial_max_failures": 1, "name": name,
             "storage_path": str(tmp_path / "sweeps")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def starts(sweep_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (sweep_dir / "trial_starts.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    return read_state_dict(json.loads((run_dir / "summary.json").read_text())["latest_checkpoint"])


@pytest.fixture(scope="module")
def lane_sweep(image_root, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lanes")
    path = write_sweep(tmp_path, image_root, "lanes")
    handler = signal.getsignal(signal.SIGINT)
    result = run_sweep(load_sweep(path))
    # Ray Tune's Ctrl-C handler is gone with the sweep (left, a later Ctrl-C went to a sweep that is over)
    assert signal.getsignal(signal.SIGINT) is handler
    return path, result


@pytest.mark.quick  # quick tier: a sweep
def test_trials_in_one_warm_lane_train_as_ray_train_would_and_leave_nothing_behind(lane_sweep, tmp_path):
    path, result = lane_sweep
    sweep_dir = Path(result.sweep_dir)
    table = result.table
    assert sorted(table["train.lr"]) == sorted(LRS) and (table["status"] == "finished").all()
    begun = starts(sweep_dir)
    assert [s["lane"] for s in begun] == [True] * 3 and len({s["pid"] for s in begun}) == 1, begun  # one lane
    # Each trial starts in the state the one before left, after the first (which loads what a lane keeps):
    # no thread, open file or torch thread setting of a trial outlives it, and memory does not grow per trial.
    second, third = begun[1], begun[2]
    assert _nothing_left(second, third), _fd_change(second, third)
    assert third["torch_threads"] == begun[0]["torch_threads"]
    assert third["rss_mb"] - second["rss_mb"] < 100, (second["rss_mb"], third["rss_mb"])
    # no trial's state outlives it: its model (which its optimizer and pipelines hold on to) is unreachable at the
    # next trial's start (RSS cannot tell: 382, 521, 537 MB at the three starts with nothing leaking)
    assert [s["models_alive"] for s in begun] == [0, 0, 0], begun

    # The third trial, trained after two others in that process, ends on the weights of its job trained
    # through a 1-worker TorchTrainer: what the lane kept (the prepared data, the FLOP count) changes nothing.
    last = table[table["train.lr"] == LRS[2]].iloc[0]
    cfg = trial_job(base_job(load_sweep(path)), {"train.lr": LRS[2]})
    cfg.checkpoint.storage_path, cfg.checkpoint.run_name = str(tmp_path / "runs"), "through_ray_train"
    handler = signal.getsignal(signal.SIGINT)
    straight = train(cfg)
    assert signal.getsignal(signal.SIGINT) is handler  # and Ray Train's with its run
    lane = final_weights(sweep_dir / "runs" / last["trial_id"])
    ray_train = read_state_dict(straight.latest_checkpoint)
    assert lane.keys() == ray_train.keys() and all(torch.equal(lane[k], ray_train[k]) for k in lane)
    # the same run folder's records as through Ray Train: reports, the timeline, the goodput account
    run = sweep_dir / "runs" / last["trial_id"]
    assert {"metrics.jsonl", "timeline.jsonl", "goodput.json", "tensorboard"} <= {p.name for p in run.iterdir()}
    assert len([c for c in run.glob("checkpoint_*") if (c / "manifest.json").is_file()]) == 2  # keep 2


def test_a_killed_lane_resumes_its_trial_exactly_and_a_failing_trial_ends_alone(lane_sweep, image_root, tmp_path,
                                                                                 monkeypatch, capfd):
    """The same trials again, with two faults (behemoth/hosts/faults.py, in the lanes' environment): the first trial's
    lane is SIGKILLed after step 10 (its checkpoint of step 8 written), the second trial raises after step 5
    on every try (failure.max_failures 0, the sweep's trial_max_failures 1: two tries)."""
    marker = tmp_path / "killed.json"
    env = ray_session.worker_env_vars
    monkeypatch.setattr(ray_session, "worker_env_vars", lambda: {
        **env(), KILL_AT_STEP_ENV: f"*_00000:10:{marker}", RAISE_AT_STEP_ENV: "*_00001:5"})
    path = write_sweep(tmp_path, image_root, "faults")
    result = run_sweep(load_sweep(path))
    console = capfd.readouterr()
    out = console.out + console.err
    table = result.table.set_index("train.lr")
    assert json.loads(marker.read_text())["step"] == 10  # the lane was killed
    killed, failing, healthy = (table.loc[lr] for lr in LRS)
    assert killed["status"] == "finished" and healthy["status"] == "finished"
    assert failing["status"].startswith("error"), table
    # its traceback shown whole once (the second try's, the same, as one line naming it), Tune's copies one line
    assert out.count("RuntimeError: injected by BEHEMOTH_FAULT_RAISE_AT_STEP after step 5\n") == 1, out[-5000:]
    # (counted among the trial processes' lines: not every "Traceback" in the output, which an unrelated one of
    # Ray's would change)
    assert sum("(run_trial pid=" in line and "Traceback (most recent call last)" in line
               for line in out.splitlines()) == 1, out[-5000:]
    assert "[behemoth] the same traceback as run_trial pid=" in out
    # The killed trial was retried in a new lane, resumed from its checkpoint of step 8, and ended on the weights
    # of the same trial without a kill (the first sweep's).
    tries = [s for s in starts(Path(result.sweep_dir)) if s["trial_id"] == killed["trial_id"]]
    assert len(tries) == 2 and tries[0]["pid"] != tries[1]["pid"]
    summary = json.loads((Path(result.sweep_dir) / "runs" / killed["trial_id"] / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8
    unbroken = lane_sweep[1].table.set_index("train.lr").loc[LRS[0]]
    a = final_weights(Path(result.sweep_dir) / "runs" / killed["trial_id"])
    b = final_weights(Path(lane_sweep[1].sweep_dir) / "runs" / unbroken["trial_id"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(pd.read_csv(result.results_csv)) == len(LRS)


def test_a_trial_the_scheduler_stops_in_a_lane_leaves_nothing_behind(image_root, tmp_path):
    """ASHA stops a trial at its first evaluation (an epoch's end), when the lane has already opened the next
    epoch's pipeline (worker/feed.py opens it a few steps ahead): Tune's stop arrives as SystemExit at the report,
    and what the stopped trial opened must still end with it. The trial after it starts with the threads and
    open files the trial before it started with (the FIFO test above never stops a trial mid-run)."""
    lrs = [0.05, 0.0001, 0.02, 0.01]  # the second learns nothing by its first evaluation: stopped there
    path = write_sweep(tmp_path, image_root, "asha", lrs=lrs,
                       scheduler={"kind": "asha", "grace_period": 1, "reduction_factor": 2})
    result = run_sweep(load_sweep(path))
    table = result.table.set_index("train.lr")
    assert table.loc[0.0001, "status"] == "stopped early", result.table
    begun = starts(Path(result.sweep_dir))
    assert [s["lane"] for s in begun] == [True] * 4 and len({s["pid"] for s in begun}) == 1, begun
    before, after = begun[1], begun[2]  # the stopped trial's start, and the next one's
    assert _nothing_left(before, after), _fd_change(before, after)
    assert [s["models_alive"] for s in begun] == [0] * 4, begun  # the stopped trial's model too


@pytest.mark.gpu
def test_a_lane_on_a_gpu_leaves_no_gpu_memory_to_the_next_trial(image_root, tmp_path):
    """The same three trials on one GPU (one lane): each finds CUDA's allocator as the one before left it, and
    holds nothing of the last trial (its model, optimizer and batches freed, the cache emptied)."""
    path = write_sweep(tmp_path, image_root, "gpu")
    sweep = yaml.safe_load(path.read_text())
    sweep["set"] = ["scaling.use_gpu=true", "scaling.gpus_per_worker=1"]
    path.write_text(yaml.safe_dump(sweep))
    result = run_sweep(load_sweep(path))
    assert (result.table["status"] == "finished").all()
    begun = starts(Path(result.sweep_dir))
    assert len({s["pid"] for s in begun}) == 1 and all(s["lane"] for s in begun)
    assert begun[1]["cuda_allocated_mb"] == begun[2]["cuda_allocated_mb"] == 0, begun
    assert begun[2]["cuda_reserved_mb"] == begun[1]["cuda_reserved_mb"], begun


def _what_a_trial_could_leave(state: dict) -> tuple:
    """A trial start's threads, open descriptors and torch threads, less the one connection Ray opens on its own
    clock: each Ray process's metrics exporter connects to its node's metrics agent (`MetricsAgentPort`, the
    dashboard agent's gRPC port) when Ray's export timer first fires, so it appeared between the second and third
    trial's starts in about one run of four ("tcp -> 36221", the agent's port in that run's dashboard_agent.log)."""
    agents = _metrics_agents()
    fds = [fd for fd in state["fds"] if fd not in agents]
    return state["threads"], len(fds), state["torch_threads"]


def _metrics_agents() -> set[str]:
    """Each node's metrics agent as trial.process_state names a connection to it ("tcp -> PORT")."""
    import ray

    agents = {f"tcp -> {node['MetricsAgentPort']}" for node in ray.nodes() if node.get("MetricsAgentPort")}
    assert agents  # (Ray reports the port: without it the exclusion would silently exclude nothing)
    return agents


def _nothing_left(before: dict, after: dict) -> bool:
    """Two trial starts alike (_what_a_trial_could_leave), or differing only by the metrics exporter's connection
    caught while it is being made: created, not yet connected, so in no table of /proc/net (psutil lists it
    nowhere; trial.process_state says "socket"). Seen once: the later start one "socket" more, no agent
    connection in either, everything else the same, 1 s apart. Only that one socket, and only before the
    agent's connection exists, is let through."""
    from collections import Counter

    if _what_a_trial_could_leave(after) == _what_a_trial_could_leave(before):
        return True
    agents = _metrics_agents()
    was, now = Counter(before["fds"]), Counter(after["fds"])
    return (before["threads"] == after["threads"] and before["torch_threads"] == after["torch_threads"]
            and not any(fd in agents for fd in after["fds"]) and now - was == Counter({"socket": 1})
            and not was - now)


def _fd_change(before: dict, after: dict) -> str:
    """What changed between two trial starts' open descriptors (trial.process_state's `fds`), for the message."""
    from collections import Counter

    was, now = Counter(before.get("fds", [])), Counter(after.get("fds", []))
    return (f"descriptors opened since: {dict(now - was)}; closed since: {dict(was - now)}; "
            f"threads {before['threads']} -> {after['threads']}")
