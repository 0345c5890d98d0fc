"""Real Ray, real DDP over gloo, real Ray Data pipelines, a tiny ResNet. One Ray instance for the module."""

import shutil

import pytest
import ray
import torch
import yaml

from behemoth.cli import main
from behemoth.config import config_from_dict
from behemoth.data.images import build_index
from behemoth.trainer import train
from conftest import job_dict

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


def _two_rank_loop(config):
    """A few real training steps with behemoth's pieces; each rank saves what it ends with."""
    from behemoth.data.images import rank_dataset
    from behemoth.data.order import rank_train_indices
    from behemoth.loop import sync_buffers, train_step
    from behemoth.models.registry import build_model
    from behemoth.optim import build_optimizer, warmup_cosine
    from behemoth.precision import grad_scaler
    from behemoth.tasks.image import ImageClassification

    cfg = config_from_dict(config["job"])
    index = ray.get(config["data_ref"])
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    torch.manual_seed(100 + rank)  # different initial weights per rank: DDP must make them agree
    model = ray.train.torch.prepare_model(build_model(cfg.model.name, len(index.classes)))
    opt = build_optimizer(model, cfg.train)
    sched = warmup_cosine(opt, cfg.train, 10)
    scaler, task = grad_scaler(torch.device("cpu"), "fp32"), ImageClassification(cfg, index)
    micro = cfg.train.global_batch_size // world
    indices = rank_train_indices(index.train.num_rows, cfg.train.global_batch_size, 0, 0, rank, world)
    seen = []
    ds = rank_dataset(index.train, indices, cfg.data, seed=0, epoch=0, train=True, batch_size=micro)
    for i, batch in enumerate(ds.iter_torch_batches(batch_size=micro)):
        train_step(model, opt, sched, scaler, [batch], cfg, task)
        seen += batch["sample_id"].tolist()
        if i == 3:
            break
    sync_buffers(model)  # what the loop does before evaluating or checkpointing (BatchNorm running stats)
    torch.save({"weights": model.module.state_dict(), "seen": seen}, f"{config['out']}/rank{rank}.pt")


def test_ddp_keeps_weights_identical_across_ranks(image_root, tmp_path):
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
    torch.manual_seed(101)
    from behemoth.models.registry import build_model

    rank1_init = build_model("resnet_tiny_cifar", 4).state_dict()
    changed = 0
    for name, w in r0["weights"].items():
        assert torch.equal(w, r1["weights"][name]), name
        changed += not torch.equal(w, rank1_init[name])
    assert changed > len(rank1_init) // 2  # trained, and not rank 1's own initialisation


def _final_weights(summary):
    return torch.load(f"{summary.latest_checkpoint}/model.pt")


def test_run_checkpoints_then_same_name_resumes_exactly(image_root, tmp_path):
    storage = tmp_path / "runs"
    # A constant learning rate: max_steps sets the schedule's horizon, so a 6-step run followed by a
    # 9-step resume only matches a straight 9-step run when the schedule does not depend on it.
    constant_lr = {"warmup_steps": 0, "min_lr_ratio": 1.0}
    first = train(config_from_dict(job_dict(image_root, storage, "resume", train={"max_steps": 6, **constant_lr})))
    assert first.metrics["step"] == 6 and first.resumed_from_step == 0
    assert 0.0 <= first.metrics["val_accuracy"] <= 1.0 and first.metrics["val_samples"] == 24
    kept = sorted(p for p in (storage / "resume").iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert len(kept) == 2  # every 3 steps, keep 2: steps 3 and 6
    assert [yaml.safe_load((p / "train_state.json").read_text())["step"] for p in kept] == [3, 6]

    # Same run name, longer run: continues at step 6 instead of starting over...
    resumed = train(config_from_dict(job_dict(image_root, storage, "resume", train={"max_steps": 9, **constant_lr})))
    assert resumed.resumed_from_step == 6 and resumed.metrics["step"] == 9
    assert (kept[-1] / "manifest.json").exists()  # nothing committed before is lost
    # ...and lands on exactly the weights of an uninterrupted 9-step run (same seed, CPU).
    straight = train(config_from_dict(job_dict(image_root, storage, "straight",
                                               train={"max_steps": 9, **constant_lr})))
    assert straight.resumed_from_step == 0
    a, b = _final_weights(resumed), _final_weights(straight)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # A damaged latest checkpoint is skipped (named in a warning) for the previous good one: tested with
    # the failure tests (test_fault_tolerance.py, R5).


@pytest.fixture
def images_with_corrupt_file(image_root, tmp_path):
    root = tmp_path / "images"
    shutil.copytree(image_root, root)
    bad = sorted((root / "train").glob("*/*.png"))[5]
    bad.write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    return root, bad


def test_corrupt_image_fails_the_run_naming_the_file(images_with_corrupt_file, tmp_path, capsys):
    root, bad = images_with_corrupt_file
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(root, tmp_path / "runs", "corrupt", train={"epochs": 1})))
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"cannot decode image {bad}" in err and "data.max_bad_samples" in err


def test_corrupt_image_within_budget_is_dropped_and_counted(images_with_corrupt_file, tmp_path, capsys):
    root, bad = images_with_corrupt_file
    cfg = tmp_path / "job.yaml"
    job = job_dict(root, tmp_path / "runs", "budget", train={"epochs": 1}, data={"max_bad_samples": 1})
    cfg.write_text(yaml.safe_dump(job))
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "dropped images:    1 undecodable in train, 0 in val" in out and "final val_acc:" in out
