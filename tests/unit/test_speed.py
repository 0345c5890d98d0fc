"""Speed switches without Ray: their config checks, the automatic micro-batch search, MFU and memory metrics."""

import pytest
import torch

from behemoth import metrics
from behemoth.worker import autobatch
from behemoth.config import ConfigError
from behemoth.job import load_config

from .test_config import write


@pytest.mark.parametrize("text, message", [
    ("train:\n  micro_batch_size: 16\n  grad_accum_steps: 2\n", "both set"),
    ("train:\n  micro_batch_size: auto\n", "auto_batch_memory_mb"),
    ("train:\n  global_batch_size: 64\n  micro_batch_size: 12\n", r"num_workers 2 x train.micro_batch_size 12"),
    ("train:\n  grad_compression: powersgd\nscaling:\n  strategy: fsdp_full\n", "DDP communication hook"),
    ("train:\n  grad_compression: topk\n", "must be one of"),
    ("train:\n  compile_mode: fast\n", "must be one of"),
    ("scaling:\n  strategy: zero2\n", "must be one of"),
    ("train:\n  precision: fp16\n", "needs a GPU"),
])
def test_speed_switch_mistakes_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_speed_switches_accepted(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  global_batch_size: 64\n  micro_batch_size: auto\n"
                                      "  auto_batch_memory_mb: 512\n  compile: true\n  grad_compression: bf16\n"
                                      "  precision: bf16\ncheckpoint:\n  async_save: false\n"))
    assert cfg.train.micro_batch_size == "auto" and cfg.train.grad_compression == "bf16"
    cfg = load_config(write(tmp_path, "train:\n  global_batch_size: 64\n  micro_batch_size: 8\n"
                                      "scaling:\n  strategy: fsdp_grad_op\n"))
    assert cfg.train.micro_batch_size == 8 and cfg.scaling.strategy == "fsdp_grad_op"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _loss_at(model):
    return lambda m: torch.nn.functional.cross_entropy(model(torch.randn(m, 64)), torch.zeros(m, dtype=torch.long))


def test_step_memory_counts_weights_grads_optimizer_and_activations():
    model = _mlp()
    params = sum(p.numel() for p in model.parameters()) * 4
    one, two = (autobatch.step_memory_bytes(model, lambda m=m: _loss_at(model)(m), 1) for m in (100, 200))
    # activations saved for the backward: input 64, linear out 256 (for ReLU), ReLU out 256, logits 10 ...
    per_sample = (two - one) / 100
    assert 4 * (64 + 256) <= per_sample <= 4 * (64 + 3 * 256 + 3 * 10)
    assert one - 100 * per_sample == pytest.approx(3 * params, rel=0.01)  # weights + grads + momentum
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradients behind


def test_auto_micro_batch_finds_the_limit_under_a_cap():
    model = _mlp()
    cpu = torch.device("cpu")

    def memory(m):
        return autobatch.step_memory_bytes(model, lambda: _loss_at(model)(m), 1)

    cap = memory(37) + 1  # 37 samples fit, 38 do not
    largest, micro = autobatch.find_micro_batch(model, _loss_at(model), share=64, device=cpu, cap_bytes=cap,
                                                optimizer_slots=1)
    assert largest == 37 and memory(37) <= cap < memory(38)
    assert micro == 32  # the largest divisor of the worker's 64 samples at or under 37: 2 accumulation steps
    assert autobatch.find_micro_batch(model, _loss_at(model), 64, cpu, 10**12, 1) == (64, 64)  # no limit hit
    with pytest.raises(ConfigError, match="even 1 sample"):  # not retried (errors.NOT_RETRIED)
        autobatch.find_micro_batch(model, _loss_at(model), 64, cpu, memory(1) - 1, 1)


def test_largest_fitting_is_a_binary_search():
    calls = []

    def fits(m):
        calls.append(m)
        return m <= 300

    assert autobatch.largest_fitting(fits, 1000) == 300 and len(calls) <= 11
    assert autobatch.largest_fitting(lambda m: False, 8) == 0
    assert autobatch.largest_divisor_at_most(48, 20) == 16 and autobatch.largest_divisor_at_most(7, 6) == 1


def test_flops_per_sample_counts_the_model():
    model = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    # forward: 2 * 64 * 32 per sample; training = 3x forward
    assert metrics.training_flops_per_sample(lambda: model(x), 8) == 3 * 2 * 64 * 32


