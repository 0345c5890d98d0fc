"""The parts a task is built from: five small typed interfaces, each a concern of its own, documented once with
the optional members' defaults. `Task` (tasks/contract.py) is all five; a workload implements each part or takes
one ready-made (tasks/classification.py: a classifier's loss and evaluation).

- `TaskData` (the driver's half): the data's checks, preparation and description, before Ray and with Ray up;
  class attributes and classmethods, run in the driver's process.
- `TaskBatches` (the worker's half begins): `Task(cfg, prepared)`, one per training worker, built from what the
  driver prepared; the batches of each split.
- `TaskModel`: which models it trains (checked by the driver), the model each worker builds, and `behemoth export`.
- `TaskStep`: what a training step minimises, the task's own training metrics, and its step callbacks.
- `TaskEvaluation`: the metrics a run is judged by, summed over batches and ranks, and the lines a user reads.

A batch is a `Batch`: tensors by name, with a "sample_id" tensor of the sample indices it carries (the sample
ledger records them; a batch without it is refused at the first step, naming the task).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Generic, Iterable, Iterator, TypeAlias, TypeVar

from behemoth.config import DataConfig, JobConfig
from behemoth.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # annotations only: importing torch here would make `import behemoth` import it
    import torch

    from behemoth.storage.weights import ReinitPolicy

# A batch: tensors by name ("sample_id": the indices of the samples it carries). A real alias at run time too, so
# a user's annotations may name it (`behemoth.Batch`) without importing torch first.
Batch: TypeAlias = dict[str, "torch.Tensor"]


def checked_batches(batches: Iterable[Batch], task, where: str) -> Iterator[Batch]:
    """`batches` with the first one checked to be a `Batch` holding "sample_id" as a tensor, else one ConfigError
    naming the task and the member that made it (`where`, e.g. "train_batches"): without the check the sample
    ledger's KeyError would name neither. (The first only: a step pays nothing for it.)"""
    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    import torch

    ids = first.get("sample_id") if isinstance(first, dict) else None
    if not torch.is_tensor(ids):
        got = (f"a dict with keys {sorted(map(str, first))[:12]}" if isinstance(first, dict)
               else f"a {type(first).__name__}")
        raise ConfigError(f"task {type(task).__name__}'s {where} gave {got}: a batch is a dict of tensors by name "
                          f"holding \"sample_id\", a tensor of the indices of the samples it carries (behemoth.Batch)")
    try:
        yield first
        yield from it
    finally:
        if hasattr(it, "close"):  # (an epoch left early closes its pipeline now, as the loop expects)
            it.close()


# What a task's `check` returns (an index, the work units to prepare) and what its `prepare` returns for the
# workers (an index of the prepared data): each task names its own (`Task[ImageIndex, ImageIndex]`).
CheckedT = TypeVar("CheckedT")
PreparedT = TypeVar("PreparedT")


