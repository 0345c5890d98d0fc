"""Real Ray, real DDP over gloo, real Ray Data pipelines, a tiny ResNet. One Ray instance for the module."""

import json
import math
import re
import shutil
import time

from pathlib import Path

import pytest
import ray
import torch
import yaml

from behemoth.driver.commands.cli import main
from behemoth.job import config_from_dict
from behemoth.storage.checkpoint import complete_checkpoints
from behemoth.data.image.images import build_index
from conftest import job_dict

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


def _two_rank_loop(config):
    """A few real training steps with behemoth's pieces; each rank saves what it ends with."""
    from behemoth.data.image.image_batches import rank_batches
    from behemoth.data.order import rank_train_indices
    import numpy as np

    from behemoth.worker.parallel import sync_buffers
    from behemoth.worker.evaluate import evaluate
    from behemoth.worker.loop import train_step
    from behemoth.models.registry import build_model
    from behemoth.worker.optim import build_optimizer, lr_schedule
    from behemoth.worker.precision import grad_scaler
    from behemoth.tasks.image import ImageClassification

    cfg = config_from_dict(config["job"])
    index = ray.get(config["data_ref"])
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    torch.manual_seed(100 + rank)  # different initial weights per rank: DDP must make them agree
    model = ray.train.torch.prepare_model(build_model(cfg.model.name, len(index.classes)))
    opt = build_optimizer(model, cfg.train)
    sched = lr_schedule(opt, cfg.train, 10)
    scaler, task = grad_scaler(torch.device("cpu"), "fp32"), ImageClassification(cfg, index)
    micro = cfg.train.global_batch_size // world
    indices = rank_train_indices(index.train.num_rows, cfg.train.global_batch_size, 0, 0, rank, world)
    seen = []
    batches = rank_batches(index.train, indices, cfg.data, seed=0, epoch=0, train=True, batch_size=micro)
    for i, batch in enumerate(batches):
        train_step(model, opt, sched, scaler, [batch], cfg, task, torch.device("cpu"))
        seen += batch["sample_id"].tolist()
        if i == 3:
            break
    sync_buffers(model)  # what the loop does before evaluating or checkpointing (BatchNorm running stats)
    # behemoth's evaluation over 2 ranks (batches of 5: uneven per rank), and the same weights evaluated over
    # the whole validation set in one process
    evaluated = evaluate(model, task, rank, world, batch_size=5)
    net = model.module.eval()
    with torch.no_grad():
        sums = dict.fromkeys(task.eval_sum_names, 0.0)
        for b in task.eval_batches(np.arange(index.val.num_rows), 7):
            for name, value in task.eval_sums(net, b).items():
                sums[name] += float(value)
    torch.save({"weights": model.module.state_dict(), "seen": seen, "evaluated": evaluated,
                "one_process": task.eval_metrics(sums)}, f"{config['out']}/rank{rank}.pt")


