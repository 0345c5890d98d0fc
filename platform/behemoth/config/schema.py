"""The job config's schema: one small dataclass per concern (data, model, train, scaling, checkpoint, eval,
failure, tracking), each checking its own values (`validate`), and JobConfig checking those across sections.

Everything here is checked on the driver before Ray starts. Errors name the key and what to do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Union

from behemoth.errors import ConfigError
from behemoth.storage import paths


@dataclass
class DataConfig:
    """The `data:` keys every task has. A task's own keys (image size, tokenizer, ...) are in its section, a
    subclass of this one that the task names as `data_config` (data/images.py: ImageData, data/text.py:
    TextData): a job's `data:` mapping is read into the section of its `kind` (behemoth.job), so a key of
    another task's section is an unknown key, and each section checks its own values."""

    # A key of behemoth.tasks.registry.TASKS (image_folder, image_parquet, image_webdataset: image
    # classification; text: causal language modelling; text_classification), or a task class of one's own as
    # module:Class. A job without one is image_folder.
    kind: str = "image_folder"
    # Files (or globs) holding the training and validation samples (image_parquet, image_webdataset, text).
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # Samples the task cannot read: 0 fails the run naming the sample; N > 0 drops up to N and counts them.
    max_bad_samples: int = 0
    # Batches prepared ahead of the training step: by Ray Data's iterator, or from a decoded image cache by a
    # thread of the training process.
    prefetch_batches: int = 2
    # CPUs each Ray Data task (decode, augment, tokenise) reserves (fractions allowed on small machines).
    cpus_per_task: float = 1.0

    # Keys holding local paths (a string or a list of them): a sweep makes them absolute for its trials.
    path_keys: ClassVar[tuple[str, ...]] = ("train_files", "val_files")

    def validate(self) -> None:
        if self.max_bad_samples < 0 or self.prefetch_batches < 0:
            raise ConfigError("data.max_bad_samples and data.prefetch_batches must be >= 0")
        _positive("data.cpus_per_task", self.cpus_per_task)

    def source(self) -> str:
        """The data in a few words (a model card's line)."""
        return ", ".join(self.train_files)


@dataclass
class LoraConfig:
    # LoRA adapters (the peft library) on a transformers model: only they (and a classifier's head) train and
    # are checkpointed; the base weights stay frozen as built (model.pretrained, or model.hf_config with
    # train.seed). Rank, scaling (alpha / r) and dropout of the adapters:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # The modules to adapt by name (e.g. [q_proj, v_proj]); None: peft's default for the model type.
    target_modules: Optional[list[str]] = None

    def validate(self) -> None:
        _positive("model.lora.r", self.r)
        _positive("model.lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty: name modules (e.g. [q_proj, v_proj]), or leave it "
                              "out for peft's default for the model type")


@dataclass
class ModelConfig:
    # A model the job's task builds (its model_names and hf_models, tasks/): image classification: a registered
    # name (resnet18, resnet50, regnet_cifar, regnet_tiny_cifar) or image_classifier (any transformers
    # AutoModelForImageClassification: ViT, ConvNeXt, ...); causal LM: causal_lm (AutoModelForCausalLM). Or
    # your own builder as an import path, my_package.my_module:function, called with the task's sizes
    # (num_classes= for images, vocab_size= for text) and returning a torch.nn.Module.
    name: str = "regnet_cifar"
    # A transformers model (the task's hf_models: causal_lm, image_classifier, ...): weights from a local folder
    # or hub name (from_pretrained) ...
    pretrained: Optional[str] = None
    # ... or a fresh model from a config: model_type plus sizes, e.g. {model_type: llama, hidden_size: 256}.
    # With pretrained set, these keys override the pretrained config. vocab_size defaults to the tokenizer's,
    # num_labels to the number of classes.
    hf_config: dict[str, Any] = field(default_factory=dict)
    # Run Python code shipped with a pretrained model's repository (transformers' trust_remote_code). Off: a
    # model that needs it is refused by transformers with its own message. Never set through hf_config; on,
    # load_config prints a warning naming the repository. Never read from a checkpoint's job.yaml (export).
    trust_remote_code: bool = False
    # The dtype of the parameters, gradients and optimizer state. float32 (the default): every model trains
    # with fp32 master weights, a pretrained one stored in bf16 or fp16 included (train.precision's autocast does
    # the low-precision compute). bfloat16: pure bf16 training, on purpose (half the memory for weights and
    # optimizer state; updates smaller than bf16's resolution are lost); not with train.precision fp16.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Fine-tune LoRA adapters instead of every weight (causal_lm, sequence_classifier); None: every weight trains.
    lora: Optional[LoraConfig] = None

    def validate(self, name: bool = True) -> None:
        """What holds for any model, whichever task builds it: hf_config holds architecture keys only (no
        option of from_pretrained: a received checkpoint's job.yaml is data), trust_remote_code needs
        pretrained. `name`: model.name is a model behemoth builds (False: a task by import path builds its own,
        and names it as it likes). Which model.name values a job may use, and whether they take
        pretrained/hf_config, is its task's check (Task.check_model)."""
        from behemoth.models import hf_keys, registry  # light: no torch model is built here

        if name:
            registry.check_name(self.name)
        hf_keys.check_hf_config(self.hf_config)
        if self.trust_remote_code and not self.pretrained:
            raise ConfigError("model.trust_remote_code runs the code of model.pretrained's repository, and "
                              "model.pretrained is not set: set it, or remove trust_remote_code")
        if self.lora is not None:
            self.lora.validate()


