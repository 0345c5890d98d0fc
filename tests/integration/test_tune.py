"""A real Ray Tune sweep on the suite's local Ray instance (without the dashboard, hence without Ray's state API,
as `ray start --include-dashboard=false` starts one): three trials, each a behemoth training run through Ray Train (2
workers: a trial of one trains in a warm lane instead, tests/integration/test_lanes.py; the tiny RegNet, 2
epochs), one at a time, ASHA deciding at epoch 1 over the learning rates 0.05, 0.005, 0.0005.

One sweep, driven through its life, checks: a trial whose training worker is SIGKILLed finishes (Ray Train
restores it from its checkpoint) on exactly the weights of an uninterrupted run of its job; a sweep whose
driver is SIGKILLed mid-way and rerun under the same name does not rerun its finished trial and continues the
unfinished one from that trial's checkpoint; ASHA stops trials early; results.csv, best.yaml (the best
trial's job) and the best checkpoint exist; the Python API returns the best config; afterwards every CPU of
the cluster is free again (no leaked placement group).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch
import yaml

from behemoth.storage.checkpoint import read_state
from behemoth.job import config_from_dict, load_config
from behemoth.driver.run.trainer import train
from behemoth.driver.sweep.tuner import sweep
from conftest import job_dict

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]
# Grid order = trial order (one at a time): each later one learns less. The first trial's worker and the second's
# driver are killed; ASHA (reduction factor 2) stops the third at epoch 1, its val_loss being past the median of
# the two before it.
LRS = [0.05, 0.005, 0.0005]


@pytest.fixture(scope="module")
def sweep_images(tmp_path_factory) -> Path:
    """Two classes that differ in colour family (a warm and a cool disk), 48 train + 12 val images each, 16x16:
    learnable in the trials' 24 steps, so the learning rates rank clearly (measured, val_loss at epoch 1 /
    2 for lr 0.05 ... 0.00005: 0.20 / 0.03, 0.46 / 0.35, 0.74 / 0.69, 0.77 / 0.79). On the 4 shape classes of `image_root` no rate
    learned anything in 24 steps (every val_loss near chance, ln 4): which trial ASHA stopped and which came
    out best was noise, and a stopped trial could rank first."""
    import shutil

    from behemoth.data.image.synth import CLASS_NAMES, write_synth_images

    root = tmp_path_factory.mktemp("sweep_images")
    write_synth_images(root, classes=len(CLASS_NAMES), per_class=48, val_per_class=12, size=16, seed=1)
    for folder in root.glob("*/*"):
        if folder.name not in ("disk_warm", "disk_cool"):
            shutil.rmtree(folder)
    return root


def write_sweep(tmp_path: Path, image_root: Path) -> Path:
    job = job_dict(image_root, tmp_path / "runs", "unused",
                   train={"epochs": 2, "global_batch_size": 8, "log_every": 4,  # 96 images: 12 steps per epoch
                          "sample_ledger": str(tmp_path / "ledger")},
                   scaling={"num_workers": 2, "cpus_per_worker": 0.5},
                   checkpoint={"every_n_steps": 2, "keep": 2}, failure={"max_failures": 1},
                   # the sweep's report (trials write none); MLflow: a parent run, the trials nested
                   tracking={"report": True, "mlflow": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    sweep = {"job": "job.yaml", "space": {"train.lr": {"grid": LRS}}, "metric": "val_loss",
             "scheduler": {"kind": "asha", "grace_period": 1, "reduction_factor": 2},
             "max_concurrent_trials": 1, "name": "tiny", "storage_path": str(tmp_path / "sweeps")}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def starts(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / "trial_starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_until(condition, what: str, timeout_s: float = 240):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "ledger" / "rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def trained_step(run_dir: Path) -> int:
    """The last step in the trial's ledger: past step 2, its checkpoint at step 2 is registered."""
    records = ledger(run_dir)
    return records[-1]["step"] if records else 0


