"""Sweep configs: checked on the driver before any trial starts (no Ray), trial configs, LR scaling, the
bound on concurrent trials."""

import sys
from pathlib import Path

import pytest
import yaml

from behemoth.driver.commands.cli import main
from behemoth.config import ConfigError
from behemoth.driver.sweep.config import (SweepConfig, base_job, check_sweep, concurrency_bound, load_sweep,
                                          metric_and_mode, trial_job)
from behemoth.driver.sweep.tuner import sweep
from behemoth.storage.paths import RunPlace
from conftest import job_dict

REPO = Path(__file__).resolve().parents[2]


def write_sweep(tmp_path: Path, image_root: Path, **keys) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs")))
    raw = {"job": "job.yaml", "space": {"train.lr": {"grid": [0.01, 0.1]},
                                        "train.global_batch_size": {"choice": [16, 32]}},
           "name": "s", "storage_path": str(tmp_path / "sweeps"), **keys}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_dpo_sweep_config_checks_over_the_preference_demo():
    """jobs/configs/sweep_dpo.yaml: beta x lr, each trial one worker in a warm lane, metric the held-out preference
    accuracy (the task reports it with mode max). Its run: docs/preference.md."""
    from behemoth.driver.sweep.config import lane_reason

    s = load_sweep(REPO / "jobs/configs/sweep_dpo.yaml")
    jobs = check_sweep(s)
    assert {(j.data.beta, j.train.lr) for j in jobs} == {(b, lr) for b in (0.1, 0.5) for lr in (0.0002, 0.0005)}
    assert all(j.data.kind == "preference" and lane_reason(j) is None for j in jobs)


def test_demo_sweep_config_is_valid_and_bounded_by_the_cluster():
    s = load_sweep(REPO / "jobs/configs/sweep_demo.yaml")
    jobs = check_sweep(s)
    assert len(jobs) == 6  # 3 learning rates x 2 batch sizes
    assert {(j.train.lr, j.train.global_batch_size) for j in jobs} == {
        (lr, b) for lr in (0.02, 0.1, 0.5) for b in (32, 64)}
    assert all(j.scaling.num_workers == 1 and j.train.epochs == 4 for j in jobs)
    # 1 worker x 0.75 CPU + one 0.25-CPU decode task per trial
    assert concurrency_bound(jobs, {"CPU": 2.0}) == 2
    assert concurrency_bound(jobs, {"CPU": 128.0, "GPU": 8.0}) == 128
    with pytest.raises(ConfigError, match="one trial needs 1 CPUs and 0 GPUs, the cluster has 0.5"):
        concurrency_bound(jobs, {"CPU": 0.5})


def test_gpu_trials_are_bounded_by_gpus(tmp_path, image_root):
    s = load_sweep(write_sweep(tmp_path, image_root, set=["scaling.use_gpu=true", "scaling.num_workers=2"]))
    assert concurrency_bound(check_sweep(s), {"CPU": 128.0, "GPU": 8.0}) == 4  # 2 GPUs per trial


def test_a_sweep_on_an_object_store_is_refused_with_what_to_do(tmp_path, image_root):
    s = load_sweep(write_sweep(tmp_path, image_root, storage_path="s3://bucket/sweeps"))
    with pytest.raises(ConfigError, match="sweep storage_path s3://bucket/sweeps: a sweep keeps its folder on a "
                                          "local or shared filesystem"):
        check_sweep(s)