class TaskData(abc.ABC, Generic[CheckedT, PreparedT]):
    """The driver's half: what the data is and how it reaches the steps. `check` (before Ray) -> `prepare` (Ray
    up) -> PreparedT, which travels once to every worker, where `Task(cfg, prepared)` serves the batches.
    Class attributes and classmethods only: the driver holds the class, never an instance."""

    # Its `data:` section: a dataclass subclassing DataConfig with the task's own keys and checks (`validate`).
    # A job's `data:` mapping is read into the section of its kind.
    data_config: ClassVar[type[DataConfig]] = DataConfig

    # The data keys `complete` fills where the job leaves them out (a sweep over model.* leaves them to each trial)
    completed_keys: ClassVar[tuple[str, ...]] = ("tokenizer",)

    @classmethod
    def complete(cls, cfg: JobConfig) -> None:
        """Fill the keys whose default comes from another section, before the job is checked: data.tokenizer
        left empty with model.pretrained set is the model's own (a Hub name's, or a local folder's where it holds
        one), written into the config so that the run's job.yaml names it. A local model folder without one: say
        so, rather than data.tokenizer's advice to train a new tokenizer."""
        from behemoth.models.sources import TOKENIZER_FILES, holds_tokenizer, looks_local

        model = cfg.model.pretrained
        if getattr(cfg.data, "tokenizer", None) != "" or not model:
            return
        # (an object store's folder is no local one: its listing is checked before Ray, driver/run/preflight.py)
        if looks_local(model) and Path(model).expanduser().is_dir() and not holds_tokenizer(model):
            raise ConfigError(f"data.tokenizer is empty and model.pretrained {model} holds no tokenizer "
                              f"({', '.join(TOKENIZER_FILES)}): set data.tokenizer to the model's tokenizer (a "
                              f"folder or a Hub name)")
        cfg.data.tokenizer = model

    @classmethod
    @abc.abstractmethod
    def check(cls, cfg: JobConfig) -> CheckedT:
        """Read and check the data without Ray (`behemoth check` runs only this); returns what `prepare` needs
        (e.g. an index). Bad data is one DataError or ConfigError naming the file, row or key."""

    @classmethod
    @abc.abstractmethod
    def prepare(cls, cfg: JobConfig, checked: CheckedT) -> PreparedT:
        """With Ray up: what the workers read (it travels once through the object store to every worker)."""

    @classmethod
    @abc.abstractmethod
    def describe(cls, cfg: JobConfig, checked: CheckedT) -> str:
        """One line for `behemoth check`."""

    @classmethod
    def train_samples(cls, cfg: JobConfig, data: CheckedT | PreparedT) -> int | None:
        """How many training samples `data` (what `check` or `prepare` returned) holds, where it says without
        preparing (None: not known yet). The driver refuses a global batch larger than that before Ray starts
        (an epoch of no step)."""
        return None

    @classmethod
    def data_cpus(cls, cfg: JobConfig) -> float:
        """CPUs its data pipeline takes beside the workers while training (a sweep bounds concurrency by it)."""
        return 0.0

    @classmethod
    def data_modules(cls, cfg: JobConfig, prepared: PreparedT) -> tuple[str, ...]:
        """Modules its data pipeline's Ray tasks import for this data (none: no Ray task will run). On a local
        Ray instance one process per worker is started with them while Ray Train starts
        (driver/ray_cluster/warmup.py)."""
        return ()

    @classmethod
    def checkpoint_files(cls, cfg: JobConfig, prepared: PreparedT) -> dict[str, str]:
        """Small text files kept in every checkpoint beside the training state (file name -> text), read back by
        `model_from_checkpoint` (image classification: classes.json). They describe what the weights mean, so a
        run resumes only where its data gives the same files (a class added to an ImageFolder would shift every
        class index): the driver compares them with the latest checkpoint's before training starts."""
        return {}

    @classmethod
    def kept_files(cls, cfg: JobConfig, prepared: PreparedT) -> dict[str, bytes]:
        """Files kept in every checkpoint for `behemoth export` and `generate`, which read them in place of the
        paths the job names (`exported_job`): a language model's tokenizer as it saved itself, its chat template
        included (tokenizer/..., tasks/kept_tokenizer.py). Checked against the manifest like every file; unlike
        checkpoint_files not compared on resume (a library's version changes their bytes, not what the weights
        mean). Taken from `prepared`: a worker may not see the paths the driver read."""
        return {}

    @classmethod
    def build_cache(cls, cfg: JobConfig, start_ray: Callable[[], None]) -> list[str]:
        """`behemoth data cache`: build the data's cache on this node ahead of a run; one line per part.
        `start_ray` is called once the config and data are checked."""
        raise ConfigError(f"data.kind {cfg.data.kind} has no cache to build ahead of a run")


