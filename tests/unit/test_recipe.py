"""Promises of the training recipe that README makes, each checked on the real code (no Ray): no weight
decay on biases and norm weights, warm-up then cosine down to min_lr_ratio, gradient clipping, a stable
val_fraction split, and a sweep rerun refused when its definition changed."""

import pytest
import torch
import torch.nn.functional as F

from behemoth.config import ConfigError, JobConfig, TrainConfig
from behemoth.data.text.text import is_validation
from behemoth.worker.loop import train_step
from behemoth.models.registry import build_model
from behemoth.worker.optim import build_optimizer, lr_schedule
from behemoth.worker.precision import grad_scaler
from conftest import job_dict


def test_no_weight_decay_on_biases_and_norm_weights():
    """SGD with a zero gradient moves only what is decayed: every matrix/kernel shrinks, no 1-d parameter
    (bias, BatchNorm weight and bias) changes."""
    model = build_model("regnet_tiny_cifar", 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1, lr=0.5, momentum=0.0))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    one_d = [n for n, p in model.named_parameters() if p.ndim == 1]
    assert one_d and any("normalization" in n for n in one_d)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, before[name]), name
        else:
            assert torch.allclose(p, before[name] * (1 - 0.5 * 0.1)), name


def test_warmup_then_cosine_down_to_min_lr_ratio():
    cfg = TrainConfig(lr=0.4, warmup_steps=4, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = lr_schedule(opt, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    lrs.append(sched.get_last_lr()[0])  # after the last step
    assert lrs[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])  # linear from lr/warmup to lr
    assert lrs[4] == pytest.approx(0.4)  # the peak, then cosine
    assert all(a > b for a, b in zip(lrs[4:20], lrs[5:20]))
    assert lrs[12] == pytest.approx(0.04 + 0.36 * 0.5)  # halfway through the decay: the midpoint
    assert lrs[20] == pytest.approx(0.04)  # lr * min_lr_ratio at total_steps, and no lower


def _lrs(cfg, total_steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = lr_schedule(opt, cfg, total_steps=total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs + [sched.get_last_lr()[0]]


def test_the_linear_constant_and_warmup_stable_decay_schedules():
    """train.schedule (issue 58): each after the same linear warm-up; linear and wsd end at lr * min_lr_ratio,
    wsd holding lr until its last wsd_decay_fraction of the steps after the warm-up."""
    warm = [0.1, 0.2, 0.3, 0.4]
    linear = _lrs(TrainConfig(lr=0.4, warmup_steps=4, min_lr_ratio=0.1, schedule="linear"), 20)
    assert linear[:4] == pytest.approx(warm) and linear[4] == pytest.approx(0.4)
    assert linear[12] == pytest.approx(0.04 + 0.36 * 0.5) and linear[20] == pytest.approx(0.04)
    assert [round(a - b, 9) for a, b in zip(linear[4:20], linear[5:21])] == [round(0.36 / 16, 9)] * 16  # straight
    constant = _lrs(TrainConfig(lr=0.4, warmup_steps=4, min_lr_ratio=0.1, schedule="constant"), 20)
    assert constant[:4] == pytest.approx(warm) and constant[4:] == pytest.approx([0.4] * 17)
    wsd = _lrs(TrainConfig(lr=0.4, warmup_steps=4, min_lr_ratio=0.1, schedule="wsd", wsd_decay_fraction=0.25), 20)
    assert wsd[:4] == pytest.approx(warm)
    assert wsd[4:17] == pytest.approx([0.4] * 13)  # stable through 75 % of the 16 steps after the warm-up
    assert wsd[18] == pytest.approx(0.04 + 0.36 * 0.5) and wsd[20] == pytest.approx(0.04)  # decayed in the last 4


def test_a_schedule_or_early_stopping_that_cannot_work_is_refused_before_ray(tmp_path):
    from behemoth.errors import ConfigError
    from behemoth.job import config_from_dict

    job = {"data": {"kind": "image_folder", "root": str(tmp_path)}, "model": {"name": "regnet_tiny_cifar"}}
    for train, message in (({"schedule": "step"}, r"train.schedule must be one of"),
                           ({"wsd_decay_fraction": 0}, r"train.wsd_decay_fraction must be in \(0, 1\]"),
                           ({"early_stopping": {"patience": 0}}, r"train.early_stopping.patience must be > 0"),
                           ({"early_stopping": {"metric": "val_perplexity"}},
                            r"train.early_stopping.metric val_perplexity is not a metric this task reports"),
                           ({"early_stopping": {"metrc": "val_loss"}}, r"unknown key 'train.early_stopping.metrc'")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**job, "train": train})
    cfg = config_from_dict({**job, "train": {"early_stopping": {"patience": 2}}})
    assert cfg.train.early_stopping.metric is None and cfg.train.early_stopping.patience == 2


class _Regression:
    def loss(self, model, batch):
        return F.mse_loss(model(batch["x"]), batch["y"]), torch.tensor(float(len(batch["x"])))

    def loss_items(self, batch):  # the Task contract's default: each micro-batch's mean weighs the same
        return None


def _grad_norm_at_update(grad_clip):
    """The gradient norm the optimizer applies, from behemoth's train_step (before_update runs after the clip)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    cfg = JobConfig()
    cfg.train.grad_clip = grad_clip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batch = {"x": torch.randn(16, 8) * 10, "y": torch.randn(16, 1) * 100}
    seen = []
    train_step(model, opt, sched, grad_scaler(torch.device("cpu"), "fp32"), [batch], cfg, _Regression(),
               torch.device("cpu"), before_update=lambda: seen.append(
                   torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()))
    return seen[0]


def test_grad_clip_bounds_the_applied_gradient_norm():
    assert _grad_norm_at_update(None) > 10
    assert _grad_norm_at_update(1.0) == pytest.approx(1.0, rel=1e-5)


def _steps_with_a_nan(nonfinite: str, optimizer: str):
    """Three steps of behemoth's train_step on a small regression, the second with a NaN in its batch; the
    model, the optimizer's state and the norms the steps returned, after each step."""
    from behemoth.worker.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    cfg = JobConfig()
    cfg.train.nonfinite, cfg.train.optimizer, cfg.train.lr = nonfinite, optimizer, 0.01
    opt = build_optimizer(model, cfg.train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    after = []
    for i in range(3):
        x = torch.randn(16, 8)
        if i == 1:
            x[3, 2] = float("nan")
        _, _, norm = train_step(model, opt, sched, grad_scaler(torch.device("cpu"), "fp32"),
                                [{"x": x, "y": torch.randn(16, 1)}], cfg, _Regression(), torch.device("cpu"))
        moments = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                   for i, entry in opt.state_dict()["state"].items()}  # (copies: the live state changes on)
        after.append(({k: v.clone() for k, v in model.state_dict().items()}, moments, norm))
    return after


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_step_with_a_non_finite_gradient_is_skipped_whole_with_nonfinite_skip(optimizer):
    """train.nonfinite: skip (issue 58): the step whose gradient norm is NaN changes neither the weights nor the
    optimizer's state (AdamW's moments and step count, SGD's momentum), nor BatchNorm's statistics, which its
    forward had already moved (NaN in every evaluation after: they are put back); the next step trains on. With
    stop, the same step poisons the weights (the run then stops at its next report: Reporter.nonfinite_guard)."""
    skipped = _steps_with_a_nan("skip", optimizer)
    (w0, s0, n0), (w1, s1, n1), (w2, s2, n2) = skipped
    assert torch.isfinite(n0) and not torch.isfinite(n1) and torch.isfinite(n2)
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "the skipped step changed a weight"
    for pid in s0:
        for key, value in s0[pid].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(s1[pid][key])), (pid, key)
    assert not all(torch.equal(w1[k], w2[k]) for k in w1) and all(torch.isfinite(v).all() for v in w2.values())
    stopped = _steps_with_a_nan("stop", optimizer)
    assert not all(torch.isfinite(v).all() for v in stopped[1][0].values())


def test_the_gradient_norm_is_the_norm_of_every_gradient_before_clipping():
    from behemoth.worker.parallel import grad_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    F.mse_loss(model(torch.randn(16, 8) * 10), torch.randn(16, 1) * 100).backward()
    expected = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert grad_norm(model).item() == pytest.approx(expected.item(), rel=1e-6)
    assert grad_norm(model, clip=1.0).item() == pytest.approx(expected.item(), rel=1e-6)  # before clipping
    clipped = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped.item() == pytest.approx(1.0, rel=1e-5)


def test_a_non_finite_window_stops_the_run_naming_its_step_or_counts_skipped_steps():
    """The report's guard (Reporter.nonfinite_guard): under stop, one NonFiniteError naming the first step whose
    norm was NaN (a failure not retried); under skip, the skipped steps counted in the train state; a
    non-finite loss stops under either."""
    from types import SimpleNamespace

    from behemoth.errors import NOT_RETRIED, NonFiniteError, user_facing_error
    from behemoth.metrics import Window
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.reporting import Reporter

    def window(norms):
        w = Window()
        for n in norms:
            w.add(torch.tensor(1.0), torch.tensor(2.0), 0.0, (), torch.tensor(n))
        return w

    def guard(mode, norms, loss_sum=1.0, step=40):
        cfg = JobConfig()
        cfg.train.nonfinite = mode
        reporter = SimpleNamespace(cfg=cfg, world=2, run=SimpleNamespace(scaler=grad_scaler(torch.device("cpu"), "fp32")))
        state, w = TrainState(step=step), window(norms)
        _, bad, first = w.grad_norm_stats()
        Reporter.nonfinite_guard(reporter, state, w, loss_sum, bad * 2, first)  # (summed over 2 ranks)
        return state

    norm, bad, first = window([1.0, 3.0, float("nan"), float("inf")]).grad_norm_stats()
    assert (norm, bad, first) == (2.0, 2, 2)
    with pytest.raises(NonFiniteError, match=r"^step 39: the gradient norm is not finite .*checkpoints before step "
                                             r"39 are kept") as e:
        guard("stop", [1.0, 3.0, float("nan"), float("inf")])  # steps 37-40: the third is 39
    assert user_facing_error(RuntimeError(f"...\nbehemoth.errors.NonFiniteError: {e.value}"), NOT_RETRIED)
    assert guard("skip", [1.0, float("nan"), float("nan"), 2.0]).skipped_steps == 2
    assert guard("stop", [1.0, 2.0]).skipped_steps == 0
    with pytest.raises(NonFiniteError, match=r"^steps 39-40: the loss is not finite"):
        guard("skip", [1.0, 2.0], loss_sum=float("nan"))


def test_out_of_gpu_memory_in_a_step_is_a_config_error_that_is_not_retried():
    """A CUDA out-of-memory in a training step (raised here by the task's loss: no GPU on this machine) ends
    the run with one message saying what to change, as an error the failure policy does not retry."""
    from behemoth.errors import NOT_RETRIED, user_facing_error

    class _OutOfMemory(_Regression):
        def loss(self, model, batch):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = JobConfig()
    cfg.train.micro_batch_size = 8
    with pytest.raises(ConfigError, match=r"out of GPU memory in a training step \(train.micro_batch_size 8, 2 "
                                          r"micro-batch\(es\) per step.*Lower train.micro_batch_size") as e:
        train_step(model, opt, sched, grad_scaler(torch.device("cpu"), "fp32"), [{}, {}], cfg, _OutOfMemory(),
                   torch.device("cpu"))
    # what the failure policy sees: Ray's wrapper of the worker's error, with its text
    wrapped = RuntimeError(f"Traceback ...\nbehemoth.errors.ConfigError: {e.value}")
    assert user_facing_error(wrapped, NOT_RETRIED) == str(e.value)


def test_val_fraction_split_is_stable():
    """A document's split depends on its text and the seed only: not on its position, nor on the corpus."""
    docs = [f"document number {i} about something" for i in range(2000)]
    split = {d: is_validation(d, 0, 0.1) for d in docs}
    assert 150 < sum(split.values()) < 250  # ~10%
    shuffled = list(reversed(docs[:500])) + ["another text"] * 3
    assert all(is_validation(d, 0, 0.1) == split[d] for d in shuffled if d in split)
    assert len({is_validation("another text", 0, 0.1) for _ in range(3)}) == 1  # duplicates stay together
    other_seed = {d: is_validation(d, 1, 0.1) for d in docs}
    assert other_seed != split


@pytest.mark.parametrize("change", ["job", "space", "num_samples", "lr_scaling"])
def test_a_sweep_rerun_with_another_definition_is_refused(tmp_path, image_root, change):
    from pathlib import Path

    from behemoth.driver.sweep.config import load_sweep
    from behemoth.driver.sweep.tuner import _check_same_sweep, _record_sweep
    from unit.test_tune import write_sweep

    first = load_sweep(write_sweep(tmp_path, image_root))
    sweep_dir = str(tmp_path / "sweeps" / "s")
    _record_sweep(sweep_dir, _check_same_sweep(first, sweep_dir))  # the first run stores its definition
    (Path(sweep_dir) / "tuner.pkl").write_bytes(b"")  # and Tune its state (Tuner.can_restore): a rerun resumes
    _check_same_sweep(first, sweep_dir)  # the same again: a resume, accepted
    changed = {"job": {"set": ["train.epochs=3"]}, "space": {"space": {"train.lr": {"grid": [0.5]}}},
               "num_samples": {"num_samples": 2}, "lr_scaling": {"lr_scaling": "linear"}}[change]
    again = load_sweep(write_sweep(tmp_path, image_root, **changed))
    # (the job's epochs also move ASHA's max_t, which defaults to them: named with it, the scheduler)
    named = {"job": r"job \(train.epochs\) and scheduler"}.get(change, change)
    with pytest.raises(ConfigError, match=rf"sweep 's' in .* was started with a different {named}: give"):
        _check_same_sweep(again, sweep_dir)


def test_early_stopping_counts_evaluations_without_improvement_in_the_train_state():
    """train.early_stopping (issue 58): the task's direction (val_loss: min), min_delta, patience; the counts
    live in TrainState, so a state written to a checkpoint and read back counts on where it was."""
    import dataclasses
    import json

    from behemoth.config import EarlyStoppingConfig
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.early_stopping import early_stop

    class _Task:
        best, reported = ("val_accuracy", "max"), {"val_accuracy": "max", "val_loss": "min", "loss": "min"}

    cfg = JobConfig()
    cfg.train.early_stopping = EarlyStoppingConfig(metric="val_loss", patience=2, min_delta=0.05)
    state = TrainState()
    decisions = []
    for step, val_loss in ((10, 1.0), (20, 0.9), (30, 0.88), (40, 0.7)):
        state.step = step
        decisions.append(early_stop(cfg, _Task(), state, {"val_loss": val_loss}, total_steps=100))
    assert decisions == [False, False, False, False] and state.best_metric == 0.7
    state.step = 50
    assert early_stop(cfg, _Task(), state, {"val_loss": 0.66}, 100) is False  # 0.04 is not more than 0.05
    resumed = TrainState(**json.loads(json.dumps(dataclasses.asdict(state))))  # a checkpoint's train_state.json
    assert resumed.evals_without_improvement == 1 and resumed.stopped_early_at is None
    resumed.step = 60
    assert early_stop(cfg, _Task(), resumed, {"val_loss": 0.69}, 100) is True
    assert resumed.stopped_early_at == 60 and resumed.last_step(100) == 60 and TrainState().last_step(100) == 100
    # default metric: the task's best, in its direction (accuracy: higher is better)
    cfg.train.early_stopping = EarlyStoppingConfig(patience=1)
    state = TrainState(step=10)
    assert not early_stop(cfg, _Task(), state, {"val_accuracy": 0.5}, 100)
    state.step = 20
    assert not early_stop(cfg, _Task(), state, {"val_accuracy": 0.6}, 100)
    state.step = 30
    assert early_stop(cfg, _Task(), state, {"val_accuracy": 0.59}, 100) and state.stopped_early_at == 30


def _stopped_state(**fields):
    from behemoth.storage.checkpoint import TrainState

    return TrainState(**{"step": 40, "best_metric": 0.7, "evals_without_improvement": 3, "stopped_early_at": 40,
                         "early_stopping_metric": "val_accuracy", **fields})


class _ImageLikeTask:
    best, reported = ("val_accuracy", "max"), {"val_accuracy": "max", "val_loss": "min", "loss": "min"}


@pytest.mark.parametrize("change", ["off", "patience raised", "patience kept", "metric changed"])
def test_a_rerun_of_an_early_stopped_run_trains_on_where_the_rule_no_longer_stops_it(change):
    """Issue 65: a rerun of a run that stopped early trains on (and says so) where early stopping is off now or
    its patience is above the evaluations counted; with the same rule it stays stopped (the loop then says how
    to go on: Reporter.completed_run). Another early_stopping.metric starts the counts again: the best value
    so far is another metric's, maybe in the other direction."""
    from behemoth.config import EarlyStoppingConfig
    from behemoth.worker.early_stopping import resume_early_stopping

    cfg = JobConfig()
    cfg.train.early_stopping = {"off": None, "patience raised": EarlyStoppingConfig(patience=5),
                                "patience kept": EarlyStoppingConfig(patience=3),
                                "metric changed": EarlyStoppingConfig(metric="val_loss", patience=3)}[change]
    state = _stopped_state()
    line = resume_early_stopping(cfg, _ImageLikeTask(), state)
    if change == "patience kept":
        assert line is None and state.stopped_early_at == 40 and state.last_step(100) == 40
        return
    assert state.stopped_early_at is None and state.last_step(100) == 100
    assert "the run stopped early at step 40 (train.early_stopping)" in line and "trains on from step 40" in line
    assert {"off": "early stopping is off now", "patience raised": "patience 5, 3 evaluation(s) without",
            "metric changed": "patience 3, 0 evaluation(s) without"}[change] in line
    if change == "metric changed":
        assert line.startswith("train.early_stopping.metric val_accuracy -> val_loss: its counts start again")
        assert (state.best_metric, state.evals_without_improvement) == (None, 0)
        assert state.early_stopping_metric == "val_loss"
    else:
        assert (state.best_metric, state.evals_without_improvement) == (0.7, 3)


def test_another_early_stopping_metric_resets_the_counts_of_a_run_still_going():
    """Issue 65: val_accuracy's best (0.7, higher is better) must not be compared with val_loss (lower is
    better): without the reset, a val_loss of 0.9 counts as no improvement on 0.7 and the run stops."""
    from behemoth.config import EarlyStoppingConfig
    from behemoth.worker.early_stopping import early_stop, resume_early_stopping

    cfg = JobConfig()
    cfg.train.early_stopping = EarlyStoppingConfig(metric="val_loss", patience=1)
    state = _stopped_state(stopped_early_at=None, evals_without_improvement=0)
    assert "its counts start again" in resume_early_stopping(cfg, _ImageLikeTask(), state)
    state.step = 50
    assert not early_stop(cfg, _ImageLikeTask(), state, {"val_loss": 0.9}, 100) and state.best_metric == 0.9
    assert resume_early_stopping(cfg, _ImageLikeTask(), state) is None  # the same metric again: nothing to say


def test_retention_keeps_the_best_checkpoint_of_an_early_stopped_run_and_the_latest(tmp_path, image_root):
    """Issue 65: with the defaults (patience 3, checkpoint.keep 3) newest-K retention rotated the best checkpoint
    out before the stop. Ray Train 2.60's own checkpoint manager (the real one, driven with the CheckpointConfig
    behemoth gives it, without Ray) keeps the best 3 by the run's metric and the latest; a lane keeps the same
    (checkpoints/retention.kept_indices); the summary names the best. A checkpoint without an evaluation ranks
    below the evaluated ones."""
    import asyncio
    from types import SimpleNamespace

    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from behemoth.checkpoints.retention import kept_indices
    from behemoth.driver.run.resume import retention, run_place
    from behemoth.driver.run.summary import summarise
    from behemoth.job import config_from_dict
    from behemoth.metrics import CHECKPOINT_SCORE, checkpoint_score

    cfg = config_from_dict(job_dict(image_root, tmp_path, train={"early_stopping": {"metric": "val_loss"}},
                                    checkpoint={"keep": 3}))
    assert cfg.checkpoint.keep == 3 and cfg.train.early_stopping.patience == 3
    # val_loss (lower is better) at each checkpoint, None where it did not evaluate: best at step 20, then 3
    # evaluations without improvement and the stop at step 50 (newest-3 would keep 40, 45, 50)
    losses = [(10, 0.9), (20, 0.5), (25, None), (30, 0.6), (40, 0.55), (45, None), (50, 0.7)]
    place = run_place(cfg)
    storage = StorageContext(storage_path=place.storage, experiment_dir_name=place.name)
    reported = []

    async def run():
        manager = CheckpointManager(retention(cfg), storage)
        for step, loss in losses:
            path = tmp_path / "t" / f"checkpoint_{step:03d}"
            path.mkdir(parents=True)
            metrics = {"step": step, **({"val_loss": loss} if loss is not None else {}),
                       CHECKPOINT_SCORE: checkpoint_score(loss, "min")}
            reported.append(metrics)
            manager.register_checkpoint(_TrainingReport(Checkpoint(str(path)), metrics, None))
        return manager

    manager = asyncio.run(run())
    kept = sorted(p.name for p in (tmp_path / "t").glob("checkpoint_*") if p.is_dir())
    assert kept == ["checkpoint_020", "checkpoint_030", "checkpoint_040", "checkpoint_050"]  # best 3 + latest
    order = retention(cfg).checkpoint_score_order
    assert [losses[i][0] for i in kept_indices(reported, cfg.checkpoint.keep, order)] == [20, 30, 40, 50]  # a lane keeps the same
    result = SimpleNamespace(metrics=reported[-1], checkpoint=manager.latest_checkpoint_result.checkpoint,
                             return_value={}, best_checkpoints=[(r.checkpoint, r.metrics)
                                                                for r in manager.best_checkpoint_results])
    summary = summarise(cfg, result, 1.0)
    assert summary.best_checkpoint.endswith("checkpoint_020") and summary.best_value == 0.5
    assert summary.latest_checkpoint.endswith("checkpoint_050") and CHECKPOINT_SCORE not in summary.metrics
    assert any("best checkpoint:" in line and "checkpoint_020 (val_loss 0.5000)" in line for line in summary.lines())


def test_mixup_and_cutmix_mix_each_sample_with_its_partner_and_say_in_what_share():
    """data.mixup_alpha / cutmix_alpha (issue 58, data/image/mixing.py): mixup blends each sample with the mirrored one
    by its share, cutmix pastes a box of it (the share is what is left of the sample's own pixels); the draws
    come from torch's reseeded generator, so the same seed mixes the same way (exact resume)."""
    from behemoth.data.image.mixing import mix

    images = torch.rand(6, 3, 8, 8)
    labels, valid = torch.arange(6), torch.tensor([True, True, False, True, True, True])
    torch.manual_seed(7)
    m = mix(images, labels, valid, 0.4, 0.0)
    share = m.share[:, None, None, None]
    assert torch.allclose(m.images, images * share + images.flip(0) * (1 - share))
    assert ((m.share > 0) & (m.share < 1)).all() and m.partner_labels.tolist() == [5, 4, 3, 2, 1, 0]
    assert m.partner_valid.tolist() == [True, True, True, False, True, True]
    torch.manual_seed(7)
    assert torch.equal(mix(images, labels, valid, 0.4, 0.0).images, m.images)  # the same seed, the same mix

    torch.manual_seed(3)
    c = mix(images, labels, valid, 0.0, 1.0)
    own, theirs = (c.images == images).all(dim=1), (c.images == images.flip(0)).all(dim=1)
    assert (own | theirs).all()  # every pixel is the sample's or its partner's
    assert torch.allclose(c.share, own.float().mean(dim=(1, 2)))
    assert (c.share < 1).any()  # (a box was pasted somewhere)

    torch.manual_seed(5)
    both = mix(images, labels, valid, 0.4, 1.0)
    blended = ~((both.images == images) | (both.images == images.flip(0))).all(dim=1).all(dim=(1, 2))
    assert blended.any() and (~blended).any()  # some samples blended, some cut (seeded: both happen here)
    assert mix(images, labels, valid, 0.0, 0.0) is None


@pytest.mark.parametrize("mixup", [0.0, 0.4])
def test_with_bad_samples_the_image_step_is_a_mean_over_its_samples_not_of_micro_batch_means(mixup):
    """data.max_bad_samples: a micro-batch that lost 2 of its 4 images weighed as much as a whole one, so each of
    its samples counted twice as much as each of the other's; now the accumulated gradient is one batch's."""
    from types import SimpleNamespace

    from behemoth.tasks.image import ImageClassification
    from behemoth.worker.loop import loss_weights

    task = object.__new__(ImageClassification)
    data = SimpleNamespace(mean=[0.5] * 3, std=[0.25] * 3, label_smoothing=0.0, mixup_alpha=mixup, cutmix_alpha=0.0,
                           max_bad_samples=10)
    task.cfg, task.transformers_model, task._mean_std = SimpleNamespace(data=data), False, {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 7))
    batches = [{"image": torch.randint(0, 256, (4, 4, 4, 3), dtype=torch.uint8), "label": torch.randint(0, 7, (4,)),
                "valid": torch.tensor(valid), "sample_id": torch.arange(4)}
               for valid in ([True, True, False, False], [True] * 4)]
    weights = loss_weights(task, batches)
    if mixup:  # a sample whose partner (the mirrored one: mixing.mix) did not decode carries no loss either
        assert [int(task.loss_items(b)) for b in batches] == [0, 4] and [float(w) for w in weights] == [0.0, 1.0]
        return
    assert [int(task.loss_items(b)) for b in batches] == [2, 4]
    for batch, weight in zip(batches, weights):
        (task.loss(model, batch)[0] * weight).backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    task.loss(model, {k: torch.cat([b[k] for b in batches]) for k in batches[0]})[0].backward()
    for got, want in zip(accumulated, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    data.max_bad_samples = 0  # every sample decodes or the run stops: no count, no all-reduce
    assert task.loss_items(batches[0]) is None


def test_the_image_loss_smooths_labels_and_weighs_a_mixed_samples_two_labels():
    from types import SimpleNamespace

    from behemoth.tasks.image import ImageClassification

    task = object.__new__(ImageClassification)
    data = SimpleNamespace(mean=[0.5] * 3, std=[0.25] * 3, label_smoothing=0.1, mixup_alpha=0.0, cutmix_alpha=0.0)
    task.cfg, task.transformers_model, task._mean_std = SimpleNamespace(data=data), False, {}
    task.index = SimpleNamespace(classes=[str(i) for i in range(7)])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 7))
    batch = {"image": torch.randint(0, 256, (4, 4, 4, 3), dtype=torch.uint8), "label": torch.tensor([0, 1, 2, 6]),
             "valid": torch.ones(4, dtype=torch.bool), "sample_id": torch.arange(4)}
    logits = model(task.pixel_values(batch))
    loss, n = task.loss(model, batch)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, batch["label"], label_smoothing=0.1).item(), rel=1e-6)
    data.mixup_alpha = 0.4
    torch.manual_seed(1)
    loss, n = task.loss(model, batch)
    torch.manual_seed(1)
    from behemoth.data.image.mixing import mix

    m = mix(task.pixel_values(batch), batch["label"], batch["valid"], 0.4, 0.0)
    mixed_logits = model(m.images)
    expected = (m.share * F.cross_entropy(mixed_logits, batch["label"], reduction="none", label_smoothing=0.1)
                + (1 - m.share) * F.cross_entropy(mixed_logits, m.partner_labels, reduction="none",
                                                  label_smoothing=0.1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6) and n.item() == 4
    # top-5 accuracy in evaluation, where there are more than 5 classes
    sums = task.eval_sums(model, batch)
    top5 = (logits.topk(5, dim=1).indices == batch["label"][:, None]).any(dim=1).sum()
    assert sums["correct_top5"].item() == top5.item() >= sums["correct"].item()
    metrics = task.eval_metrics({k: float(v) for k, v in sums.items()})
    assert metrics["val_top5_accuracy"] == top5.item() / 4
    task.index = SimpleNamespace(classes=["a", "b", "c"])
    assert "val_top5_accuracy" not in task.eval_metrics({k: float(v) for k, v in sums.items()})


def test_a_profiled_window_of_steps_lands_in_the_run_folder_and_the_report_links_it(tmp_path):
    """train.profile (issue 58): the steps of the window, recorded by torch.profiler on each rank, as a Chrome
    trace in RUN/profile/ (through the host's storage: local or a bucket); nothing outside the window; the
    run's report links every file there."""
    import json
    from types import SimpleNamespace

    import pyarrow.fs

    from behemoth import hosts
    from behemoth.config import ProfileConfig
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.profiling import StepProfiler

    run = tmp_path / "run"

    class _Host(hosts.WorkerHost):
        def storage(self):
            return pyarrow.fs.LocalFileSystem(), str(run)

    cfg = SimpleNamespace(train=SimpleNamespace(profile=ProfileConfig(start_step=2, steps=2)))
    model = torch.nn.Linear(16, 16)
    state, profiler = TrainState(), StepProfiler(cfg, rank=1, device=torch.device("cpu"))
    with hosts.hosted(_Host()):
        for _ in range(6):
            profiler.before_step(None, state)
            model(torch.randn(4, 16)).sum().backward()
            state.step += 1
            profiler.after_step(None, state)
    files = sorted(p.name for p in (run / "profile").iterdir())
    assert files == ["rank1.steps-3-4.pt.trace.json"]
    events = json.loads((run / "profile" / files[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::addmm" for e in events)  # the steps' matmuls, as the profiler saw them
    # exactly the window's steps, each marked with the run's step (issue 65: a window started two steps early
    # still wrote a file named for steps 3-4)
    marked = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert marked == ["ProfilerStep#3", "ProfilerStep#4"]
    assert sum(e.get("name") == "aten::addmm" for e in events) == 2  # one matmul a step: two steps recorded

    from behemoth.tracking.run_report import _profile_links

    (links,) = _profile_links(str(run))
    assert '<a href="../profile/rank1.steps-3-4.pt.trace.json">' in links and "ui.perfetto.dev" in links
    assert _profile_links(str(tmp_path / "other")) == []


def test_warmup_in_epochs_follows_the_global_batch():
    """train.warmup_epochs (issue 59): the warm-up covers the same share of the data whatever the batch (a
    batch-size sweep compares like with like): 2 epochs of 10 steps warm up over 20 steps, of 5 steps over 10."""
    from behemoth.worker.optim import warmup_steps

    cfg = TrainConfig(lr=0.4, warmup_epochs=2)
    assert warmup_steps(cfg, epoch_steps=10) == 20 and warmup_steps(cfg, epoch_steps=5) == 10
    assert warmup_steps(TrainConfig(warmup_epochs=0.5), epoch_steps=3) == 2  # rounded up
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = lr_schedule(opt, cfg, total_steps=100, epoch_steps=10)
    lrs = []
    for _ in range(21):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.02) and lrs[18] == pytest.approx(0.38) and lrs[19] == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="train.warmup_epochs must be >= 0 and replaces train.warmup_steps"):
        TrainConfig(warmup_epochs=1, warmup_steps=5).validate()


def test_a_diverged_evaluation_is_never_early_stoppings_best_nor_the_summarys():
    """A first evaluation of NaN became early stopping's best, and every later value compared False against it:
    the run stopped at its patience while its metric improved. The summary's best ranked NaN and a null (Ray's
    snapshot keeps a non-finite value so) among the scores, and broke a tie to the older checkpoint."""
    from types import SimpleNamespace

    from behemoth.config import EarlyStoppingConfig
    from behemoth.driver.run.summary import summarise
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.early_stopping import early_stop

    class _Task:
        best, reported = ("val_accuracy", "max"), {"val_accuracy": "max", "val_loss": "min", "loss": "min"}

    cfg = JobConfig()
    cfg.train.early_stopping = EarlyStoppingConfig(metric="val_loss", patience=2)
    state = TrainState()
    decisions = []
    for step, val_loss in ((10, float("nan")), (20, 2.0), (30, 1.5), (40, float("inf")), (50, 1.0)):
        state.step = step
        decisions.append(early_stop(cfg, _Task(), state, {"val_loss": val_loss}, total_steps=100))
    assert decisions == [False] * 5 and state.best_metric == 1.0

    from behemoth.job import config_from_dict
    from conftest import job_dict

    cfg = config_from_dict(job_dict("/tmp/unused", "/tmp/unused"))  # the task's metric: val_accuracy, max
    ckpt = lambda name: SimpleNamespace(path=f"/tmp/unused/t/{name}")  # noqa: E731
    best = [(ckpt("checkpoint_2026-12-01_08-00-02"), {"val_accuracy": float("nan")}),
            (ckpt("checkpoint_2026-12-01_08-00-01"), {"val_accuracy": 0.5}),
            (ckpt("checkpoint_2026-12-01_08-00-03"), {"val_accuracy": 0.5}),
            (ckpt("checkpoint_2026-12-01_08-00-04"), {"val_accuracy": None})]
    result = SimpleNamespace(metrics={"step": 4}, checkpoint=best[-1][0], return_value={}, best_checkpoints=best)
    summary = summarise(cfg, result, 1.0)
    assert summary.best_value == 0.5 and summary.best_checkpoint.endswith("checkpoint_2026-12-01_08-00-03")