@pytest.mark.parametrize("space, message", [
    ({}, "space is empty"),
    ({"train.lrr": {"grid": [0.1]}},
     r"space key 'train.lrr' is not a key of the sweep's job \(data.kind image_folder\); did you mean 'train.lr'"),
    # a key of another task's data section: the job's kind decides which keys exist
    ({"data.seq_len": {"grid": [64]}}, r"space key 'data.seq_len' is not a key of the sweep's job \(data.kind image"),
    # a field name matched within its section, other trainers' names included (errors.KEY_SYNONYMS); a bare one
    # in every section (these suggested train.min_lr_ratio, train.micro_batch_size and nothing)
    ({"lr": {"grid": [0.1]}}, r"space key 'lr' is not a key of the sweep's job \(.*\); did you mean 'train.lr'\?$"),
    ({"learning_rate": {"grid": [0.1]}}, r"'learning_rate' is not a key .*; did you mean 'train.lr'\?$"),
    ({"train.learning_rate": {"grid": [0.1]}}, r"; did you mean 'train.lr'\?$"),
    ({"train.batch_size": {"grid": [16]}}, r"; did you mean 'train.global_batch_size'\?$"),
    # a range over an integer key: its integer ends made valid jobs, the floats between failed every trial in Ray
    ({"train.global_batch_size": {"loguniform": [16, 64]}}, r"^space.train.global_batch_size: loguniform "
     r"draws floats and the key is an integer: use randint, choice or grid \(e.g. \{choice: \[16, 64\]\}\)$"),
    ({"train.epochs": {"uniform": [2, 4]}}, "space.train.epochs: uniform draws floats and the key is an integer"),
    ({"train.lr": {"loguniform": [0, 1]}}, r"train.lr.loguniform needs \[low, high\] with low < high and low > 0"),
    ({"train.lr": {"normal": [0, 1]}}, "space.train.lr: expected one of"),
    # integer ranges: two integers, low < high (both drawn), a log range above 0
    ({"train.epochs": {"randint": [2, 4.5]}}, r"space.train.epochs.randint needs \[low, high\], two integers with "
     r"low < high \(both drawn\), got \[2, 4.5\]"),
    ({"train.epochs": {"randint": [3, 3]}}, r"train.epochs.randint needs \[low, high\], two integers"),
    ({"train.epochs": {"randint": [True, 3]}}, r"train.epochs.randint needs \[low, high\], two integers"),
    ({"train.global_batch_size": {"lograndint": [0, 64]}}, r"lograndint needs .* and low > 0 \(both drawn\)"),
    # each end is a job: one that is not valid is named before Ray starts
    ({"train.global_batch_size": {"randint": [16, 17]}}, "the trial train.global_batch_size=17 is not a valid job"),
    ({"train.lr": {"grid": []}}, "space.train.lr.grid is empty"),
    ({"train.global_batch_size": {"grid": [16, 15]}},
     "the trial train.global_batch_size=15 is not a valid job: train.global_batch_size 15 is not divisible"),
    ({"train.optimizer": {"choice": ["sgd", "adam"]}}, "train.optimizer must be one of"),
])
def test_bad_space_is_refused_before_any_trial(tmp_path, image_root, space, message):
    path = write_sweep(tmp_path, image_root)
    raw = yaml.safe_load(path.read_text())
    raw["space"] = space
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=message):
        check_sweep(load_sweep(path))


@pytest.mark.parametrize("kind", ["randint", "lograndint"])
def test_an_integer_range_draws_integers_with_both_ends_included(kind):
    """Tune's randint and lograndint leave their upper bound out; a sweep's [low, high] draws both (a range over
    train.epochs or a LoRA rank, which uniform refuses: it draws floats)."""
    import random

    from behemoth.driver.sweep.tuner import _domain

    random.seed(0)
    domain = _domain({kind: [1, 3]})
    draws = [domain.sample(random_state=i) for i in range(200)]
    assert {type(d) for d in draws} == {int} and set(draws) == {1, 2, 3}


def test_metric_the_training_never_reports_is_refused(tmp_path, image_root):
    with pytest.raises(ConfigError, match="metric 'val_acc' is never reported by a regnet_tiny_cifar run; it "
                                          "reports val_accuracy, val_loss, loss"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, metric="val_acc")))
    with pytest.raises(ConfigError, match="'val_perplexity' is never reported"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, metric="val_perplexity")))


def test_optuna_missing_or_with_a_grid_is_a_clear_error(tmp_path, image_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed (optuna is not a dependency)
    with pytest.raises(ConfigError, match=r"searcher optuna samples, it does not enumerate grids: use choice "
                                          r"for \['train.lr'\]"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, searcher="optuna")))
    no_grid = {"train.lr": {"loguniform": [0.01, 0.1]}, "train.global_batch_size": {"choice": [16, 32]}}
    with pytest.raises(ConfigError, match="searcher optuna needs the optuna package: pip install optuna"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, searcher="optuna", space=no_grid)))