class TaskBatches(abc.ABC, Generic[PreparedT]):
    """The worker's half begins: `Task(cfg, prepared)`, one per training worker, and the batches of each split."""

    cfg: JobConfig  # the job, as the driver checked it

    def __init__(self, cfg: JobConfig, prepared: PreparedT):
        self.cfg = cfg

    # The worker half's sizes, set by its __init__: the samples in the training and validation splits.
    num_train_samples: int

    num_val_samples: int

    # For tokens/s; None where a sample is not a token sequence.
    tokens_per_sample: int | None = None

    @abc.abstractmethod
    def train_batches(self, indices, epoch: int, batch_size: int) -> Iterable[Batch]:
        """Batches of the samples at `indices`, in that order. Each batch holds a "sample_id" tensor: the
        indices it carries (the sample ledger records them). The next epoch's call comes from a background
        thread a few steps before the current epoch's batches run out (behemoth.worker.feed), so two of its
        iterators may be alive at once."""

    @abc.abstractmethod
    def eval_batches(self, indices, batch_size: int, split: str = "val") -> Iterable[Batch]:
        """Evaluation batches (no augmentation) of the samples at `indices` of a split: "val", or "train"
        (only `behemoth eval --split train` asks for it)."""

    # Evaluation batches are the same at every call (no augmentation): the worker keeps them after the first
    # evaluation (up to behemoth.worker.evaluate.KEEP_BYTES per worker).
    eval_batches_repeat: ClassVar[bool] = False

    @abc.abstractmethod
    def example_batch(self, batch_size: int) -> Batch:
        """A batch of the right shapes on the training device (FLOP counting, micro-batch search)."""

    # What a sample is, in the plural, for the message of a run that met too many it could not read.
    bad_samples_are: ClassVar[str] = "unreadable samples"

    def bad_samples(self, batch: Batch) -> torch.Tensor | None:
        """The batch's samples the task could not read (dropped within data.max_bad_samples): a tensor of the
        batch's `sample_id`s where the sample is unreadable and -1 elsewhere, left on the batch's device (the
        loop reads it at the next report step: a step waits for no device-to-host copy). None where the task
        reads every sample."""
        return None

    def describe_samples(self, sample_ids) -> list[str]:
        """Samples by a name a user can find them by (a file, a row), for error messages."""
        return [f"sample {i}" for i in sample_ids]


class TaskModel(abc.ABC):
    """Which models the task trains (checked before Ray), the model each worker builds, the model a checkpoint
    holds, and `behemoth export` (a checkpoint as a Hugging Face folder)."""

    # model.name values this task builds from behemoth's own builders, and those built by a transformers Auto
    # class from model.hf_config or model.pretrained (name -> an example model_type for the message of a
    # config that names none). A builder by import path (module:function) is always accepted.
    model_names: ClassVar[tuple[str, ...]] = ()

    hf_models: ClassVar[dict[str, str]] = {}

    # The keywords a user's model builder (model.name module:function) is called with, in the model card.
    builder_keywords: ClassVar[str] = "the task's sizes"

    @classmethod
    def check_model(cls, cfg: JobConfig) -> None:
        """Refuse a model.name this task cannot train, or keys its model does not take (before Ray starts)."""
        model, known = cfg.model, [*cls.model_names, *cls.hf_models]
        if ":" not in model.name and model.name not in known:
            raise ConfigError(f"data.kind {cfg.data.kind} cannot train model.name {model.name}: it is not a known "
                              f"model for this task{did_you_mean(model.name, known)} (known: "
                              f"{', '.join(known) or 'none'}; "
                              f"or your own builder as my_package.my_module:function)")
        if model.name in cls.hf_models:
            if not (model.pretrained or model.hf_config.get("model_type")):
                raise ConfigError(f"model.name is {model.name}: set model.pretrained (a folder or hub name) or "
                                  f"model.hf_config.model_type (e.g. {cls.hf_models[model.name]}) with its sizes")
        elif model.pretrained or model.hf_config:
            raise ConfigError(f"model.pretrained and model.hf_config are for {' and '.join(cls.hf_models) or 'none'} "
                              f"of this task's models, not {model.name}")
        if model.lora is not None and model.name not in ("causal_lm", "sequence_classifier"):
            raise ConfigError(f"model.lora adds adapters to a transformers language model (model.name causal_lm or "
                              f"sequence_classifier), not to {model.name}: remove model.lora, or train every weight")

    @abc.abstractmethod
    def build_model(self) -> torch.nn.Module:
        """The job's model, on the CPU (the loop moves and wraps it)."""

    # On a GPU, the model's weights in channels_last (convolutional models: the layout of the tensor cores).
    channels_last: ClassVar[bool] = False

    # Fine-tuning (train.init_from) from weights of another shape: which fresh tensors the model may keep.
    reinit_ok: ReinitPolicy | None = None

    @classmethod
    def model_from_checkpoint(cls, cfg: JobConfig, ckpt: str) -> torch.nn.Module:
        """`behemoth export`: the model a checkpoint holds, built as the workers built it."""
        raise ConfigError(f"data.kind {cfg.data.kind}: this task does not export its models")

    @classmethod
    def exported_job(cls, cfg: JobConfig, ckpt: str, folder: Path, named: dict[str, str | None]) -> JobConfig:
        """The job config `behemoth export` and `generate` build checkpoint `ckpt`'s model and files from: `cfg`
        (its job.yaml) with every path they would read replaced by the checkpoint's kept copy (kept_files),
        written under `folder`, or by what the user named on the command line (`named`: tokenizer,
        chat_template). A received job.yaml is only data: a file it names on this machine may be anyone's, or
        changed since the run. (model.pretrained is still read where the job names it: a LoRA checkpoint keeps
        only its adapters, the base they were trained on is the model's.) Default: `cfg` (the task reads no
        other path at export)."""
        return cfg

    @classmethod
    def save_for_transformers(cls, cfg: JobConfig, out: Path) -> None:
        """`behemoth export` of a transformers model: the files beside it (image processor, tokenizer)."""

    @classmethod
    def load_snippet(cls, cfg: JobConfig) -> str:
        """The model card's Python lines that load an exported transformers model from FOLDER."""
        return "from transformers import AutoModel\nmodel = AutoModel.from_pretrained(FOLDER)"


