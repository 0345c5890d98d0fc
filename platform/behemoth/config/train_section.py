"""The job config's `train:` section (the optimizer, schedule, precision, batch plan and what a run does around its
steps: early stopping, profiling, the weight average, the non-finite guard) and the two small sections it
holds. config/schema.py holds the others and the job."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from behemoth.errors import ConfigError


def positive(key: str, value: float) -> None:
    within(key, value, 0, bounds="()")


def within(key: str, value: float, low: float, high: float = math.inf, bounds: str = "[)", hint: str = "") -> None:
    """Refuse `value` outside the interval from `low` to `high`, each end closed ('[', ']') or open ('(', ')').
    Written so that NaN, which compares false with everything, is outside every interval."""
    above = value >= low if bounds[0] == "[" else value > low
    below = value <= high if bounds[1] == "]" else value < high
    if not (above and below):
        where = (f"{'>=' if bounds[0] == '[' else '>'} {low}" if high == math.inf
                 else f"in {bounds[0]}{low}, {high}{bounds[1]}")
        raise ConfigError(f"{key} must be {where}{hint}, got {value!r}")


def check_finite(value: Any, key: str) -> None:
    """Every float of a config (a section's fields, nested sections, lists and mappings of them) is a finite
    number: one rule for every key, checked before any range (NaN passes a `< 0` check, and a NaN learning
    rate, clip or alpha trains without an error)."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            check_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(v, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")


@dataclass
class EarlyStoppingConfig:
    # The metric (None: the task's best, e.g. val_accuracy); checked at each evaluation.
    metric: Optional[str] = None
    # Evaluations in a row without an improvement of more than min_delta before the run stops.
    patience: int = 3
    min_delta: float = 0.0

    def validate(self) -> None:
        positive("train.early_stopping.patience", self.patience)
        within("train.early_stopping.min_delta", self.min_delta, 0)


@dataclass
class ProfileConfig:
    # Record steps start_step + 1 .. start_step + steps with torch.profiler (worker/profiling.py).
    start_step: int = 10
    steps: int = 3

    def validate(self) -> None:
        within("train.profile.start_step", self.start_step, 0)
        positive("train.profile.steps", self.steps)