def test_trial_job_applies_params_lr_scaling_and_its_own_run_folder(tmp_path, image_root):
    s = load_sweep(write_sweep(tmp_path, image_root, set=["train.global_batch_size=32"]))
    base = base_job(s)
    for scaling, factor in (("none", 1.0), ("linear", 2.0), ("sqrt", 2 ** 0.5)):
        trial = RunPlace.of(str(tmp_path), "sw", key="name").child("runs", "t1")
        cfg = trial_job(base, {"train.lr": 0.1, "train.global_batch_size": 64}, scaling, trial)
        assert cfg.train.lr == pytest.approx(0.1 * factor) and cfg.train.global_batch_size == 64
        assert (cfg.checkpoint.storage_path, cfg.checkpoint.run_name) == (str(tmp_path / "sw" / "runs"), "t1")
    assert Path(base["data"]["root"]).is_absolute()


def test_relative_data_paths_become_absolute_for_the_trials(tmp_path, image_root, monkeypatch):
    monkeypatch.chdir(image_root.parent)
    path = write_sweep(tmp_path, image_root)
    raw = yaml.safe_load((tmp_path / "job.yaml").read_text())
    raw["data"]["root"] = image_root.name  # relative to the working directory
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    assert base_job(load_sweep(path))["data"]["root"] == str(image_root)


def test_cli_tune_bad_sweep_exits_2_before_ray(tmp_path, image_root, capsys, no_ray):
    import ray

    path = write_sweep(tmp_path, image_root, space={"train.momentun": {"grid": [0.9]}})
    assert main(["tune", str(path)]) == 2
    assert "did you mean 'train.momentum'" in capsys.readouterr().err
    assert not ray.is_initialized() and not (tmp_path / "sweeps").exists()


def test_missing_data_is_refused_before_any_trial(tmp_path, capsys, no_ray):
    import ray

    path = write_sweep(tmp_path, tmp_path / "no_images")
    assert main(["tune", str(path)]) == 1
    assert "no_images does not exist" in capsys.readouterr().err
    assert not ray.is_initialized() and not (tmp_path / "sweeps").exists()


def test_python_api_checks_its_arguments(tmp_path, image_root):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs")))
    with pytest.raises(ConfigError, match="unknown key 'num_sample'; did you mean 'num_samples'"):
        sweep(job, {"train.lr": {"grid": [0.1]}}, num_sample=2)
    with pytest.raises(ConfigError, match="space is empty"):
        sweep(job, {})
    assert SweepConfig().searcher == "random"


def test_cli_overrides_set_sweep_keys_or_job_keys_for_every_trial(tmp_path, image_root):
    s = load_sweep(write_sweep(tmp_path, image_root, set=["train.epochs=3"]),
                   ["name=other", "scheduler.grace_period=2", "train.momentum=0.8", f"data.root={image_root}"])
    assert (s.name, s.scheduler.grace_period) == ("other", 2)
    assert s.set == ["train.epochs=3", "train.momentum=0.8", f"data.root={image_root}"]
    jobs = check_sweep(s)
    assert all(j.train.momentum == 0.8 and j.train.epochs == 3 for j in jobs)


def test_the_reaper_keeps_watching_after_the_last_trial_controller_is_gone(monkeypatch):
    """A dying controller's last placement group reaches GCS after the controller itself is dead: the reaper's
    end waits for quiet_s without controllers or new orphaned groups (GCS's tables stubbed: the loop is ours)."""
    import time

    from behemoth.driver.sweep import reaper as pg_reaper

    start = time.monotonic()
    controller_until, orphan_at = start + 0.3, start + 0.6  # the group turns up 0.3 s after its controller died
    reaped = []

    def reap():
        if time.monotonic() >= orphan_at and not reaped:
            reaped.append("pg")
            return ["pg"]
        return []

    monkeypatch.setattr(pg_reaper, "reap_orphaned_placement_groups", reap)
    monkeypatch.setattr(pg_reaper, "_live_train_controllers", lambda: int(time.monotonic() < controller_until))
    reaper = pg_reaper.OrphanedPlacementGroupReaper(every_s=60, settle_s=10, quiet_s=1.0)
    reaper.thread.start()  # (what __enter__ does, without its first reap)
    reaper.__exit__(None, None, None)
    assert reaped == ["pg"] and time.monotonic() - start < 5