def test_ddp_keeps_weights_identical_across_ranks_and_evaluates_each_sample_once(image_root, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = config_from_dict(job_dict(image_root, tmp_path / "runs"))
    TorchTrainer(
        _two_rank_loop,
        train_loop_config={"job": cfg.to_dict(), "data_ref": ray.put(build_index(cfg.data)), "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="sync", storage_path=str(tmp_path / "runs")),
    ).fit()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(r0["seen"]) == len(r1["seen"]) == 4 * 8 and not set(r0["seen"]) & set(r1["seen"])
    # Evaluation over 2 workers counts every validation sample exactly once: the one-process figures.
    for r in (r0, r1):
        assert r["evaluated"]["val_samples"] == r["one_process"]["val_samples"] == 4 * 6
        assert r["evaluated"]["val_accuracy"] == r["one_process"]["val_accuracy"]
        assert r["evaluated"]["val_loss"] == pytest.approx(r["one_process"]["val_loss"], rel=1e-6)
    torch.manual_seed(101)
    from behemoth.models.registry import build_model

    rank1_init = build_model("regnet_tiny_cifar", 4).state_dict()
    changed = 0
    for name, w in r0["weights"].items():
        assert torch.equal(w, r1["weights"][name]), name
        changed += not torch.equal(w, rank1_init[name])
    assert changed > len(rank1_init) // 2  # trained, and not rank 1's own initialisation


@pytest.fixture
def images_with_corrupt_file(image_root, tmp_path):
    root = tmp_path / "images"
    shutil.copytree(image_root, root)
    bad = sorted((root / "train").glob("*/*.png"))[5]
    bad.write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    return root, bad


def test_corrupt_image_fails_the_run_naming_the_file_without_retrying(images_with_corrupt_file, tmp_path, capfd):
    """Restarts allowed (failure.max_failures=3), but a restart would decode the same file again: the run ends
    at the first failure (driver/ray_cluster/failure_policy.py), with the one message naming the file."""
    root, bad = images_with_corrupt_file
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(root, tmp_path / "runs", "corrupt", train={"epochs": 1},
                                           failure={"max_failures": 3})))
    assert main(["train", str(cfg)]) == 1
    console = ""
    deadline = time.time() + 20  # the controller's line comes through Ray's log forwarding
    while "not retried" not in console and time.time() < deadline:
        out, err = capfd.readouterr()
        console += out + err
        time.sleep(0.2)
    assert f"cannot decode image {bad}" in console and "data.max_bad_samples" in console
    assert console.count("[behemoth] not retried (a restart would fail the same way; failure.max_failures is "
                         "left unused): ") == 1
    assert "Traceback" not in console, console  # the worker's traceback stays in its log (the line says where)
    assert "(the worker's traceback: worker-*.err in " in console


def test_a_full_disk_fails_the_checkpoint_cleanly_and_a_rerun_resumes(image_root, tmp_path, monkeypatch, capfd):
    """The disk fills while the checkpoint of step 6 is written (ENOSPC injected after its first file, in the
    worker's upload thread, as the OS raises it, and for every write after it: a full disk stays full): the run
    ends at once with one message naming the folder and the space needed (restarts allowed, none used); step
    3's checkpoint is intact and verifies; nothing of step 6's is left in the run folder or in the workers'
    TMPDIR, nor of a rescue checkpoint where the group was stopped while rank 0 still trained (it meets the same
    full disk); the rerun resumes from step 3 and ends."""
    from behemoth.hosts.faults import DISK_FULL_ENV
    from behemoth.storage.checkpoint import checkpoint_folders, complete_checkpoints, verify
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import trainer
    tmp = tmp_path / "worker-tmp"
    tmp.mkdir()
    env = ray_session.worker_env_vars
    monkeypatch.setattr(ray_session, "worker_env_vars", lambda: {**env(), DISK_FULL_ENV: "full:6", "TMPDIR": str(tmp)})
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs", "full", train={"epochs": 2},
                                           failure={"max_failures": 2})))
    assert main(["train", str(cfg)]) == 1
    console = ""
    deadline = time.time() + 20  # the controller's line comes through Ray's log forwarding
    while "not retried" not in console and time.time() < deadline:
        out, err = capfd.readouterr()
        console += out + err
        time.sleep(0.2)
    run = tmp_path / "runs" / "full"
    assert f"the checkpoint of step 6 did not fit: no space left on the device of {run}; it needs about" in console
    assert console.count("[behemoth] not retried") == 1 and "Traceback" not in console, console
    kept = complete_checkpoints(run)
    assert [step for step, _ in kept] == [3] and len(checkpoint_folders(run)) == 1
    verify(kept[0][1])
    assert not list(tmp.rglob("*.pt")), list(tmp.rglob("*"))

    monkeypatch.setattr(ray_session, "worker_env_vars", env)  # space again
    summary = trainer.train(config_from_dict(yaml.safe_load(cfg.read_text())))
    assert summary.resumed_from_step == 3 and summary.metrics["step"] == 12


