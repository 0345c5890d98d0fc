"""Benchmark P4 at >= 1 GB of state (issue 19): FSDP checkpoints gathered on rank 0 (checkpoint.format full)
against sharded ones (every rank writes its own shards with torch.distributed.checkpoint), and both against
a synchronous torch.save of the same state, on 2 FSDP workers (fsdp_full, gloo).

For each checkpoint of each run:
- blocked: how long it held the training loop (`checkpoint_block_s`, rank 0, reported with the next metrics:
  the report, and the wait before the next optimizer update for the copy of the state to host memory);
- total: from the report that started it (rank 0's `wall_time`) to its manifest on disk (the mtime of
  manifest.json, written last): what a failure at that moment could lose;
and per run rank 0's peak resident memory (`peak_mem_gb`, ru_maxrss) at the last report less at the first,
taken before any checkpoint: what the checkpoints added to rank 0's peak.
The baseline: `torch.save({"model", "optimizer"})` of the whole state (the model and AdamW state after 2
real steps) by one process into the same disk, timed in this process: what a user's loop does.

    .venv/bin/python bench/sharded_checkpoint.py [--repeats 2] [--hidden 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from _common import checkpoint_bytes, lm_corpus, lm_job, run_behemoth, spread
from checkpoint_blocking import block_times, torch_save_seconds


def save_totals(run_dir: Path, reports: list[dict]) -> list[float]:
    """Per checkpoint: its manifest's mtime less the wall time of the report that started it (not the last
    one's: the run's final evaluation runs between the two)."""
    started = {r["step"]: r["wall_time"] for r in reports if "wall_time" in r and "val_loss" not in r}
    totals = []
    for folder in run_dir.glob("checkpoint_*"):
        if (folder / "manifest.json").is_file():
            step = json.loads((folder / "train_state.json").read_text())["step"]
            if step in started:
                totals.append((folder / "manifest.json").stat().st_mtime - started[step])
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--checkpoints", type=int, default=4)
    args = p.parse_args()

    from behemoth.data.text.text_packing import prepare_text
    from behemoth.driver.ray_cluster.session import ensure_ray
    from behemoth.job import config_from_dict

    storage = Path(tempfile.mkdtemp(prefix="bench-p4-sharded-"))
    corpus = lm_corpus()

    def job(run: str, layout: str) -> dict:
        return lm_job(corpus, storage, run, hidden=args.hidden, layers=args.layers, batch=4, seq_len=32,
                      workers=2, threads=1, steps=args.every * args.checkpoints, log_every=args.every,
                      checkpoint_every=args.every, scaling={"strategy": "fsdp_full"},
                      checkpoint={"format": layout, "keep": args.checkpoints})

    cfg = config_from_dict(job("plain", "full"))
    ensure_ray()
    tokens = prepare_text(cfg.data, seed=0)
    blocked, totals, rise = ({"full": [], "sharded": []} for _ in range(3))
    plain: list[float] = []
    for r in range(args.repeats):
        for layout in ("full", "sharded") if r % 2 == 0 else ("sharded", "full"):
            run = f"{layout}_{r}"
            reports = run_behemoth(job(run, layout))
            blocked[layout] += block_times(reports)
            totals[layout] += save_totals(storage / run, reports)
            peaks = [x["peak_mem_gb"] for x in reports if "peak_mem_gb" in x]
            rise[layout].append(peaks[-1] - peaks[0])
            if r > 0:  # 1.6 GB per checkpoint: the first runs' folders are kept for the size line, no more
                shutil.rmtree(storage / run)
        plain += torch_save_seconds(cfg, tokens, storage, 2)
        print(f"repeat {r}: blocked full {statistics.median(blocked['full']):.3f} s, sharded "
              f"{statistics.median(blocked['sharded']):.3f} s, torch.save {statistics.median(plain):.3f} s",
              flush=True)
    size = checkpoint_bytes(storage / "full_0") / 1e9
    print(f"LM hidden {args.hidden}, {args.layers} layers, 2 FSDP workers: {size:.2f} GB of state per checkpoint "
          f"(model + AdamW); a checkpoint every {args.every} steps, {args.repeats} runs per layout")
    for layout in ("full", "sharded"):
        print(f"  {layout:8s} blocked {spread(blocked[layout])} s; total {spread(totals[layout])} s; rank 0 peak "
              f"+{spread(rise[layout], '{:.2f}')} GB")
    print(f"  synchronous torch.save (one process): {spread(plain)} s")
    for layout in ("full", "sharded"):
        print(f"  ratio torch.save / {layout} blocked: {statistics.median(plain) / statistics.median(blocked[layout]):.1f}x "
              f"less blocking (medians)")
    shutil.rmtree(storage)


if __name__ == "__main__":
    main()
