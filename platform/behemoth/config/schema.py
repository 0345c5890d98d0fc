"""The job config's schema: one small dataclass per concern (data, model, train, scaling, checkpoint, eval,
failure, tracking), each checking its own values (`validate`), and JobConfig checking those across sections.

Everything here is checked on the driver before Ray starts. Errors name the key and what to do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Union

from behemoth.config.train_section import TrainConfig, check_finite, positive as _positive, within
from behemoth.errors import ConfigError
from behemoth.storage import paths


@dataclass
class DataConfig:
    """The `data:` keys every task has. A task's own keys (image size, tokenizer, ...) are in its section, a
    subclass of this one that the task names as `data_config` (data/image/images.py: ImageData, data/text/text.py:
    TextData): a job's `data:` mapping is read into the section of its `kind` (behemoth.job), so a key of
    another task's section is an unknown key, and each section checks its own values."""

    # A key of behemoth.tasks.registry.TASKS (image_folder, image_parquet, image_webdataset: image
    # classification; text: causal language modelling; text_classification; chat; preference), or a task class
    # of one's own as module:Class. A job without one is image_folder.
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
        within("model.lora.dropout", self.dropout, 0, 1)
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
        within("scaling.gpus_per_worker", self.gpus_per_worker, 0)
        if self.torch_threads is not None:
            _positive("scaling.torch_threads", self.torch_threads)