def test_a_run_whose_folder_was_taken_over_stops_before_its_first_checkpoint(tmp_path):
    """The run lock's fence in Ray Train's workers (hosts/lease_fence.py), as train() wires it: this driver's
    lease (generation 1) was taken over by another driver (generation 2) before the run's first checkpoint.
    The run ends there, at once (restarts allowed, none used), with LeaseLostError naming the new holder:
    nothing is written into the folder as a checkpoint, and Ray Train registers (and deletes) nothing."""
    import json

    from behemoth.storage.lease_stores import LOCK_NAME
    from behemoth.storage.runlock import Fence
    from behemoth.driver.run.trainer import train
    from behemoth.errors import user_facing_error
    from behemoth.tracking.records import read_jsonl

    folder = tmp_path / "runs" / "taken"
    folder.mkdir(parents=True)
    (folder / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "theirs", "generation": 2,
                                                "command": "behemoth train x", "started": time.time(),
                                                "heartbeat": time.time()}))
    job = job_dict(tmp_path, tmp_path / "runs", "taken", train={"epochs": 1}, failure={"max_failures": 2},
                   scaling={"num_workers": 1}, checkpoint={"every_n_steps": 1})
    job["data"] = {"kind": "integration.toy_task:LinearRegression"}  # no image pipeline to start: the cheapest run
    with pytest.raises(Exception) as failed:
        train(config_from_dict(job), lock=False, fence=Fence(str(folder), "run 'taken'", "mine", 1))
    assert re.match(rf"run 'taken' in {folder}: this driver no longer holds the folder's lease \(generation 1\): "
                    rf"it is now held by pid 1 on elsewhere .* stops before writing a checkpoint into it",
                    user_facing_error(failed.value) or ""), failed.value
    assert not list(folder.glob("checkpoint*")), list(folder.iterdir())
    assert [r["event"] for r in read_jsonl(str(folder / "timeline.jsonl"))].count("group_start") == 1


def test_corrupt_image_within_budget_is_dropped_and_counted(images_with_corrupt_file, tmp_path, capsys):
    root, bad = images_with_corrupt_file
    cfg = tmp_path / "job.yaml"
    # The workers hold 2 x 0.875 of the 2 CPUs: the 0.25 left must be enough for the decode tasks (Ray Data's
    # from_arrow asked for a whole CPU per block and hung here).
    job = job_dict(root, tmp_path / "runs", "budget", train={"epochs": 1}, data={"max_bad_samples": 1},
                   scaling={"cpus_per_worker": 0.875})
    cfg.write_text(yaml.safe_dump(job))
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "dropped images:    1 undecodable in train, 0 in val" in out and "final val_acc:" in out