class TaskStep(abc.ABC):
    """What a training step minimises (worker/loop.py: train_step), the task's own training metrics, and the
    callbacks around each step."""

    @abc.abstractmethod
    def loss(self, model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over the batch's valid samples, number of valid samples)."""

    def loss_items(self, batch: Batch) -> torch.Tensor | None:
        """Where the loss is a mean over items that vary in number between batches (a chat's trained tokens):
        how many this batch holds, as a device tensor, known before its forward pass; `loss` then returns the
        mean over them and that count. The step weighs each micro-batch by its count over the global batch's
        (summed over the ranks), so the gradient is the mean over every item of the step, not a mean of
        micro-batch means (worker/loop.py: train_step). None (the default): every batch's mean weighs the same."""
        return None

    # Training metrics of the task's own (a preference run's rewards), kept as sums over the steps between two
    # reports: their names, in a fixed order (every rank all-reduces the same vector with the loss's).
    window_sum_names: ClassVar[tuple[str, ...]] = ()

    def take_window_sums(self) -> torch.Tensor | None:
        """The window's sums by window_sum_names (a device vector; zeros where this rank had no step), reset."""
        return None

    def window_metrics(self, sums: dict[str, float]) -> dict:
        """Metrics from the window's sums over every rank."""
        return {}

    def callbacks(self) -> list:
        """behemoth.Callback instances (worker/step_callbacks.py) the loop calls around each of this worker's
        steps, after behemoth's own and before the user's train.callbacks, each handed the step context.
        Default: none."""
        return []


class TaskEvaluation(abc.ABC):
    """The metrics a run is judged by: summed over batches and ranks, then turned into metrics; the lines a user
    reads."""

    # The metric that picks the best checkpoint, and "max" or "min". Required.
    best: ClassVar[tuple[str, str]]

    # Metrics a sweep may optimise, with their modes. Required.
    reported: ClassVar[dict[str, str]]

    # The names of the sums `eval_sums` returns, in a fixed order: every rank all-reduces the same vector.
    eval_sum_names: ClassVar[tuple[str, ...]]

    @abc.abstractmethod
    def eval_sums(self, model, batch: Batch) -> dict[str, torch.Tensor]:
        """One batch's sums, by the names in `eval_sum_names` (scalars): evaluate() adds them up over batches
        and ranks in float64 and hands the totals to `eval_metrics`."""

    @abc.abstractmethod
    def eval_metrics(self, sums: dict[str, float]) -> dict:
        """Metrics from the summed evaluation: names starting with `val_` (another split's evaluation renames
        them)."""

    def eval_samples(self, model) -> list[dict]:
        """What the model produces for a few fixed inputs, as JSON-able rows (a chat model's replies to a few
        validation prompts), recorded with each evaluation as `val_outputs` (rank 0's, under DDP; none under
        FSDP, whose sharded model every rank would have to run). Default: none."""
        return []

    @staticmethod
    def summary_lines(metrics: dict) -> list[str]:
        """The task's lines in the run's summary, from the final metrics."""
        return []

    @staticmethod
    def progress_fields(metrics: dict) -> list[str]:
        """Fields of the progress line for a report that carries an evaluation (rank 0's worker prints it)."""
        return []
