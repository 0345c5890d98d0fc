"""What the training benchmarks share: a generated corpus, an LM job, behemoth's metrics log, and figures.

Every benchmark runs behemoth through `behemoth.driver.run.trainer.train` (a real local Ray, Ray Train workers) and
reads what the run reported from RUN_DIR/metrics.jsonl, the log every run writes.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from behemoth.driver.commands.data_bench import MachineCpu  # noqa: E402,F401  (the benches import it from here)


def lm_corpus(root: Path = REPO / "data" / "bench_text", train_documents: int = 2000) -> Path:
    """Generated stories (`train_documents` train / 100 val documents) and a 1,024-token BPE tokenizer, made
    once per folder."""
    from behemoth.data.text.synth_text import write_synth_text
    from behemoth.data.tokenizer import train_tokenizer

    if not (root / "train.jsonl").is_file():  # (each made once: neither is ever written over)
        write_synth_text(root, train_documents=train_documents, val_documents=100, seed=0)
    if not (root / "tokenizer" / "tokenizer.json").is_file():
        train_tokenizer([str(root / "train.jsonl")], root / "tokenizer", vocab_size=1024)
    return root


# TinyLlama 1.1B's shape (22 layers, hidden 2048, grouped-query attention 32/4 heads, vocabulary 32000), built
# from the config (no download): the ~1B causal LM the GPU tier measures. The tokenizer's 1,024 tokens fill
# the low ids; the embedding and head have all 32000 rows, so the compute is the real model's.
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000}
# The same code paths at a size a CPU trains in seconds (the benches' --tiny dry runs)
TINYLLAMA_TINY = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 2048}


def demo_images_cached() -> None:
    """The demo's images (made once) and their decoded cache (built once), as every run after the data set's
    first use finds them."""
    import subprocess

    if not (REPO / "data" / "demo_images" / "train").is_dir():
        subprocess.run([sys.executable, "-m", "behemoth", "data", "synth-images", "--out", "data/demo_images"],
                       cwd=REPO, check=True)
    subprocess.run([sys.executable, "-m", "behemoth", "data", "cache", "jobs/configs/demo_images.yaml"], cwd=REPO,
                   check=True, capture_output=True)


def lm_job(corpus: Path, storage: Path, run_name: str, *, hidden: int = 256, layers: int = 4, seq_len: int = 128,
           batch: int = 16, steps: int = 60, workers: int = 1, threads: int = 2, log_every: int = 10,
           checkpoint_every: int = 10_000, gpu: bool = False, hf_config: dict | None = None, **sections) -> dict:
    """A Llama-style LM job on the corpus. `sections` update a section's keys, e.g. train={...}. `gpu`: one
    GPU per worker (nccl), in bf16. `hf_config`: the model's shape instead of hidden/layers (TINYLLAMA)."""
    job = {
        "data": {"kind": "text", "train_files": [str(corpus / "train.jsonl")],
                 "val_files": [str(corpus / "val.jsonl")], "tokenizer": str(corpus / "tokenizer"),
                 "seq_len": seq_len, "cache_dir": str(storage / "cache"), "cpus_per_task": 0.25},
        "model": {"name": "causal_lm", "hf_config": {
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": max(hidden // 64, 1),
            "max_position_embeddings": seq_len, **(hf_config or {})}},
        "train": {"epochs": 100, "max_steps": steps, "global_batch_size": batch, "optimizer": "adamw",
                  "lr": 3e-4, "weight_decay": 0.0, "warmup_steps": 5, "log_every": log_every},
        "scaling": {"num_workers": workers, "cpus_per_worker": 1.0 if workers == 1 else 0.75,
                    "torch_threads": threads, "use_gpu": gpu},
        "checkpoint": {"every_n_steps": checkpoint_every, "keep": 2, "storage_path": str(storage),
                       "run_name": run_name},
        "eval": {"every_n_steps": None, "per_epoch": False},
        "failure": {"max_failures": 0},
    }
    if gpu:
        job["train"]["precision"] = "bf16"
    for section, values in sections.items():
        job[section].update(values)
    return job


def device_of(cfg):
    """The device a plain loop of the job trains on (one GPU where the job uses them)."""
    import torch

    return torch.device("cuda", 0) if cfg.scaling.use_gpu else torch.device("cpu")


def run_behemoth(job: dict) -> list[dict]:
    """Train the job; return every report rank 0 made (metrics.jsonl of the run)."""
    from behemoth.driver.run.trainer import train
    from behemoth.job import config_from_dict

    summary = train(config_from_dict(job))
    return read_metrics(Path(summary.run_dir))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_bytes(run_dir: Path) -> int:
    """The size of one complete checkpoint of a run (the files of its first checkpoint folder with a manifest).
    Not whatever `checkpoint_*` a directory listing gives first: Ray Train keeps its
    checkpoint_manager_snapshot.json beside the folders, and the listing's order differs between machines."""
    folder = next((c for c in sorted(run_dir.glob("checkpoint_*")) if (c / "manifest.json").is_file()), None)
    if folder is None:
        raise FileNotFoundError(f"no complete checkpoint (a checkpoint_* folder with its manifest.json) in {run_dir}")
    return sum(f.stat().st_size for f in folder.iterdir())


def steady_steps_per_s(reports: list[dict], batch: int) -> float:
    """behemoth.driver.commands.data_bench.steady_step_rate: first training report to last, by rank 0's clock (the
    baselines are timed from their first measured step to their last). (`batch` is unused: kept so callers
    read the same.)"""
    from behemoth.driver.commands.data_bench import steady_step_rate

    return steady_step_rate(reports)


def spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    return f"median {fmt.format(statistics.median(xs))} (min {fmt.format(min(xs))}, max {fmt.format(max(xs))})"