def test_the_decoded_cache_and_tar_shards_train_to_the_same_weights_as_decoding_every_epoch(
        image_root, tmp_path, capsys, monkeypatch):
    """data.cache=decoded (decoded and fitted once, then crop, flip and normalise from the cache) and
    data.cache=none (Ray Data decodes every epoch) hand the model the same pixels: two 2-worker runs end on
    torch.equal weights and the same validation metrics. image_size 12 < the 16 px files: the fit resizes.
    The same folder written as WebDataset tar shards (`behemoth data shards`, 3 train shards) trains to the same
    weights too, though its rank 0 is killed after step 7 (it resumes from step 6's checkpoint: exact resume),
    and its export holds the same files as the folder run's, byte for byte, but the model card (which names
    the data)."""
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run.trainer import train
    from behemoth.hosts.faults import KILL_AT_STEP_ENV
    from behemoth.storage.weights import read_state_dict

    shards = tmp_path / "shards"
    assert main(["data", "shards", str(image_root), "--out", str(shards), "--samples-per-shard", "40"]) == 0
    runs = {}
    for cache in ("none", "decoded", "shards"):
        data = {"image_size": 12, "cache": "none" if cache == "shards" else cache, "cache_dir": str(tmp_path / "cache")}
        failure = {}
        if cache == "shards":
            data.update(kind="image_webdataset", train_files=[str(shards / "train-*.tar")],  # (root is left set)
                        val_files=[str(shards / "val-*.tar")])
            failure = {"max_failures": 1}
            env = ray_session.worker_env_vars
            monkeypatch.setattr(ray_session, "worker_env_vars",
                                lambda: {**env(), KILL_AT_STEP_ENV: f"shards:7:{tmp_path / 'killed.json'}"})
        runs[cache] = train(config_from_dict(job_dict(image_root, tmp_path / "runs", cache, data=data,
                                                      failure=failure)))
        said = capsys.readouterr().out
        assert f"[behemoth] data cache: {'decoded (0.1 MB for 120 images at 12x12' if cache == 'decoded' else 'none (data.cache=none)'}" in said, said
    assert (tmp_path / "killed.json").is_file() and runs["shards"].resumed_from_step == 6
    folders = [p for p in (tmp_path / "cache" / "images").iterdir() if p.is_dir()]
    assert sorted(json.loads((f / "manifest.json").read_text())["rows"] for f in folders) == [24, 96]
    a = read_state_dict(runs["none"].latest_checkpoint)
    for other in ("decoded", "shards"):
        b = read_state_dict(runs[other].latest_checkpoint)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
            (other, [k for k in a if not torch.equal(a[k], b[k])])
        for key in ("val_accuracy", "val_loss", "loss"):
            assert runs["none"].metrics[key] == runs[other].metrics[key], (other, key)
    exported = {}
    for run in ("none", "shards"):
        assert main(["export", str(tmp_path / "runs" / run), "--out", str(tmp_path / f"export_{run}")]) == 0
        exported[run] = {p.name: p.read_bytes() for p in (tmp_path / f"export_{run}").iterdir() if p.is_file()}
    assert exported["none"].keys() == exported["shards"].keys()
    differ = [name for name in exported["none"] if exported["none"][name] != exported["shards"][name]]
    assert differ == ["README.md"], differ  # the model card names the run and its data, the rest is the same
    assert f"regnet_tiny_cifar on image_webdataset data ({shards}/train-*.tar)" in exported["shards"]["README.md"].decode()


def test_a_task_of_ones_own_runs_end_to_end_from_its_file_alone(tmp_path, capfd):
    """Adding a workload is its file: tests/integration/toy_task.py (linear regression, nothing of behemoth's
    image or text code), named by import path in data.kind. Its own data keys (data.features) are read,
    checked and shipped to the workers; it trains on 2 workers through Ray Train, is checked by `behemoth
    check`, reports its own metric, picks its best checkpoint by it and prints its own summary line. Its
    print() shows once per worker (Ray Train's print patch showed it twice)."""
    from behemoth.driver.commands.cli import main
    from behemoth.driver.run.trainer import train

    job = job_dict(tmp_path, tmp_path / "runs", "toy",
                   train={"epochs": 3, "global_batch_size": 32, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0,
                          "warmup_steps": 0, "log_every": 8},
                   checkpoint={"every_n_steps": 16, "keep": 3}, eval={"per_epoch": True})
    job["data"] = {"kind": "integration.toy_task:LinearRegression", "features": 6}  # its keys, not the images'
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(job))
    assert main(["check", str(tmp_path / "toy.yaml")]) == 0
    assert "# data: 512 train / 128 val rows of 6 features" in capfd.readouterr().out
    summary = train(config_from_dict(job))
    console = capfd.readouterr()
    printed = [line for line in (console.out + console.err).splitlines()
               if "toy task: a linear model of 6 features" in line and "pid=" in line]
    pids = [line.split("pid=")[1].split(")")[0] for line in printed]
    assert pids and all(pids.count(pid) == 1 for pid in pids), printed
    m = summary.metrics
    assert m["step"] == 48 and m["val_mse"] < 0.01  # from ~8 (|w|^2) at the start
    assert summary.best_metric == "val_mse" and summary.best_value == pytest.approx(m["val_mse"])
    assert summary.lines()[1].startswith("final val_mse:")