def test_asha_with_no_rung_before_a_trials_end_is_refused_before_ray(tmp_path, image_root, capsys, no_ray):
    """A 1-epoch job under ASHA's default grace period of 1 epoch: Ray's ASHAScheduler failed on an assertion
    (a traceback) after the sweep's lock was taken; now one line says what to change, before Ray starts."""
    import ray

    path = write_sweep(tmp_path, image_root, set=["train.epochs=1"])
    assert main(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("scheduler asha: a trial lasts 1 epoch(s), not more than scheduler.grace_period 1, so ASHA has no "
            "point to stop a trial before its end") in err and "Traceback" not in err
    assert not ray.is_initialized() and not (tmp_path / "sweeps").exists()
    assert len(check_sweep(load_sweep(path, ["scheduler.kind=fifo"]))) == 4  # no rungs, no such limit


def test_a_sweep_whose_every_trial_failed_ends_on_one_line_naming_its_results(tmp_path, image_root):
    """Every trial errored (a broken model): the sweep writes results.csv with each trial's error and ends with
    behemoth's one line (it was a bare RuntimeError, printed by the CLI as a traceback)."""
    from ray.tune import Result

    from behemoth.driver.sweep.results import write_results
    from behemoth.errors import user_facing_error

    s = load_sweep(write_sweep(tmp_path, image_root))
    grid = [Result(metrics={"config": {"train.lr": lr, "train.global_batch_size": 16}, "trial_id": f"t{i}"},
                   checkpoint=None, error=RuntimeError("mat1 and mat2 shapes cannot be multiplied"), path=str(tmp_path))
            for i, lr in enumerate((0.01, 0.1))]
    (tmp_path / "sweeps" / "s").mkdir(parents=True)
    with pytest.raises(Exception) as raised:
        write_results(s, grid, "val_accuracy", "max", RunPlace.of(str(tmp_path / "sweeps"), "s"))
    assert user_facing_error(raised.value) == (f"no trial of sweep s that did not fail reported val_accuracy as a "
                                               f"finite number: see the trials' statuses in "
                                               f"{tmp_path}/sweeps/s/results.csv")
    assert (tmp_path / "sweeps/s/results.csv").read_text().count("error: mat1 and mat2 shapes") == 2


def test_the_best_trial_is_one_that_did_not_fail_its_values_as_tune_gave_them_its_checkpoint_by_the_sweeps_metric(
        tmp_path, image_root):
    """A trial that evaluated well and then diverged (an error) was chosen best, and best.yaml retrained it into
    the same NaN; a null among a choice's values came back from the table as nan (best.yaml failed after the
    sweep); the best checkpoint was the run's best by its own metric, not by the sweep's; an infinite value
    could be best."""
    import json

    import torch
    from ray.tune import Result

    from behemoth.driver.sweep.results import write_results
    from behemoth.storage import checkpoint as ckpt

    space = {"train.lr": {"grid": [0.1, 0.02, 0.05]}, "train.grad_clip": {"choice": [None, 1.0]}}
    s = load_sweep(write_sweep(tmp_path, image_root, metric="val_loss", space=space))
    place = RunPlace.of(str(tmp_path / "sweeps"), "s")

    def result(i, lr, clip, loss, error=None, done=True):
        metrics = {"trial_id": f"t{i}", "val_loss": loss, "step": 8 if done else 4, "total_steps": 8, "epoch": 1.0}
        return Result(metrics={**metrics, "config": {"train.lr": lr, "train.grad_clip": clip}}, checkpoint=None,
                      error=error, path=str(tmp_path))

    grid = [result(0, 0.1, 1.0, 0.1, error=RuntimeError("loss is nan at step 6"), done=False),
            result(1, 0.02, None, 0.4), result(2, 0.05, 1.0, float("inf"), done=False)]
    run = Path(place.child("runs", "t1").folder)
    for step, (loss, accuracy) in ((4, (0.3, 0.85)), (8, (0.5, 0.9))):
        texts = {"train_state.json": json.dumps({"step": step}),
                 "metrics.json": json.dumps({"val_loss": loss, "val_accuracy": accuracy})}
        ckpt.write(run / f"checkpoint_{step}", ckpt.Snapshot({"model.pt": torch.nn.Linear(2, 2).state_dict()}, texts,
                                                              step))
    (run / "summary.json").write_text(json.dumps({"best_checkpoint": str(run / "checkpoint_8"), "metrics": {}}))
    out = write_results(s, grid, "val_loss", "min", place)
    assert out.best_params == {"train.lr": 0.02, "train.grad_clip": None} and out.best_value == 0.4
    assert out.best_checkpoint.endswith("checkpoint_4") and out.best_job.train.grad_clip is None
    assert list(out.table["trial_id"]) == ["t0", "t1", "t2"]  # (the errored one listed, first by its value)
    assert out.table["status"][0].startswith("error: loss is nan") and out.table["best_checkpoint"].isna()[2]
    ranked_up = write_results(s, grid, "val_loss", "max", place)  # (ranked the other way: t2's inf first)
    assert ranked_up.best_params["train.lr"] == 0.02


def test_which_trials_train_in_a_warm_lane_and_why_the_others_do_not(image_root, tmp_path):
    """One worker: a lane. Several workers, an elastic range, FSDP, sharded checkpoints or torch.compile: Ray
    Train (each reason said); the sweep's line counts them."""
    from behemoth.driver.sweep.config import lane_reason
    from behemoth.driver.sweep.tuner import _lanes_line
    from behemoth.job import config_from_dict

    def job(**sections):
        return config_from_dict(job_dict(image_root, tmp_path, **sections))

    one = job(scaling={"num_workers": 1})
    assert lane_reason(one) is None
    others = {"2 workers (a lane trains one)": job(),
              "[1, 2] workers (a lane trains one)": job(scaling={"num_workers": [1, 2]}),
              "scaling.strategy fsdp_full (FSDP shards over a process group)":
                  job(scaling={"num_workers": 1, "strategy": "fsdp_full"}),
              "sharded checkpoints (written through a process group)":
                  job(scaling={"num_workers": 1}, checkpoint={"format": "sharded"}),
              "train.compile (a compiled graph would stay in the lane's process)":
                  job(scaling={"num_workers": 1}, train={"compile": True})}
    for why, cfg in others.items():
        assert lane_reason(cfg) == why
    line = _lanes_line([one, one, others["2 workers (a lane trains one)"]])
    assert line.startswith("2 of 3 trial configs in warm lanes") and "through Ray Train: 2 workers" in line


def test_a_range_over_a_float_key_is_still_accepted(tmp_path, image_root):
    space = {"train.lr": {"uniform": [0.01, 0.1]}, "train.global_batch_size": {"choice": [16, 32]}}
    assert len(check_sweep(load_sweep(write_sweep(tmp_path, image_root, space=space)))) == 4


def test_a_failed_first_start_does_not_lock_out_its_corrected_rerun(tmp_path, image_root):
    """The first start recorded sweep.yaml before the checks that refuse a sweep before any trial (the cluster's
    bound, MLflow) and before Tune had any state: its rerun with the fix was refused 'a different job'. Only a
    folder Tune can restore (Tuner.can_restore: its tuner.pkl) is compared (no Ray started)."""
    from behemoth.driver.sweep.tuner import _check_same_sweep

    folder = str(tmp_path / "sweeps" / "s")
    # too large for the cluster: concurrency_bound refuses it after this check, before Tune writes anything
    _check_same_sweep(load_sweep(write_sweep(tmp_path, image_root, set=["scaling.cpus_per_worker=64"])), folder)
    fixed = load_sweep(write_sweep(tmp_path, image_root, set=["scaling.cpus_per_worker=0.5"]))
    assert _check_same_sweep(fixed, folder)["job"]["scaling"]["cpus_per_worker"] == 0.5


def test_a_rerun_with_another_metric_mode_scheduler_or_searcher_is_refused(tmp_path, image_root):
    """Tuner.restore keeps the first start's scheduler and searcher while results.csv ranks by the rerun's metric:
    a rerun must repeat them as it repeats the job and space. Defaults said out loud are the same sweep."""
    from behemoth.driver.sweep.tuner import _check_same_sweep, _record_sweep

    folder = str(tmp_path / "sweeps" / "s")
    path = write_sweep(tmp_path, image_root, set=["train.epochs=4"])
    _record_sweep(folder, _check_same_sweep(load_sweep(path), folder))
    _check_same_sweep(load_sweep(path, ["metric=val_loss"]), folder)  # no Tune state yet: nothing to resume
    (Path(folder) / "tuner.pkl").write_bytes(b"")  # Tune's state: a rerun restores it
    assert _check_same_sweep(load_sweep(path, ["mode=max", "scheduler.max_t=4"]), folder)["mode"] == "max"
    for override, changed in (("metric=val_loss", "metric and mode"), ("scheduler.kind=fifo", "scheduler"),
                              ("scheduler.grace_period=2", "scheduler"), ("searcher=optuna", "searcher"),
                              ("train.epochs=3", r"job \(train.epochs\) and scheduler")):
        with pytest.raises(ConfigError, match=f"^sweep 's' in {folder} was started with a different {changed}: give "
                                              f"this sweep another name"):
            _check_same_sweep(load_sweep(path, [override]), folder)


def test_a_mode_against_the_metrics_direction_is_refused(tmp_path, image_root):
    """mode: min on val_accuracy made the worst trial the best (results.csv, best.yaml)."""
    with pytest.raises(ConfigError, match="mode min contradicts metric val_accuracy, which the task reports as "
                                          "higher-is-better: set mode: max or leave mode out"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, mode="min")))
    with pytest.raises(ConfigError, match="mode max contradicts metric val_loss, which the task reports as "
                                          "lower-is-better: set mode: min"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, metric="val_loss", mode="max")))
    s = load_sweep(write_sweep(tmp_path, image_root, metric="loss", mode="min"))
    assert metric_and_mode(s, check_sweep(s)[0]) == ("loss", "min")