def resource_holders() -> str:
    """Who holds the cluster's resources: placement groups not removed, live actors, and what Ray Train's
    placement-group cleaners logged (they free the workers of a trial that Tune stops)."""
    lines = [f"available {ray.available_resources()} of {ray.cluster_resources()}"]
    lines += [f"placement group {pg['placement_group_id']} {pg['state']} bundles {pg['bundles']}"
              for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    lines += _placement_group_creators()
    try:
        from ray.util.state import list_actors

        lines += [f"actor {a.class_name} pid {a.pid} {a.state}" for a in list_actors(
            address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")], limit=200,
            raise_on_missing_output=False)]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        lines.append(f"(state API: {e})")
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    for log in sorted(logs.glob("worker-*.err")):
        lines += [f"{log.name}: {line}" for line in log.read_text(errors="replace").splitlines()
                  if "PlacementGroupCleaner" in line or "placement group" in line.lower()]
    return "\n".join(lines)


def _placement_group_creators() -> list[str]:
    """For each placement group not removed: the actor and job that created it, and their states in GCS."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    actors = state.actor_table(None)
    dead_jobs = {j["JobID"] for j in state.job_table() if j.get("IsDead")}
    lines = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if pg.state == gcs_pb2.PlacementGroupTableData.REMOVED:
            continue
        creator = actors.get(pg.creator_actor_id.hex(), {})
        lines.append(f"placement group {pg.placement_group_id.hex()}: created by actor {pg.creator_actor_id.hex()} "
                     f"({creator.get('ActorClassName', '?')}, {creator.get('State', 'not in the actor table')}, "
                     f"creator_actor_dead={pg.creator_actor_dead}) of job {pg.creator_job_id.hex()} "
                     f"({'dead' if pg.creator_job_id.hex() in dead_jobs else 'alive'}), detached={pg.is_detached}")
    return lines


def complete(run_dir: Path) -> bool:
    """Whether the run folder holds a complete checkpoint (its manifest written)."""
    return any((c / "manifest.json").is_file() for c in run_dir.glob("checkpoint_*"))


def nth_trial(sweep_dir: Path, n: int) -> str | None:
    ids = list(dict.fromkeys(s["trial_id"] for s in starts(sweep_dir)))
    return ids[n] if len(ids) > n else None


def test_sweep_survives_worker_and_driver_kills_asha_stops_trials_and_resources_return(sweep_images, tmp_path,
                                                                                    capfd):
    path = write_sweep(tmp_path, sweep_images)
    sweep_dir = tmp_path / "sweeps" / "tiny"
    runs = sweep_dir / "runs"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen([sys.executable, "-m", "behemoth.driver.commands.cli", "tune", str(path)], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        # Trial 1: once it has a checkpoint, SIGKILL its training worker; it must still finish.
        first = wait_until(lambda: nth_trial(sweep_dir, 0), "the first trial")
        # past its first checkpoint, and that checkpoint complete (written asynchronously: its upload can trail
        # the steps, most with two workers on a loaded machine; killed before it, the trial would restart at 0)
        wait_until(lambda: trained_step(runs / first) >= 4 and complete(runs / first),
                   "the first trial past its first complete checkpoint")
        os.kill(ledger(runs / first)[-1]["pid"], signal.SIGKILL)  # its rank 0 training worker
        wait_until(lambda: (runs / first / "summary.json").is_file(), "the first trial to finish")
        # Trial 2: once it has a checkpoint, SIGKILL the sweep's driver.
        second = wait_until(lambda: nth_trial(sweep_dir, 1), "the second trial")
        wait_until(lambda: trained_step(runs / second) >= 3 and complete(runs / second),
                   "the second trial past its first complete checkpoint")
    except AssertionError:
        print((tmp_path / "driver.log").read_text()[-5000:])
        raise
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    summary = json.loads((runs / first / "summary.json").read_text())
    assert summary["resumed_from_step"] > 0  # trial 1 was restored after its worker died
    # Ray frees what the dead driver's job held (its trials' actors and placement groups), except, at times, a
    # worker group's placement group that a trial's Ray Train controller created on its way out (the race in
    # pg_reaper.OrphanedPlacementGroupReaper): the resuming sweep frees such a group first thing, as done here (a
    # fresh-clone run once timed out on this wait without it).
    from behemoth.driver.sweep.reaper import reap_orphaned_placement_groups

    def freed() -> bool:
        reap_orphaned_placement_groups()
        return ray.available_resources().get("CPU", 0) >= 2

    try:
        wait_until(freed, "the dead driver's trials to be reaped", 120)
    except AssertionError:
        print(resource_holders())
        raise

    # The same sweep from a script (the Python API), under the same name: resumes what the CLI started.
    result = sweep(tmp_path / "job.yaml", space={"train.lr": {"grid": LRS}}, metric="val_loss",
                   scheduler={"kind": "asha", "grace_period": 1, "reduction_factor": 2}, max_concurrent_trials=1,
                   name="tiny", storage_path=str(tmp_path / "sweeps"))
    console = capfd.readouterr()
    console = console.out + console.err
    print(console)

    # The finished trial was not trained again; the interrupted one continued from its own checkpoint.
    trained = [s["trial_id"] for s in starts(sweep_dir) if not s["finished_before"]]
    assert trained.count(first) == 1 and trained.count(second) == 2, starts(sweep_dir)
    records = ledger(runs / second)
    groups = list(dict.fromkeys(r["group"] for r in records))
    assert len(groups) == 2 and min(r["step"] for r in records if r["group"] == groups[1]) > 1

    table = result.table
    print(table.drop(columns=["run_dir", "best_checkpoint"]).to_string())
    assert len(table) == len(LRS) and sorted(table["train.lr"]) == sorted(LRS)
    assert not table["status"].str.startswith("error").any()
    stopped, finished = table[table["status"] == "stopped early"], table[table["status"] == "finished"]
    assert len(stopped) >= 1 and (stopped["step"] < finished["step"].min()).all()  # ASHA stopped it early
    # Each trial that ended in this run says so in one line, and nothing printed a traceback (Tune stopping a
    # trial's actor made Ray print its SIGTERM exit as one).
    for trial_id in stopped["trial_id"]:
        if trial_id in console:
            assert f"[behemoth] trial {trial_id} stopped early by the scheduler at epoch" in console
    assert "[behemoth] trial " in console and ("stopped early by the scheduler" in console or " finished: " in console)
    assert "Traceback" not in console and "PreemptionWatcher" not in console
    # this instance has no dashboard (no state API): the trials' placement-group cleaners ask GCS (they logged a
    # failed state-API query every second, and freed nothing, before)
    assert "Failed to query Ray Train Controller actor state" not in console
    # Best first; the Python API's best config is that row's.
    assert table["val_loss"].is_monotonic_increasing and result.best_value == table["val_loss"].iloc[0]
    assert result.best_params == {"train.lr": table["train.lr"].iloc[0]}
    assert result.best_job.train.lr == table["train.lr"].iloc[0]
    assert len(pd.read_csv(result.results_csv)) == len(LRS)
    assert Path(result.best_checkpoint, "manifest.json").is_file()
    report = Path(result.sweep_dir) / "report"
    assert f"[behemoth] sweep report: {report / 'report.html'}" in console
    assert (report / "val_loss_vs_train_lr.png").stat().st_size > 5000 and (report / "trials.png").is_file()
    page = (report / "report.html").read_text()
    assert page.count("<tr>") == len(LRS) + 1 and "stopped early" in page
    from behemoth.tracking import mlflow_run

    c = mlflow_run.client(f"sqlite:///{tmp_path}/mlflow.db")
    logged = c.search_runs([c.get_experiment_by_name("behemoth").experiment_id])
    parents = [r for r in logged if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_name for r in parents] == ["sweep tiny"]  # one, though the sweep's driver was killed
    trials = [r for r in logged if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(float(r.data.params["train.lr"]) for r in trials) == sorted(LRS) and len(logged) == len(LRS) + 1

    # Ray Data's stats actor is the one the sweep created up front (or an earlier run on this instance), in no
    # trial's placement group: trials ending did not kill it (that made later trials' datasets report to a new
    # one: KeyError tracebacks), so the instance has had one, alive (GCS's table keeps dead actors too). Read from
    # GCS: this instance has no state API.
    from ray.core.generated import gcs_pb2

    from behemoth.ray_internals.core import gcs_state

    actors = map(gcs_pb2.ActorTableData.FromString, gcs_state()._connect_and_get_accessor().get_actor_table(None, None))
    stats = [(gcs_pb2.ActorTableData.ActorState.Name(a.state), a.placement_group_id) for a in actors
             if a.class_name == "_StatsActor"]
    assert len(stats) == 1 and stats[0][0] == "ALIVE" and not stats[0][1], stats

    # No leaked placement groups: every CPU free again, no placement group left alive.
    try:
        wait_until(lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"],
                   "all CPUs to be free after the sweep", 60)
    except AssertionError:
        print(resource_holders())  # what holds them, for the failure report
        raise
    alive = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    assert not alive, alive

    # best.yaml is the best trial's job (a finished one), under a run name of its own.
    assert table["status"].iloc[0] == "finished"
    best_trial = yaml.safe_load(next((runs / table["trial_id"].iloc[0]).glob("checkpoint_*/job.yaml")).read_text())
    best_yaml = load_config(result.best_yaml).to_dict()
    assert best_yaml["checkpoint"]["run_name"] == "tiny_best"
    for section in ("data", "model", "train", "scaling", "eval", "failure"):
        assert {k: v for k, v in best_yaml[section].items() if k != "sample_ledger"} == \
            {k: v for k, v in best_trial[section].items() if k != "sample_ledger"}, section

    # Exact resume, image path (random crops and flips): trial 1, whose worker was SIGKILLed and restored,
    # ends on the weights of the same job trained without interruption.
    job = yaml.safe_load(next((runs / first).glob("checkpoint_*/job.yaml")).read_text())
    job["checkpoint"].update(run_name="straight", storage_path=str(tmp_path / "runs"))
    job["train"]["sample_ledger"] = None
    straight = train(config_from_dict(job))
    a, b = (torch.load(Path(p) / "model.pt") for p in (summary["latest_checkpoint"], straight.latest_checkpoint))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight.metrics["val_loss"] == json.loads((runs / first / "summary.json").read_text())["metrics"]["val_loss"]
    # Retention is Ray's: a checkpoint every 2 steps, keep 2 by the run's metric (val_loss), and the latest: the two
    # evaluated ones (per epoch: steps 12 and 24; one without an evaluation ranks below every evaluated one), the
    # latest among them. (Newest-2 would have kept 22 and 24, rotating the epoch-1 evaluation's out.)
    kept = [read_state(p).step for p in (tmp_path / "runs" / "straight").glob("checkpoint_*") if p.is_dir()]
    assert sorted(kept) == [12, 24]


def test_a_placement_group_whose_creator_died_is_freed():
    """What the sweep's reaper does for a stopped trial's controller that created its worker group's placement
    group on its way out (a Ray Train race): an actor creates a group, dies, and the group's CPU comes back."""
    from ray.util.placement_group import placement_group

    from behemoth.driver.sweep.reaper import reap_orphaned_placement_groups

    @ray.remote(num_cpus=0)
    class Creator:
        def create(self):
            group = placement_group([{"CPU": 0.5}])
            ray.get(group.ready())
            return group.id.hex()

    reap_orphaned_placement_groups()  # nothing left over from the sweep test
    before = ray.available_resources().get("CPU")
    creator = Creator.remote()
    group = ray.get(creator.create.remote())
    drivers = placement_group([{"CPU": 0.25}])  # as Tune's trial groups: created by the driver, not an actor
    ray.get(drivers.ready())
    reaped = reap_orphaned_placement_groups()
    assert group not in reaped and drivers.id.hex() not in reaped  # a live creator, and the driver: untouched
    ray.kill(creator)
    wait_until(lambda: group in reap_orphaned_placement_groups(), "the orphaned group to be reaped", 30)
    wait_until(lambda: ray.available_resources().get("CPU") == before - 0.25, "its CPU back", 30)
    assert ray.util.placement_group_table(drivers)["state"] == "CREATED"
    ray.util.remove_placement_group(drivers)


def test_ray_trains_placement_group_cleaner_frees_a_dead_controllers_group_without_the_dashboard():
    """Ray Train's cleaner, as behemoth launches it (ThisClusterCleaner, detached, in a process of its own), frees
    the group of a controller that died without freeing it, on this instance without the dashboard: it reads the
    controller's state from GCS (Ray 2.60's asks the state API, which needs the dashboard: it logged a failed query
    every second and never freed the group). A stand-in controller: an actor that is alive, then killed."""
    from ray.util.placement_group import placement_group

    from behemoth.driver.ray_cluster.placement_cleaner import ThisClusterCleaner

    @ray.remote(num_cpus=0)
    class Controller:
        def actor_id(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    controller = Controller.remote()
    group = placement_group([{"CPU": 0.5}])
    ray.get(group.ready())
    cleaner = ray.remote(num_cpus=0)(ThisClusterCleaner).options(lifetime="detached").remote(
        controller_actor_id=ray.get(controller.actor_id.remote()), check_interval_s=0.2, get_actor_timeout_s=5,
        stop_timeout=2)
    try:
        ray.get(cleaner.register_placement_group.remote(group))
        assert ray.get(cleaner.start_monitoring.remote())
        time.sleep(1)  # (checks of a live controller: the group stays)
        assert ray.util.placement_group_table(group)["state"] == "CREATED"
        ray.kill(controller)
        wait_until(lambda: ray.util.placement_group_table(group)["state"] == "REMOVED", "the group freed", 30)
    finally:
        ray.kill(cleaner)  # (it exits by itself once it has freed the group)
        if ray.util.placement_group_table(group)["state"] != "REMOVED":
            ray.util.remove_placement_group(group)