@dataclass
class CheckpointConfig:
    # A checkpoint every N optimizer steps, or `auto`: as often as checkpoints pay for themselves (Young/Daly:
    # every sqrt(2 x the measured hold of one checkpoint x the time between interruptions) seconds of training;
    # worker/checkpoint_interval.py), said in the log when it changes.
    every_n_steps: Union[int, Literal["auto"]] = 100
    # checkpoint.every_n_steps: auto: how often an interruption (a preemption, a lost node or worker) is
    # expected before the run has seen any, in seconds of training; each one the run meets then counts.
    interruption_every_s: float = 21600.0
    # checkpoint.every_n_steps: auto: the share of the time in the training loop the checkpoints may hold it (e.g.
    # 0.005: half a percent); auto then checkpoints as often as that allows (hold / budget seconds apart) instead of at
    # Young/Daly's optimum. For a user who would rather bound the work an interruption loses than its
    # expectation: with asynchronous saves the hold is milliseconds, so a small budget buys frequent checkpoints.
    hold_budget: Optional[float] = None
    # Checkpoints kept in the run folder (Ray's CheckpointConfig(num_to_keep=K)).
    keep: int = 3
    # Local folder or URI (s3://...); a run lives in STORAGE_PATH/RUN_NAME.
    storage_path: str = "runs"
    # A fixed name makes a rerun resume from the run's latest checkpoint.
    run_name: str = "behemoth"
    # Save in the background: the step only waits for a copy of the state in host memory; writing, the
    # manifest and the upload happen in a thread (Ray Train's asynchronous upload keeps reports in order).
    async_save: bool = True
    # A peer lost without notice (its process or node killed): each surviving DDP worker still holds the whole
    # state after the last step it finished, and one writes it as a checkpoint before the group ends, so the
    # restart loses at most the step in flight (checkpoints/rescue.py says where it cannot).
    rescue: bool = True
    # checkpoint.every_n_steps auto, a group of one worker (an elastic run waiting for its replacement, a one-worker
    # run): nothing else protects it, so its state is copied to the driver's node's memory (the head's under `ray
    # job submit`) between checkpoints, at the interval auto sets for that copy's own small cost; a restart after
    # the node's loss resumes from the copy where it is newer (checkpoints/memory_copy.py; states up to 2 GiB).
    memory_copy: bool = True
    # How the model and optimizer state is written: "full" (model.pt and optimizer.pt, the whole state gathered
    # on rank 0), "sharded" (every rank writes its own shards with torch.distributed.checkpoint, nothing is
    # gathered; loads at any world size), or "auto": sharded under FSDP, full under DDP.
    format: Literal["auto", "full", "sharded"] = "auto"
    # A rerun whose data or model config differs from the run's checkpoints, or whose data gives other classes
    # (Task.checkpoint_files), is refused unless this is true.
    resume_changed_config: bool = False

    def validate(self) -> None:
        if self.every_n_steps != "auto":
            _positive("checkpoint.every_n_steps", self.every_n_steps)
        if not self.interruption_every_s > 0:
            raise ConfigError(f"checkpoint.interruption_every_s must be > 0 seconds, got {self.interruption_every_s}")
        if self.hold_budget is not None and not 0 < self.hold_budget < 1:
            raise ConfigError(f"checkpoint.hold_budget is a share of the training time, between 0 and 1 (0.005: "
                              f"half a percent), got {self.hold_budget}")
        if self.hold_budget is not None and self.every_n_steps != "auto":
            raise ConfigError("checkpoint.hold_budget sets the interval of checkpoint.every_n_steps: auto; with "
                              f"every_n_steps {self.every_n_steps} it would do nothing: drop one of them")
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
    # Worker-group restarts Ray Train may do (from the latest checkpoint) after errors (a worker or node lost
    # without notice included) before the run fails.
    max_failures: int = 1
    # Restarts after preemptions (a node drained with notice: a spot instance reclaimed), counted apart from
    # max_failures (Ray Train's own preemption budget); -1: unlimited, as spot runs expect.
    max_preemptions: int = -1
    # How long a run may wait for the nodes its worker group needs (a replacement after a preemption or a lost
    # node, spot capacity that is not there) before it fails, in seconds; null: as long as it takes. Ray Train
    # tries to place the group every RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s; 10 s for an elastic run), so
    # the bound is that coarse.
    replacement_wait_s: Optional[float] = None
    # After a preemption notice's deadline: the seconds the worker group waits, its last checkpoint written, for
    # the node to be gone before the next group is placed (Ray Train's preemption_grace_s). A node that is still
    # going counts as room for workers: an elastic run restarted at the deadline waited for it (60 s on a cloud).
    preemption_grace_s: float = 5.0

    def validate(self) -> None:
        if self.max_failures < -1 or self.max_preemptions < -1:
            raise ConfigError("failure.max_failures and failure.max_preemptions must be >= 0 (or -1 for unlimited)")
        if self.replacement_wait_s is not None:
            _positive("failure.replacement_wait_s", self.replacement_wait_s)
        within("failure.preemption_grace_s", self.preemption_grace_s, 0.0, 600.0, "[]")


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
        check_finite(self, "")  # every float of every section (a data section of a task's own included)
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
        if self.train.early_stopping is not None and not (self.eval.per_epoch or self.eval.every_n_steps):
            raise ConfigError("train.early_stopping watches the evaluations' metric, and none are made (eval.per_epoch "
                              "false, no eval.every_n_steps): turn one on, or drop train.early_stopping")
        if self.scaling.strategy != "ddp" and self.train.grad_compression != "none":
            raise ConfigError(f"train.grad_compression {self.train.grad_compression} is a DDP communication hook; "
                              f"scaling.strategy {self.scaling.strategy} reduce-scatters its own gradients: "
                              f"set grad_compression: none or strategy: ddp")
        if self.train.grad_compression == "powersgd" and (self.train.precision == "fp16"
                                                          or self.train.nonfinite == "skip"):
            # a skipped step's NaN stays in PowerSGD's error feedback and warm start: every step after is NaN
            # (fp16's scaler skips an overflowing step by design, every 2,000 steps or so)
            raise ConfigError(f"train.grad_compression powersgd with "
                              f"{'train.precision fp16' if self.train.precision == 'fp16' else 'train.nonfinite skip'}"
                              f": a skipped non-finite step would leave NaN in PowerSGD's error feedback, and every "
                              f"step after it would be skipped too; use bf16 precision, nonfinite: stop, or "
                              f"grad_compression bf16")
        if (self.scaling.strategy != "ddp" and self.train.optimizer == "sgd" and self.train.nonfinite == "skip"):
            raise ConfigError(f"train.nonfinite skip with SGD under scaling.strategy {self.scaling.strategy}: skip "
                              f"takes the fused optimizer's flag, and torch has no fused SGD for sharded "
                              f"parameters; use train.optimizer adamw, nonfinite: stop, or strategy: ddp")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