def test_the_data_processes_the_driver_starts_are_the_ones_the_workers_tasks_run_in(
        image_root, tmp_path, monkeypatch):
    """On a local instance the driver starts one process per worker for the decode tasks before `fit`
    (driver/ray_cluster/warmup.py). Ray hands a worker's task an idle process only if their runtime environments serialise
    the same: behemoth's prediction of the workers' environment must be the real one, and the tasks a training
    worker submits (a plain task, a Ray Data map) must run in those processes, their imports done. Watched fail
    with the controller's variable left out of the prediction. (The other way to miss, the same variables in
    another serialised form where the job's environment is empty, cannot happen under the tests' Ray, whose job
    sets PYTHONPATH: measured on the demo instead, BENCHMARKS.md.)"""
    import json

    from behemoth.driver.ray_cluster.session import training_worker_runtime_env, warm_up_data_processes
    from behemoth.driver.run.sequence import prepare_data
    from behemoth.driver.run.trainer import build_trainer
    from integration.warm_probe import where_tasks_run

    # a variable Ray Train propagates, with a value of this test only: no idle process of an earlier test fits
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "61.5")
    # decoding every epoch (a built decoded cache runs no decode task: nothing to warm up; test_image_cache.py)
    cfg = config_from_dict(job_dict(image_root, tmp_path, run_name="warm", data={"cache": "none"}))
    data = prepare_data(cfg)
    trainer = build_trainer(cfg, data)
    warm = {pid for pid in ray.get(warm_up_data_processes(cfg, data))}
    assert len(warm) == 2  # one per worker
    trainer.train_loop_per_worker = where_tasks_run
    trainer.fit()
    job_env = ray.get_runtime_context().runtime_env.get("env_vars", {})  # the tests' PYTHONPATH
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["runtime_env"] == {"env_vars": {**job_env, **training_worker_runtime_env()["env_vars"]}}
        assert seen["task"][0] in warm and seen["task"][1], seen
        assert seen["map"][0] in warm and seen["map"][1], seen


def _toy_job(tmp_path, name: str, **sections) -> dict:
    """The cheapest run: the toy task (linear regression, 512 rows), one worker, batches of 64 (8 steps an epoch)."""
    job = job_dict(tmp_path, tmp_path / "runs", name, scaling={"num_workers": 1},
                   checkpoint={"every_n_steps": 4}, train={"global_batch_size": 64, "lr": 0.05, "log_every": 4})
    job["data"] = {"kind": "integration.toy_task:LinearRegression", **sections.pop("data", {})}
    for section, values in sections.items():
        job[section].update(values)
    return job


def test_a_non_finite_step_stops_the_run_naming_it_or_is_skipped(tmp_path):
    """train.nonfinite (issue 58) in a real run, the first training row's target NaN: under stop the run ends at
    the first report after the step that trained on it, with one error naming that step, not retried (2
    restarts allowed) and no checkpoint of that step or later; under skip every such step (one an epoch) is
    left out and counted, and the run ends with finite weights."""
    from behemoth.driver.run.trainer import train
    from behemoth.errors import NonFiniteError, user_facing_error
    from behemoth.storage.checkpoint import complete_checkpoints
    from behemoth.tracking.records import read_jsonl

    stop = _toy_job(tmp_path, "stop", data={"nan_rows": 1}, train={"epochs": 2}, failure={"max_failures": 2})
    with pytest.raises(Exception) as failed:
        train(config_from_dict(stop))
    message = user_facing_error(failed.value, (NonFiniteError,)) or ""
    found = re.match(r"step (\d+): the gradient norm is not finite \(NaN or Inf\): the run stops", message)
    assert found, failed.value
    bad = int(found.group(1))
    assert 1 <= bad <= 8 and all(step < bad for step, _ in complete_checkpoints(tmp_path / "runs" / "stop"))
    events = [r["event"] for r in read_jsonl(str(tmp_path / "runs" / "stop" / "timeline.jsonl"))]
    assert events.count("group_start") == 1, events  # not retried

    skip = _toy_job(tmp_path, "skip", data={"nan_rows": 1}, train={"epochs": 2, "nonfinite": "skip"})
    summary = train(config_from_dict(skip))
    assert summary.metrics["step"] == 16 and summary.metrics["skipped_steps"] == 2, summary.metrics
    assert math.isfinite(summary.metrics["val_mse"])