@dataclass
class TrainConfig:
    epochs: int = 1
    # Stop after this many optimizer steps even if epochs remain (None: run all epochs).
    max_steps: Optional[int] = None
    # Samples per optimizer step summed over all workers; split evenly over them.
    global_batch_size: int = 128
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    # AdamW's (beta1, beta2) and epsilon (language models commonly use betas 0.9, 0.95). On a GPU AdamW runs
    # torch's fused kernel (the same update within float rounding); on a CPU its default (foreach) one.
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    # The learning-rate schedule after a linear warm-up from 0 over warmup_steps: cosine or linear decay to
    # lr * min_lr_ratio at the last step, constant at lr, or wsd (warmup-stable-decay: constant at lr, then a
    # linear decay to lr * min_lr_ratio over the last wsd_decay_fraction of the steps after the warm-up).
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = 0
    # The warm-up in epochs instead (e.g. 5: ImageNet's recipe): its steps follow the global batch, so a sweep
    # over train.global_batch_size warms every trial up over the same share of the data.
    warmup_epochs: Optional[float] = None
    min_lr_ratio: float = 0.0
    wsd_decay_fraction: float = 0.2
    # Clip the gradient norm to this (the norm, clipped or not, is in every report as grad_norm).
    grad_clip: Optional[float] = None
    # A step whose gradient norm is not finite (NaN/Inf): stop the run at the next report with one line naming
    # the step (nothing after the last good checkpoint is saved), or skip it (no update: the optimizer runs
    # fused and leaves the weights and its state as they were; the skipped steps are counted in the reports).
    # With train.precision fp16 the gradient scaler skips overflowing steps itself; a non-finite loss stops.
    nonfinite: Literal["stop", "skip"] = "stop"
    # Stop a run whose evaluation metric has not improved by more than min_delta for `patience` evaluations
    # in a row (the metric: one of the task's reported ones; its direction is the task's). Kept in the
    # checkpoints: a resumed run counts on; a rerun of a run that stopped early trains nothing.
    early_stopping: Optional[EarlyStoppingConfig] = None
    # Profiler traces of a window of steps, per rank, into the run folder's profile/ (and a CUDA memory
    # snapshot on a GPU); None: off.
    profile: Optional[ProfileConfig] = None
    # An exponential moving average of the weights (e.g. 0.9999), updated every step; evaluated, exported and
    # kept in checkpoints instead of the raw weights for everything but training (worker/ema.py). None: off.
    ema_decay: Optional[float] = None
    # fp32, or autocast to bf16 (CPU and GPU) / fp16 (GPU only, with a gradient scaler). Weights stay fp32.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Micro-batches per optimizer step on each worker: global_batch_size = micro-batch x grad_accum_steps x
    # workers. Gradients are all-reduced once per step (DDP no_sync on the other micro-batches).
    grad_accum_steps: int = 1
    # Per-worker micro-batch instead of grad_accum_steps: an int, or auto (the largest that fits the device's
    # memory: a search before training, under auto_batch_memory_mb on CPU). Accumulation then keeps
    # global_batch_size: grad_accum_steps = global_batch_size / (workers x micro-batch). None: use
    # grad_accum_steps.
    micro_batch_size: Union[int, Literal["auto"], None] = None
    # The memory a worker's training step may use when micro_batch_size is auto: required on CPU (no
    # allocator limit to hit); on GPU it defaults to 90% of the device's memory.
    auto_batch_memory_mb: Optional[float] = None
    # torch.compile (mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs): each of the
    # model's blocks (transformer layers, residual units: worker/block_transforms.py), or the whole model where it has
    # none. A compilation failure at the first step falls back to eager training, with a console line.
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    # DDP gradient compression: fp16/bf16 halve the bytes of each all-reduce; powersgd sends rank-r factors
    # (after powersgd_warmup_steps of plain all-reduce) with per-rank error feedback kept in the checkpoint.
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    # Activation checkpointing of the model's blocks: none, full (every block) or N (every N-th block). The
    # same gradients; a block's inner activations are recomputed in the backward instead of kept (about one
    # more forward's compute for the activation memory of about one block). Applied before compile and FSDP.
    activation_checkpointing: Union[Literal["none", "full"], int] = "none"
    # fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer GPUs; precision fp32), MFU then
    # against TF32's peak; false: true fp32 and its peak. No effect on a CPU.
    tf32: bool = True
    powersgd_rank: int = 1
    powersgd_warmup_steps: int = 10
    # Peak TFLOP/s of one worker's device, for the MFU metric (None: the data sheet of a known GPU; on a CPU
    # or an unknown GPU the reports show achieved TFLOP/s per worker and no MFU).
    peak_tflops: Optional[float] = None
    seed: int = 0
    # A folder: every rank appends the global sample ids of every step it trains (JSONL, one file per rank),
    # to audit the data order after failures or resizes. Off (null) by default.
    sample_ledger: Optional[str] = None
    # Report metrics (and print a progress line) every N steps.
    log_every: int = 10
    # Fine-tuning: start from these weights (only the weights: a fresh optimizer, schedule and step 0). A
    # behemoth checkpoint folder, a run folder (its checkpoint chosen by init_from_checkpoint), or a Hugging
    # Face folder (behemoth export, or any save_pretrained folder); local or a URI (s3://..., downloaded by the
    # driver to verify it and by each worker to load it). An image model's classification head is
    # re-initialised when the number of classes differs. A run that already has checkpoints of its own
    # resumes from them instead: init_from only decides how a run starts.
    init_from: Optional[str] = None
    # Which checkpoint of a run folder: best (the task's best metric) or latest.
    init_from_checkpoint: Literal["best", "latest"] = "best"
    # Callbacks of your own around every step, as "module:Class" (a behemoth.Callback subclass, made with no
    # arguments on each worker): called at the step's points after behemoth's own and the task's (worker/
    # step_callbacks.py), each handed the step context. Imported and checked before Ray starts.
    callbacks: list[str] = field(default_factory=list)

    def warmup_steps_for(self, epoch_steps: int | None) -> int:
        """warmup_steps, or warmup_epochs in steps of this run's global batch (rounded up): the schedule's
        (worker/optim.py) and the pre-flight's (driver/run/preflight.py) one count."""
        if self.warmup_epochs is None:
            return self.warmup_steps
        if epoch_steps is None:
            raise ValueError("train.warmup_epochs needs the steps per epoch")
        return math.ceil(self.warmup_epochs * epoch_steps)

    def validate(self) -> None:
        self._check_ranges()
        if self.micro_batch_size is not None and self.grad_accum_steps != 1:
            raise ConfigError("train.micro_batch_size and train.grad_accum_steps are both set: the micro-batch "
                              "decides the accumulation; keep one")
        if self.warmup_epochs is not None and (not self.warmup_epochs >= 0 or self.warmup_steps):
            raise ConfigError(f"train.warmup_epochs must be >= 0 and replaces train.warmup_steps (set one), got "
                              f"warmup_epochs {self.warmup_epochs!r}, warmup_steps {self.warmup_steps!r}")
        if self.early_stopping is not None:
            self.early_stopping.validate()
        if self.profile is not None:
            self.profile.validate()
        for path in self.callbacks:
            if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
                raise ConfigError(f"train.callbacks: {path!r} is not module:Class (a behemoth.Callback subclass "
                                  f"by import path, e.g. my_pkg.hooks:LogGradients)")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"train.adam_betas needs two values in [0, 1) (beta1, beta2), got {self.adam_betas!r}")

    def _check_ranges(self) -> None:
        """Each number in its range (docs/configuration.md states them). A range refuses NaN; an infinity is
        refused for every key by check_finite, before this."""
        for key in ("epochs", "global_batch_size", "lr", "log_every", "grad_accum_steps", "powersgd_rank", "adam_eps"):
            positive(f"train.{key}", getattr(self, key))
        # (a grad_clip <= 0 scales the gradient by a negative or zero factor: ascent, or no step at all)
        for key in ("max_steps", "grad_clip", "auto_batch_memory_mb", "peak_tflops"):
            if getattr(self, key) is not None:
                positive(f"train.{key}", getattr(self, key))
        for key in ("weight_decay", "warmup_steps"):
            within(f"train.{key}", getattr(self, key), 0)
        within("train.powersgd_warmup_steps", self.powersgd_warmup_steps, 2,
               hint=" (torch's PowerSGD with error feedback starts after at least a step of plain all-reduce)")
        within("train.momentum", self.momentum, 0, 1)
        within("train.min_lr_ratio", self.min_lr_ratio, 0, 1, "[]")
        within("train.wsd_decay_fraction", self.wsd_decay_fraction, 0, 1, "(]")
        if self.ema_decay is not None:
            within("train.ema_decay", self.ema_decay, 0, 1, "()", hint=" (0.999 or 0.9999 are usual)")
        within("train.seed", self.seed, 0, 2**32)  # numpy's generators (the data order, PowerSGD) take no other
        if isinstance(self.micro_batch_size, int):
            positive("train.micro_batch_size", self.micro_batch_size)
        if isinstance(self.activation_checkpointing, int):
            positive("train.activation_checkpointing", self.activation_checkpointing)
