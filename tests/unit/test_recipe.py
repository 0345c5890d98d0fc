"""Promises of the training recipe that README makes, each checked on the real code (no Ray): no weight
decay on biases and norm weights, warm-up then cosine down to min_lr_ratio, gradient clipping, a stable
val_fraction split, and a sweep rerun refused when its definition changed."""

import pytest
import torch
import torch.nn.functional as F

from behemoth.config import ConfigError, JobConfig, TrainConfig
from behemoth.data.text import is_validation
from behemoth.worker.loop import train_step
from behemoth.models.registry import build_model
from behemoth.worker.optim import build_optimizer, warmup_cosine
from behemoth.worker.precision import grad_scaler


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
    sched = warmup_cosine(opt, cfg, total_steps=20)
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


class _Regression:
    def loss(self, model, batch):
        return F.mse_loss(model(batch["x"]), batch["y"]), torch.tensor(float(len(batch["x"])))


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


def test_out_of_gpu_memory_in_a_step_is_a_config_error_that_is_not_retried():
    """A CUDA out-of-memory in a training step (raised here by the task's loss: no GPU on this machine) ends
    the run with one message saying what to change, as an error the failure policy does not retry."""
    from behemoth.errors import NOT_RETRIED, user_facing_error

    class _OutOfMemory:
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
    from behemoth.driver.sweep.config import load_sweep
    from behemoth.driver.sweep.run import _check_same_sweep
    from unit.test_tune import write_sweep

    first = load_sweep(write_sweep(tmp_path, image_root))
    sweep_dir = str(tmp_path / "sweeps" / "s")
    _check_same_sweep(first, sweep_dir)  # the first run stores its definition
    _check_same_sweep(first, sweep_dir)  # the same again: a resume, accepted
    changed = {"job": {"set": ["train.epochs=3"]}, "space": {"space": {"train.lr": {"grid": [0.5]}}},
               "num_samples": {"num_samples": 2}, "lr_scaling": {"lr_scaling": "linear"}}[change]
    again = load_sweep(write_sweep(tmp_path, image_root, **changed))
    with pytest.raises(ConfigError, match=rf"sweep 's' in .* was started with a different {change}: give"):
        _check_same_sweep(again, sweep_dir)
