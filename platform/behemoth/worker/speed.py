"""Worker side: the speed figures every report carries (achieved TFLOP/s, MFU where a peak is known, memory)."""

from __future__ import annotations

from behemoth import metrics
from behemoth.config import JobConfig
from behemoth.tasks import Task


# FLOPs per sample counted in this process, by (task, model class, parameter shapes, example batch shapes)
_COUNTED: dict[tuple, float] = {}


class SpeedMeter:
    """Achieved TFLOP/s, MFU and peak memory for the reports. The model's FLOPs per sample are counted once,
    before training, on a forward of one example batch, by rank 0 only: the run's metrics are rank 0's (Ray
    Train keeps rank 0's report), and torch's FLOP counter costs seconds the first time in a process (it
    imports torch._dynamo), more where several workers share the cores.
    MFU only where the device's peak is known (a GPU's data sheet, or train.peak_tflops): see
    metrics.peak_flops."""

    def __init__(self, cfg: JobConfig, device, world: int, micro_batch: int, accum: int):
        self.device, self.world, self.micro_batch, self.accum = device, world, micro_batch, accum
        # the matmuls' dtype: bf16 parameters (model.dtype) run in bf16 whatever train.precision says
        precision = "bf16" if cfg.model.dtype == "bfloat16" else cfg.train.precision
        self.peak, self.peak_source = metrics.peak_flops(device, precision, cfg.train.peak_tflops,
                                                         tf32=cfg.train.tf32)
        self.flops_per_sample = None  # set by count(), on rank 0

    @staticmethod
    def counts_before_wrapping(cfg: JobConfig) -> bool:
        """FSDP gathers parameters in every forward (rank 0 cannot run one alone) and a compiled model would
        compile for the count: those count on the plain module, before wrapping. DDP counts after the restore,
        on the module inside DDP, while the first epoch's pipeline starts (worker/feed.py)."""
        return cfg.scaling.strategy != "ddp" or cfg.train.compile

    def count(self, task: Task, model) -> None:
        """Count the FLOPs per sample on `model`, a plain module (no wrapper, no collectives in its forward).
        Once per process for a model and an example batch of the same shapes (a sweep's warm lane trains many
        trials of one model: the count is the same)."""
        batch = task.example_batch(1)  # FLOPs per sample do not depend on the batch; one sample is cheapest
        key = (type(task).__qualname__, type(model).__qualname__,
               tuple((name, tuple(p.shape)) for name, p in model.named_parameters()),
               tuple((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items() if hasattr(v, "shape")))
        if key not in _COUNTED:
            buffers, training = {k: v.clone() for k, v in model.named_buffers()}, model.training
            model.eval()
            _COUNTED[key] = metrics.training_flops_per_sample(lambda: task.loss(model, batch), 1, self.device)
            model.train(training)
            model.load_state_dict(buffers, strict=False)
        self.flops_per_sample = _COUNTED[key]

    def metrics(self, samples_per_s: float) -> dict:
        out = {"peak_mem_gb": metrics.peak_memory_bytes(self.device) / 1e9,
               "micro_batch_size": self.micro_batch, "grad_accum_steps": self.accum}
        if self.flops_per_sample is None:  # ranks other than 0: their reports' metrics are not kept
            return out
        out["tflops_per_worker"] = self.flops_per_sample * samples_per_s / self.world / 1e12
        out["model_tflops_per_sample"] = self.flops_per_sample / 1e12
        if self.peak:
            out["mfu"] = metrics.mfu(self.flops_per_sample, samples_per_s, self.world, self.peak)
        return out