def test_an_asha_max_t_past_a_trials_end_is_refused(tmp_path, image_root):
    """max_t 4 on 2-epoch trials put an ASHA rung at a trial's last report, which _scheduler's max_t a hair below
    the run's length exists to avoid (a trial stopped while it shuts down can leak its placement group)."""
    with pytest.raises(ConfigError, match=r"scheduler.max_t 4 is longer than a trial \(train.epochs 2\), so ASHA "
                                          r"would decide at a trial's last report: set scheduler.max_t to at most 2"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, scheduler={"max_t": 4})))
    epochs = {"train.epochs": {"choice": [4, 2]}}  # every trial's length: the 2-epoch ones too
    with pytest.raises(ConfigError, match=r"scheduler.max_t 4 is longer than a trial \(train.epochs 2\)"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, scheduler={"max_t": 4}, space=epochs)))
    assert len(check_sweep(load_sweep(write_sweep(tmp_path, image_root, scheduler={"max_t": 2})))) == 4


def test_asha_over_a_space_of_run_lengths_plans_for_the_shortest_trial(tmp_path, image_root):
    """With train.epochs in the space and no max_t, ASHA planned for the first trial's length: {choice: [8, 2]}
    put rungs at 1, 2 and 4 epochs, one at the 2-epoch trials' last report (what max_t a hair below a run's
    length exists to avoid). Now every rung is before every trial's end; longer trials run on past max_t."""
    from behemoth.driver.sweep.tuner import _scheduler

    for epochs in ([8, 2], [2, 8]):
        s = load_sweep(write_sweep(tmp_path, image_root, space={"train.epochs": {"choice": epochs}}))
        asha = _scheduler(s, check_sweep(s))
        rungs = {milestone for bracket in asha._brackets for milestone, _ in bracket._rungs}
        assert rungs and all(rung < 2 for rung in rungs), rungs
        assert not asha._stop_last_trials  # (an 8-epoch trial is not stopped at max_t)
    randint = {"train.epochs": {"randint": [2, 8]}}
    with pytest.raises(ConfigError, match=r"scheduler.max_t 4 is longer than a trial \(train.epochs 2\)"):
        check_sweep(load_sweep(write_sweep(tmp_path, image_root, scheduler={"max_t": 4}, space=randint)))