def test_a_causal_lms_attention_is_counted_on_a_cpu():
    """torch's FLOP counter has no formula for SDPA's fused CPU kernel: a Llama's attention counted nothing on a
    CPU (its TFLOP/s and MFU under-stated, more so the longer the sequence). Counted as the eager model counts it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    counts = {}
    for implementation in ("sdpa", "eager"):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=512)
        config._attn_implementation = implementation
        model, ids = LlamaForCausalLM(config), torch.randint(0, 64, (1, 512))
        counts[implementation] = metrics.training_flops_per_sample(lambda: model(input_ids=ids), 1, "cpu")
    attention = 3 * 2 * 2 * 512 * 512 * 32  # (QK^T and AV, full, forward x 3)
    assert counts["sdpa"] == counts["eager"] and counts["sdpa"] > attention


def test_mfu_and_peak_flops():
    assert metrics.mfu(1e9, 100.0, devices=2, device_peak_flops=1e11) == pytest.approx(0.5)
    assert metrics.peak_flops(torch.device("cpu"), "fp32", override_tflops=2.0) == (2e12, "train.peak_tflops 2")
    assert metrics.peak_memory_bytes(torch.device("cpu")) > 50e6  # this process's peak RSS


@pytest.mark.parametrize("name, bf16", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.0), ("Tesla T4", 8.1), ("NVIDIA GH200 480GB", 989.0),
    # matched by substring: L40 read as L4 (MFU 1.5x too high), the PCIe H100 as the SXM one (24 % too low)
    ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", None), ("NVIDIA RTX 6000 Ada Generation", None)])
def test_a_gpus_data_sheet_row_is_found_by_its_whole_name(monkeypatch, name, bf16):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = metrics.peak_flops(torch.device("cuda"), "bf16")
    assert (peak and peak / 1e12) == bf16 and (f"data sheet for {name}, bf16" if bf16 else "train.peak_tflops") in source


def test_mfu_counts_against_the_bf16_peak_where_the_parameters_are_bf16(monkeypatch):
    """model.dtype bfloat16 with train.precision fp32 runs every matmul in bf16: MFU against the fp32 column was
    2x too high (TF32), 15x without TF32."""
    from behemoth.job import config_from_dict
    from behemoth.worker.speed import SpeedMeter

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    job = {"data": {"kind": "image_folder", "root": "x"}, "model": {"dtype": "bfloat16"},
           "train": {"precision": "fp32", "tf32": False}}
    speed = SpeedMeter(config_from_dict(job), torch.device("cuda"), 1, 8, 1)
    assert speed.peak == 989e12 and speed.peak_source.endswith("bf16")


def test_no_mfu_without_a_peak_the_device_cannot_beat():
    """A CPU has no data-sheet peak (a timed matmul was beaten: 101 % MFU in sweep trials): no MFU, the
    achieved TFLOP/s instead, and the line says why."""
    peak, source = metrics.peak_flops(torch.device("cpu"), "fp32")
    assert peak is None and "train.peak_tflops" in source
    m = {"epoch": 0.5, "step": 10, "loss": 1.0, "lr": 0.1, "samples_per_s": 100.0, "data_wait_frac": 0.0,
         "tflops_per_worker": 0.0123, "eta_s": 30}
    line = metrics.progress_line(m, 20, 1)
    assert "0.0123 TFLOP/s/worker" in line and "MFU" not in line


def test_progress_line_shows_mfu_and_memory():
    m = {"epoch": 0.5, "step": 10, "loss": 1.0, "lr": 0.1, "samples_per_s": 100.0, "data_wait_frac": 0.25,
         "mfu": 0.123, "peak_mem_gb": 1.5, "eta_s": 30}
    line = metrics.progress_line(m, 20, 1)
    assert "MFU 12.3%" in line and "mem 1.50 GB" in line and "data-wait 25%" in line


def test_the_gradient_norm_and_skipped_steps_are_in_the_progress_line_and_the_trackers_curves():
    """Issue 58: every report's grad_norm in the console line, in TensorBoard's and MLflow's curves (under
    train/), and the count of skipped steps where there are any."""
    from behemoth.tracking.tensorboard import scalar_tags

    m = {"epoch": 0.5, "step": 10, "loss": 1.0, "lr": 0.1, "grad_norm": 2.345, "samples_per_s": 100.0,
         "data_wait_frac": 0.25, "eta_s": 30}
    assert "grad-norm 2.35" in metrics.progress_line(m, 20, 1) and "skipped" not in metrics.progress_line(m, 20, 1)
    assert "skipped 3" in metrics.progress_line({**m, "skipped_steps": 3}, 20, 1)
    tags = scalar_tags({**m, "skipped_steps": 3})
    assert tags["train/grad_norm"] == 2.345 and tags["train/skipped_steps"] == 3.0


def test_ray_data_scheduling_loop_is_paced_only_while_the_consumer_has_batches(monkeypatch):
    """ray_internals.data.pace_scheduling_loop: Ray Data's loop spun while training (the consumer) was busy."""
    import time

    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    from behemoth.ray_internals import data

    steps, sleeps = [], []
    monkeypatch.setattr(StreamingExecutor, "_scheduling_loop_step", lambda self, topology: steps.append(1) or True)
    monkeypatch.setattr(time, "sleep", sleeps.append)
    data.pace_scheduling_loop()
    data.pace_scheduling_loop()  # installed once: a second call does not wrap it again

    class Executor:
        idle = False

        def _consumer_idling(self):
            return self.idle

    ex = Executor()
    assert StreamingExecutor._scheduling_loop_step(ex, None) is True and sleeps == [data.SCHEDULER_PAUSE_S]
    ex.idle = True  # the consumer waits for data: no pause
    StreamingExecutor._scheduling_loop_step(ex, None)
    assert sleeps == [data.SCHEDULER_PAUSE_S] and len(steps) == 2


def test_the_progress_line_counts_the_epochs_the_run_trains_where_max_steps_ends_it_first():
    """A run of train.epochs 100 ended by train.max_steps 50 at 31 steps per epoch said "epoch 1.20/100"."""
    from behemoth.worker.reporting import run_epochs

    m = {"epoch": 1.2, "step": 37, "eta_s": 10}
    assert metrics.progress_line(m, 50, run_epochs(100, 50, 31)).startswith("epoch 1.20/1.61 | step 37/50")
    assert metrics.progress_line(m, 3100, run_epochs(100, 3100, 31)).startswith("epoch 1.20/100 | step 37/3100")