@dataclass
class EarlyStoppingConfig:
    # The metric (None: the task's best, e.g. val_accuracy); checked at each evaluation.
    metric: Optional[str] = None
    # Evaluations in a row without an improvement of more than min_delta before the run stops.
    patience: int = 3
    min_delta: float = 0.0

    def validate(self) -> None:
        _positive("train.early_stopping.patience", self.patience)
        if self.min_delta < 0:
            raise ConfigError(f"train.early_stopping.min_delta must be >= 0, got {self.min_delta!r}")


@dataclass
class ProfileConfig:
    # Record steps start_step + 1 .. start_step + steps with torch.profiler (worker/profiling.py).
    start_step: int = 10
    steps: int = 3

    def validate(self) -> None:
        if self.start_step < 0:
            raise ConfigError(f"train.profile.start_step must be >= 0, got {self.start_step!r}")
        _positive("train.profile.steps", self.steps)


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
    # model's blocks (transformer layers, residual units: worker/blocks.py), or the whole model where it has
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

    def validate(self) -> None:
        _positive("train.epochs", self.epochs)
        _positive("train.global_batch_size", self.global_batch_size)
        _positive("train.lr", self.lr)
        _positive("train.log_every", self.log_every)
        _positive("train.grad_accum_steps", self.grad_accum_steps)
        if isinstance(self.micro_batch_size, int):
            _positive("train.micro_batch_size", self.micro_batch_size)
        if self.micro_batch_size is not None and self.grad_accum_steps != 1:
            raise ConfigError("train.micro_batch_size and train.grad_accum_steps are both set: the micro-batch "
                              "decides the accumulation; keep one")
        if self.auto_batch_memory_mb is not None:
            _positive("train.auto_batch_memory_mb", self.auto_batch_memory_mb)
        _positive("train.powersgd_rank", self.powersgd_rank)
        if self.peak_tflops is not None:
            _positive("train.peak_tflops", self.peak_tflops)
        if self.max_steps is not None:
            _positive("train.max_steps", self.max_steps)
        if self.warmup_steps < 0 or self.weight_decay < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.warmup_steps and train.weight_decay must be >= 0, min_lr_ratio in [0, 1]")
        if not 0 < self.wsd_decay_fraction <= 1:
            raise ConfigError(f"train.wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction!r}")
        if self.early_stopping is not None:
            self.early_stopping.validate()
        if self.profile is not None:
            self.profile.validate()
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ConfigError(f"train.ema_decay must be in (0, 1) (0.999 or 0.9999 are usual), got {self.ema_decay!r}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"train.adam_betas needs two values in [0, 1) (beta1, beta2), got {self.adam_betas!r}")
        _positive("train.adam_eps", self.adam_eps)
        if isinstance(self.activation_checkpointing, int):
            _positive("train.activation_checkpointing", self.activation_checkpointing)


@dataclass
class ScalingConfig:
    # A fixed count, or [min, max] for an elastic run: Ray Train starts with as many workers as the cluster
    # has room for (up to max), restarts with fewer when workers or nodes are lost (down to min), and grows
    # back when resources return. The global batch, LR schedule and sample order do not change with it.
    num_workers: Union[int, list[int]] = 2
    # Elastic runs: how often (seconds) Ray Train checks whether more workers would fit.
    elastic_resize_interval_s: float = 60.0
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    # ddp: every worker holds the whole model. fsdp_grad_op: FSDP2 with gradients and optimizer state
    # sharded, parameters gathered once per step (ZeRO-2 analogue). fsdp_full: parameters sharded too,
    # gathered per block in forward and again in backward (ZeRO-3 analogue).
    strategy: Literal["ddp", "fsdp_grad_op", "fsdp_full"] = "ddp"
    # torch intra-op threads per worker (None: torch's default).
    torch_threads: Optional[int] = None

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    def validate(self) -> None:
        if self.elastic and (len(self.num_workers) != 2 or self.num_workers[0] > self.num_workers[1]):
            raise ConfigError(f"scaling.num_workers {self.num_workers}: give one count, or [min, max] with "
                              f"min <= max")
        _positive("scaling.num_workers", self.min_workers)
        _positive("scaling.elastic_resize_interval_s", self.elastic_resize_interval_s)
        _positive("scaling.cpus_per_worker", self.cpus_per_worker)
        if self.use_gpu:
            _positive("scaling.gpus_per_worker", self.gpus_per_worker)


@dataclass
class CheckpointConfig:
    every_n_steps: int = 100
    # Checkpoints kept in the run folder (Ray's CheckpointConfig(num_to_keep=K)).
    keep: int = 3
    # Local folder or URI (s3://...); a run lives in STORAGE_PATH/RUN_NAME.
    storage_path: str = "runs"
    # A fixed name makes a rerun resume from the run's latest checkpoint.
    run_name: str = "behemoth"
    # Save in the background: the step only waits for a copy of the state in host memory; writing, the
    # manifest and the upload happen in a thread (Ray Train's asynchronous upload keeps reports in order).
    async_save: bool = True
    # How the model and optimizer state is written: "full" (model.pt and optimizer.pt, the whole state gathered
    # on rank 0), "sharded" (every rank writes its own shards with torch.distributed.checkpoint, nothing is
    # gathered; loads at any world size), or "auto": sharded under FSDP, full under DDP.
    format: Literal["auto", "full", "sharded"] = "auto"
    # A rerun whose data or model config differs from the run's checkpoints, or whose data gives other classes
    # (Task.checkpoint_files), is refused unless this is true.
    resume_changed_config: bool = False

    def validate(self) -> None:
        _positive("checkpoint.every_n_steps", self.every_n_steps)
        _positive("checkpoint.keep", self.keep)
        paths.check_name("checkpoint.run_name", self.run_name)
        paths.storage_root(self.storage_path)  # a URI with options in it is refused here, before Ray starts

    def sharded(self, strategy: str) -> bool:
        """Whether this run writes sharded checkpoints under scaling.strategy `strategy`."""
        return self.format == "sharded" or (self.format == "auto" and strategy != "ddp")


@dataclass
class EvalConfig:
    # Evaluate every N steps (None: only at the end of each epoch and of the run).
    every_n_steps: Optional[int] = None
    per_epoch: bool = True

    def validate(self) -> None:
        if self.every_n_steps is not None:
            _positive("eval.every_n_steps", self.every_n_steps)


@dataclass
class FailureConfig:
    # Worker-group restarts Ray Train may do (from the latest checkpoint) before the run fails.
    max_failures: int = 1

    def validate(self) -> None:
        if self.max_failures < -1:
            raise ConfigError("failure.max_failures must be >= 0 (or -1 for unlimited)")


@dataclass
class MlflowConfig:
    # Off unless set: a local folder (file store, MLflow's legacy backend), sqlite:///PATH.db, or an
    # http(s):// tracking server. Needs the mlflow extra: pip install 'behemoth[mlflow]'.
    uri: Optional[str] = None
    experiment: str = "behemoth"

    def validate(self) -> None:
        if self.uri is not None and not self.uri.strip():
            raise ConfigError("tracking.mlflow.uri is empty: give a folder, sqlite:///PATH.db or http(s)://HOST, "
                              "or leave it unset (MLflow off)")


@dataclass
class WandbConfig:
    # Off unless set: the W&B project the run goes into. Needs the wandb extra: pip install 'behemoth[wandb]'.
    project: Optional[str] = None
    entity: Optional[str] = None  # a W&B team or user (None: the logged-in user's default)
    # online: to W&B's server (WANDB_API_KEY or `wandb login` on the driver's node); offline: files under the run
    # folder's wandb/ for `wandb sync` later, no network
    mode: Literal["online", "offline"] = "online"

    def validate(self) -> None:
        if self.project is not None and not self.project.strip():
            raise ConfigError("tracking.wandb.project is empty: name a W&B project, or leave it unset (W&B off)")
        if self.entity is not None and self.project is None:
            raise ConfigError("tracking.wandb.entity is set without tracking.wandb.project: set the project too")


@dataclass
class TrackingConfig:
    # TensorBoard event files in RUN_FOLDER/tensorboard (`tensorboard --logdir RUN_FOLDER`).
    tensorboard: bool = True
    # `behemoth report` at the end of every run: RUN_FOLDER/report/report.html and its PNGs.
    report: bool = True
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        self.mlflow.validate()
        self.wandb.validate()


@dataclass
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)  # a job's is its kind's section (behemoth.job)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def validate(self, model: bool = True) -> None:
        """Each section's checks and those across sections; `model` False skips the check of model.name (a
        task of one's own, by import path, builds its own model), not the model's other checks. Which models
        the data can train is the task's check (behemoth.job)."""
        for f in dataclasses.fields(self):
            if f.name == "model":
                self.model.validate(name=model)
            else:
                getattr(self, f.name).validate()
        # Every world size the run may have must split the global batch evenly.
        micro = self.train.micro_batch_size
        for workers in range(self.scaling.min_workers, self.scaling.max_workers + 1):
            which = f" (a size in the elastic range {self.scaling.num_workers})" if self.scaling.elastic else ""
            split = workers * (micro if isinstance(micro, int) else self.train.grad_accum_steps)
            if self.train.global_batch_size % split:
                by = (f"train.micro_batch_size {micro}" if isinstance(micro, int)
                      else f"train.grad_accum_steps {self.train.grad_accum_steps}")
                raise ConfigError(
                    f"train.global_batch_size {self.train.global_batch_size} is not divisible by "
                    f"scaling.num_workers {workers}{which} x {by}: pick a multiple of {split}"
                )
        if self.model.dtype == "bfloat16" and self.train.precision == "fp16":
            raise ConfigError("model.dtype bfloat16 with train.precision fp16: the fp16 gradient scaler unscales "
                              "fp32 master gradients; use train.precision bf16 (or fp32) for pure bf16 training")
        if self.train.precision == "fp16" and not self.scaling.use_gpu:
            raise ConfigError("train.precision fp16 needs a GPU (its gradient scaler is CUDA-only): use bf16 "
                              "on CPU, or set scaling.use_gpu: true")
        if micro == "auto" and not self.scaling.use_gpu and self.train.auto_batch_memory_mb is None:
            raise ConfigError("train.micro_batch_size auto on CPU needs train.auto_batch_memory_mb (the memory "
                              "one worker's training step may use, e.g. 4096)")
        if self.model.lora is not None and (self.scaling.strategy != "ddp" or self.checkpoint.sharded(self.scaling.strategy)):
            raise ConfigError(f"model.lora trains and checkpoints only the adapters of a model every worker holds "
                              f"whole: it needs scaling.strategy ddp and checkpoint.format full (got "
                              f"{self.scaling.strategy}, {self.checkpoint.format})")
        if self.train.ema_decay is not None and (self.scaling.strategy != "ddp"
                                                 or self.checkpoint.sharded(self.scaling.strategy)):
            raise ConfigError(f"train.ema_decay keeps a full copy of the model on every worker and writes it whole: "
                              f"it needs scaling.strategy ddp and checkpoint.format full (got "
                              f"{self.scaling.strategy}, {self.checkpoint.format})")
        if self.scaling.strategy != "ddp" and self.train.grad_compression != "none":
            raise ConfigError(f"train.grad_compression {self.train.grad_compression} is a DDP communication hook; "
                              f"scaling.strategy {self.scaling.strategy} reduce-scatters its own gradients: "
                              f"set grad_compression: none or strategy: ddp")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")