def test_a_missing_job_file_names_the_sweep_file_its_key_and_where_it_is_read_from(tmp_path, image_root,
                                                                                    monkeypatch):
    """job: configs/job.yaml in configs/sweep.yaml: 'config file configs/configs/job.yaml does not exist' named
    neither the sweep file nor its job key, nor that the path is read from the sweep file's folder."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, image_root)
    (tmp_path / "configs").mkdir()
    (tmp_path / "job.yaml").rename(tmp_path / "configs/job.yaml")
    raw = yaml.safe_load(path.read_text())
    (tmp_path / "configs/sweep.yaml").write_text(yaml.safe_dump({**raw, "job": "configs/job.yaml"}))
    with pytest.raises(ConfigError) as raised:
        load_sweep("configs/sweep.yaml")
    assert str(raised.value) == ("configs/sweep.yaml: job: configs/job.yaml is not found relative to the sweep "
                                 "file's folder (configs/configs/job.yaml does not exist): write job: job.yaml")


def test_the_python_api_takes_a_job_path_and_a_storage_path(tmp_path, image_root, monkeypatch):
    """A JobConfig, a dict or None as the job was 'config file JobConfig(...2 KB...) does not exist'; a Path as
    storage_path was refused 'expects str, got PosixPath'."""
    from behemoth.driver.sweep import tuner
    from behemoth.job import config_from_dict

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs")))
    space = {"train.lr": {"grid": [0.1]}}
    for wrong, name in ((config_from_dict(job_dict(image_root, tmp_path)), "JobConfig"), ({}, "dict"),
                        (None, "NoneType")):
        with pytest.raises(ConfigError) as raised:
            sweep(wrong, space)
        assert str(raised.value) == (f"sweep(): job takes the path of a job YAML (str or os.PathLike), got {name}: "
                                     f"write a JobConfig to a file first (behemoth.config.dump_yaml(cfg))")
    monkeypatch.setattr(tuner, "run_sweep", lambda cfg: cfg)  # the config it would run: no Ray
    cfg = sweep(job, space, storage_path=tmp_path / "sweeps")
    assert (cfg.job, cfg.storage_path) == (str(job), str(tmp_path / "sweeps"))


def test_set_of_a_space_key_says_to_give_the_whole_space(tmp_path, image_root):
    """--set space.train.lr.grid=[0.1] was 'space.train expects ...': a space key's own dot cannot be addressed
    by --set; the whole space can (and that form is loaded as written)."""
    path = write_sweep(tmp_path, image_root)
    with pytest.raises(ConfigError, match=r"^--set space.train.lr.grid=\[0.1\]: a space key has dots of its own, so "
                                          r"--set cannot reach into the space: give the whole space \(it replaces "
                                          r"the file's\), --set 'space=\{train.lr: \{grid: \[0.1\]\}\}'$"):
        load_sweep(path, ["space.train.lr.grid=[0.1]"])
    assert load_sweep(path, ["space={train.lr: {grid: [0.1]}}"]).space == {"train.lr": {"grid": [0.1]}}


def test_a_sweep_recorded_before_a_key_was_added_to_behemoth_still_resumes(tmp_path, image_root):
    """A sweep started by an earlier behemoth records its job without the keys added since (data.eval_crop_pct):
    its rerun compared the whole job and was refused ("a different job") for a key it never set. Now the record
    reads as a run's resume reads its job.yaml (a key added since: its value then); a real change is still
    refused, by name."""
    from behemoth.driver.sweep.tuner import _check_same_sweep, _record_sweep

    folder = str(tmp_path / "sweeps" / "s")
    path = write_sweep(tmp_path, image_root)
    record = _check_same_sweep(load_sweep(path), folder)
    assert record["job"]["data"].pop("eval_crop_pct") == 1.0  # as an earlier behemoth wrote it
    _record_sweep(folder, record)
    (Path(folder) / "tuner.pkl").write_bytes(b"")  # Tune's state: a rerun restores it
    _check_same_sweep(load_sweep(path), folder)
    with pytest.raises(ConfigError, match=r"started with a different job \(data.eval_crop_pct\): give"):
        _check_same_sweep(load_sweep(path, ["set=[data.eval_crop_pct=0.875]"]), folder)


def test_a_resumed_sweep_says_which_limits_apply(tmp_path, capsys):
    """Tuner.restore takes no TuneConfig: a resumed sweep runs at the first start's max_concurrent_trials and
    trial_max_failures whatever the rerun asks, and the sweep's line printed the rerun's ("at most 4 at once" for a
    sweep running 2). The record keeps the first start's, the line says what applies, a different ask is named."""
    from behemoth.driver.sweep.tuner import _record_sweep, _restored_limits

    folder = str(tmp_path / "s")
    _record_sweep(folder, {"job": {}, "max_concurrent_trials": 2, "trial_max_failures": 1})
    record = {"job": {}, "max_concurrent_trials": 4, "trial_max_failures": 1}
    assert _restored_limits(folder, record) == 2 and record["max_concurrent_trials"] == 2
    assert capsys.readouterr().out == ("[behemoth] resuming: Tune restores the first start's max_concurrent_trials 2 "
                                       "(this rerun's: 4); to run with other limits, give the sweep another name\n")
    same = {"job": {}, "max_concurrent_trials": 2, "trial_max_failures": 1}
    assert _restored_limits(folder, same) == 2 and capsys.readouterr().out == ""
    _record_sweep(folder, {"job": {}})  # recorded by an earlier version: the rerun's, as before
    assert _restored_limits(folder, dict(record, max_concurrent_trials=3)) == 3