def test_a_run_stopped_early_keeps_its_weight_average_and_its_reruns_say_what_they_ignore_and_apply(tmp_path, capfd):
    """Three features on one run (three fits, not seven: each costs Ray Train's start-up).
    train.early_stopping (issue 58): val_mse cannot improve by more than min_delta 1e6, so after the first
    evaluation (step 4) two more without improvement (steps 8, 12) stop the run at step 12 of 48, that step
    checkpointed with the decision. train.ema_decay (issue 58): the run's reported val_mse is its weight
    average's, the one its checkpoint keeps as ema.pt and `behemoth eval` of that checkpoint computes again (eval
    and export read the average, not model.pt). Issue 59 item 4: the same command with --set train.lr=... says
    that train.lr is ignored (and how to start a new run); the run trains nothing (it
    stopped early, and says why) and exits 2. Issue 65: with early stopping off and an epoch added, the rerun
    trains on to the new end and says which changed keys apply."""
    from behemoth.driver.run.evaluation import evaluate_checkpoint
    from behemoth.driver.run.trainer import train
    from behemoth.storage.checkpoint import read_manifest, read_state

    job = _toy_job(tmp_path, "early", train={"epochs": 6, "ema_decay": 0.8,
                                             "early_stopping": {"patience": 2, "min_delta": 1e6}},
                   eval={"every_n_steps": 4})
    summary = train(config_from_dict(job))
    assert summary.metrics["step"] == 12, summary.metrics
    (step, latest), *_ = complete_checkpoints(tmp_path / "runs" / "early")
    state = read_state(latest)
    assert step == 12 and state.stopped_early_at == 12 and state.evals_without_improvement == 2
    assert "early stop at step 12: val_mse has not improved" in capfd.readouterr().out
    assert "ema.pt" in read_manifest((Path(latest) / "manifest.json").read_bytes(), latest)["files"]
    metrics, _ = evaluate_checkpoint(config_from_dict(job), latest)
    assert metrics["val_mse"] == pytest.approx(summary.metrics["val_mse"], rel=1e-5)
    raw, average = (torch.load(Path(latest) / name, weights_only=True) for name in ("model.pt", "ema.pt"))
    assert not torch.equal(raw["weight"], average["weight"])  # (the two differ: the check above could fail)

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["train", str(path), "--set", "train.lr=0.01"]) == 2
    out, err = capfd.readouterr()
    assert ("rerun of run 'early' from step 12. ignored: train.lr 0.05 -> 0.01 (the optimizer's settings come back "
            "with its state from the checkpoint). To start a new run with these settings instead") in out
    assert "run stopped early at step 12: val_mse did not improve on " in out
    assert "for 2 evaluations (train.early_stopping): nothing to train. To train on from here: --set " \
           "train.early_stopping=null, or a train.early_stopping.patience above 2" in out
    assert "run 'early' was already complete at step 12: nothing was trained, and train.lr 0.05 -> 0.01" in err
    assert max(step for step, _ in complete_checkpoints(tmp_path / "runs" / "early")) == 12

    assert main(["train", str(path), "--set", "train.early_stopping=null", "--set", "train.epochs=7"]) == 0
    out = capfd.readouterr().out
    assert "changed keys that apply from step 12: " in out and "train.epochs 6 -> 7" in out, out
    assert ("the run stopped early at step 12 (train.early_stopping); early stopping is off now: it trains on "
            "from step 12") in out
    assert max(step for step, _ in complete_checkpoints(tmp_path / "runs" / "early")) == 56