def test_a_sweep_over_pretrained_models_gives_each_trial_its_own_models_statistics(tmp_path, image_root):
    """A sweep whose space chooses model.pretrained: the job's keys whose default is the model's (an image job's
    data.mean, data.std, data.eval_crop_pct) were filled once from the job's own model and handed to every trial.
    Left out of the job, each trial's model fills them; set in the job (data.mean here), they stay."""
    import json

    from transformers import ResNetConfig, ResNetForImageClassification

    folders = {}
    for name, (mean, crop) in {"a": ([0.485, 0.456, 0.406], 0.875), "b": ([0.5, 0.5, 0.5], 0.95)}.items():
        folders[name] = tmp_path / name
        ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1])).save_pretrained(
            folders[name])
        (folders[name] / "preprocessor_config.json").write_text(json.dumps(
            {"image_mean": mean, "image_std": [0.2] * 3, "crop_pct": crop}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs",
                                           model={"name": "image_classifier", "pretrained": str(folders["a"])})))
    raw = {"job": "job.yaml", "space": {"model.pretrained": {"grid": [str(folders["a"]), str(folders["b"])]}},
           "name": "s", "storage_path": str(tmp_path / "sweeps")}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(raw))
    jobs = {j.model.pretrained: j.data for j in check_sweep(load_sweep(tmp_path / "sweep.yaml"))}
    assert (jobs[str(folders["b"])].mean, jobs[str(folders["b"])].eval_crop_pct) == ([0.5] * 3, 0.95)
    assert (jobs[str(folders["a"])].mean, jobs[str(folders["a"])].eval_crop_pct) == ([0.485, 0.456, 0.406], 0.875)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({**raw, "set": ["data.mean=[0.1, 0.2, 0.3]"]}))
    mine = {j.model.pretrained: j.data for j in check_sweep(load_sweep(tmp_path / "sweep.yaml"))}
    assert {tuple(d.mean) for d in mine.values()} == {(0.1, 0.2, 0.3)}
    assert {d.eval_crop_pct for d in mine.values()} == {0.875, 0.95}