def test_check_nodes_asks_every_node_for_the_jobs_local_paths(image_root, tmp_path, capsys):
    """`behemoth check-nodes` (issue 59 item 1): a task pinned to each alive node checks the job's local paths
    (data, cache folder's parent, model.pretrained / init_from when local, checkpoint storage): all seen exits 0;
    a data folder no node has is named, per node, and exits 1."""
    (tmp_path / "runs").mkdir()
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs")))
    assert main(["check-nodes", str(path)]) == 0
    out = capsys.readouterr().out
    nodes = len([n for n in ray.nodes() if n["Alive"]])
    assert out.count("sees every path") == nodes and "paths checked: data.root, data.cache_dir" in out
    path.write_text(yaml.safe_dump(job_dict(tmp_path / "nowhere", tmp_path / "runs")))
    assert main(["check-nodes", str(path)]) == 1
    assert capsys.readouterr().out.count(f"MISSING data.root {tmp_path / 'nowhere'}") == nodes


def _second_block_waits(batch: dict, *, marker: str, timeout_s: float) -> dict:
    """A decode task stand-in: the second block (x == 1) waits for `marker` (at most timeout_s), then says it ended."""
    import time
    from pathlib import Path

    if batch["x"][0] == 1:
        waited = time.monotonic() + timeout_s
        while not Path(marker).exists() and time.monotonic() < waited:
            time.sleep(0.05)
        Path(marker + ".ended").touch()
    return batch


def test_an_epochs_first_batch_waits_for_its_first_block_alone(image_root, tmp_path, monkeypatch):
    """Ray Data's iterator (prefetch_batches > 0) yields a block only once the next block of its dataset is done: in
    one dataset with the next block, an epoch's one-batch first block waited for a 512-image task too (~2 s of every
    epoch's start on 2 cores: BENCHMARKS.md). So it is a window of its own: the first batch comes while the next
    window's task still runs. rank_windows makes that first window one block of one batch."""
    import numpy as np
    import pyarrow as pa
    import ray.data
    from behemoth.data.image import image_batches
    from behemoth.data.prefetch import Chain

    def dataset(blocks: list[int], marker: str, timeout_s: float):
        return ray.data.from_blocks([pa.table({"x": [x] * n}) for x, n in blocks]).map_batches(
            _second_block_waits, batch_format="numpy", batch_size=None,
            fn_kwargs=dict(marker=marker, timeout_s=timeout_s))

    def first_batch(windows: list, marker: str) -> bool:
        """Whether the second block's task had ended when the first batch came."""
        it = Chain([image_batches.window_opener(ds, 4, 2, "cpu", False) for ds in windows])
        first = next(it)
        ended = Path(marker + ".ended").exists()
        Path(marker).touch()
        assert first["x"].tolist() == [0] * 4 and sum(len(b["x"]) for b in it) == 16
        return ended

    image_batches.ordered_data_context()
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    # one dataset: the first batch waited for the second block (if a Ray upgrade changes this, see above)
    assert first_batch([dataset([(0, 4), (1, 16)], one, timeout_s=3)], one)
    # a window of its own: not waited for (the task waits for the marker made after the first batch came)
    assert not first_batch([dataset([(0, 4)], two, 120), dataset([(1, 16)], two, 120)], two)

    made = []
    real = ray.data.from_blocks
    monkeypatch.setattr(ray.data, "from_blocks", lambda blocks: made.append([b.num_rows for b in blocks]) or real(blocks))
    cfg = config_from_dict(job_dict(image_root, tmp_path / "runs")).data
    index = build_index(cfg)
    indices = np.arange(30_000) % index.train.num_rows  # ~60 blocks of at most 512 rows: several windows
    image_batches.rank_windows(index.train, indices, cfg, seed=0, epoch=0, train=True, batch_size=8, window_blocks=4)
    assert made[0] == [8] and [len(w) for w in made[1:-1]] == [4] * (len(made) - 2), made
    assert sum(map(sum, made)) == 30_000
