"""Benchmark P4: how long a checkpoint holds up training — behemoth vs a synchronous torch.save.

behemoth (checkpoint.async_save, the default) blocks the step only for a host-memory copy of the state;
the files, their sha256 manifest and the upload to the run folder are written by Ray Train's upload thread
while training goes on. Each behemoth run reports `checkpoint_block_s` (the time the last checkpoint held
the loop) with its next metrics; a run checkpoints every --every steps. The baseline is what a user's loop
would do at the same point: `torch.save({"model": ..., "optimizer": ...}, path)` of the same state (same
model, AdamW state after real steps) into the same folder, timed in this process. For reference the
synchronous behemoth path (checkpoint.async_save=false: write + sha256 + manifest + upload before going
on) is run too. Runs alternate with the baseline saves, --repeats of each.

    .venv/bin/python bench/checkpoint_blocking.py [--repeats 3] [--hidden 512] [--layers 6] [--gpu]
    .venv/bin/python bench/checkpoint_blocking.py --tinyllama [--tiny]

--gpu: the state on one GPU (behemoth's snapshot copies it to host memory on a side stream; torch.save copies
it inside), the GPU tier's checkpoint-stall figure.

--tinyllama: the real shape on one GPU: TinyLlama 1.1B's architecture with its AdamW state (~13 GB of fp32
weights and moments), three checkpoints --every steps apart (spaced further than a write takes: the bench says
when they were not), one kept, no synchronous reference run, one torch.save. On a GPU the snapshot's copy runs on the device beside the
steps, so the host-side checkpoint_block_s misses what the GPU lost: the figure is the **GPU time a step loses
per checkpoint**, from the report windows (each report reads the loss: the device is synchronised there): the
time of the windows between a checkpoint and the next over the same number of the run's median windows.
Floor (the GPU tier's): that loss <= 1/10 of torch.save's time for the same state, after the first checkpoint
(which allocates its pinned host buffers; the next reuses them where the first write is done), else exit 1
naming the figures. The loss is printed the moment behemoth's run ends (a device call cut short keeps it); the run
folder is removed before the torch.save baseline (disk: one 13 GB checkpoint kept and one in writing, then one
torch.save file). --tiny: the same at a CPU's size, floor not checked (a dry run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import TINYLLAMA, TINYLLAMA_TINY, checkpoint_bytes, device_of, lm_corpus, lm_job, run_behemoth, spread


def torch_save_seconds(cfg, tokens, folder: Path, saves: int) -> list[float]:
    """Synchronous torch.save of model + AdamW state (after 2 real steps, so the state exists)."""
    import numpy as np
    import torch

    from behemoth.tasks.causal_lm import CausalLM

    torch.manual_seed(0)
    device = device_of(cfg)
    model = CausalLM(cfg, tokens).build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.from_numpy(tokens.train[:4].astype(np.int64)).to(device)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    times = []
    for i in range(saves):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the steps' kernels are not the save's time
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / f"plain_{i}.pt")
        times.append(time.perf_counter() - t0)
        (folder / f"plain_{i}.pt").unlink()
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next behemoth run's worker needs the GPU's memory
    return times


def step_rate(reports: list[dict]) -> float:
    """Steps per second between the first and the last report, by rank 0's clock (checkpoints included)."""
    return (reports[-1]["step"] - reports[0]["step"]) / (reports[-1]["wall_time"] - reports[0]["wall_time"])


def block_times(reports: list[dict]) -> list[float]:
    return [r["checkpoint_block_s"] for r in reports if "checkpoint_block_s" in r]


def lost_per_checkpoint(reports: list[dict], every: int) -> list[float]:
    """For each checkpoint with training after it: the seconds its interval's report windows took beyond as
    many of the run's median windows (the first report is warm-up: no window ends there)."""
    import statistics

    train = [r for r in reports if "wall_time" in r and "loss" in r]
    windows = [(b["step"], b["wall_time"] - a["wall_time"], b["step"] - a["step"]) for a, b in zip(train, train[1:])]
    per_step = statistics.median(seconds / steps for _, seconds, steps in windows)
    lost = []
    for start in range(every, train[-1]["step"], every):
        inside = [(seconds, steps) for end, seconds, steps in windows if start < end <= start + every]
        lost.append(sum(seconds for seconds, _ in inside) - per_step * sum(steps for _, steps in inside))
    return lost


def windows_per_step(reports: list[dict]) -> list[float]:
    train = [r for r in reports if "wall_time" in r and "loss" in r]
    return [(b["wall_time"] - a["wall_time"]) / (b["step"] - a["step"]) for a, b in zip(train, train[1:])]


def write_seconds(reports: list[dict], run_dir: Path, every: int) -> dict[int, float]:
    """Each kept checkpoint's write: from its report to its manifest (written last), by the same clock. The kept
    ones are the last of the run's checkpoint steps, in the order their manifests were written."""
    at = {r["step"]: r["wall_time"] for r in reports if "wall_time" in r}
    manifests = sorted(run_dir.glob("checkpoint_*/manifest.json"), key=lambda m: m.stat().st_mtime)
    steps = [s for s in sorted(at) if s % every == 0 or s == max(at)][-len(manifests):] if manifests else []
    return {step: m.stat().st_mtime - at[step] for step, m in zip(steps, manifests)}


def print_lost(lost: list[float], writes: dict[int, float], spacing: float) -> None:
    """The GPU time lost per checkpoint (the floor's figure) and the writes' times, as soon as the run ends."""
    steady = lost[1:] or lost
    print(f"  GPU time lost per checkpoint: median {statistics.median(steady):.3f} s after the first (each: "
          f"{', '.join(f'{x:.3f}' for x in lost)} s; the steps' own time from the run's median window)", flush=True)
    if writes:
        close = '' if max(writes.values()) < spacing else (': CLOSER than a write, so the figure includes waiting '
                                                            'for buffers: raise --every')
        print(f"  writes (report to manifest): {', '.join(f'step {k}: {v:.1f} s' for k, v in sorted(writes.items()))}; "
              f"checkpoints {spacing:.1f} s apart{close}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--every", type=int, help="steps between checkpoints (5; 500 with --tinyllama)")
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--gpu", action="store_true", help="the model and its optimizer state on one GPU")
    p.add_argument("--tinyllama", action="store_true", help="TinyLlama 1.1B's shape on one GPU, with its floor")
    p.add_argument("--tiny", action="store_true", help="with --tinyllama: a dry run at a CPU's size")
    args = p.parse_args()
    shape = None
    if args.tinyllama:
        shape, args.gpu = (TINYLLAMA_TINY, False) if args.tiny else (TINYLLAMA, True)
        # the first checkpoint allocates its host buffers (pinned: seconds at 13 GB); the floor is held by the
        # one after it, --every steps later (a real run checkpoints far less often than its disk writes: at
        # ~40 ms a step of 512 tokens on an H100, 500 steps are ~20 s, about one 13 GB write with its sha256)
        args.repeats, args.checkpoints = 1, 3
        args.every = args.every or (20 if args.tiny else 500)
    args.every = args.every or 5

    from behemoth.job import config_from_dict
    from behemoth.data.text.text_packing import prepare_text
    from behemoth.driver.ray_cluster.session import ensure_ray

    storage = Path(tempfile.mkdtemp(prefix="bench-p4-"))
    corpus = lm_corpus()

    def job(run, async_save=True):
        return lm_job(corpus, storage, run, hidden=args.hidden, layers=args.layers, batch=8, seq_len=64,
                      steps=args.every * args.checkpoints, log_every=max(args.every // 20, 1) if args.tinyllama
                      else args.every, checkpoint_every=args.every,
                      checkpoint={"async_save": async_save, "keep": 1 if args.tinyllama else 2}, gpu=args.gpu,
                      hf_config=shape)

    cfg = config_from_dict(job("plain"))
    ensure_ray()
    tokens = prepare_text(cfg.data, seed=0)
    ours, sync, plain, rates = [], [], [], {"async": [], "sync": []}
    lost, writes = [], {}
    for r in range(args.repeats):
        reports = run_behemoth(job(f"p4_async_{r}"))
        ours += block_times(reports)
        rates["async"].append(step_rate(reports))
        size = checkpoint_bytes(storage / f"p4_async_{r}") / 2**20
        if args.tinyllama:
            lost += lost_per_checkpoint(reports, args.every)
            writes = write_seconds(reports, storage / f"p4_async_{r}", args.every)
            print_lost(lost, writes, args.every * statistics.median(windows_per_step(reports)))
            shutil.rmtree(storage / f"p4_async_{r}")  # the disk holds one 1.1B state at a time
        plain += torch_save_seconds(cfg, tokens, storage, 1 if args.tinyllama else args.checkpoints - 1)
        if not args.tinyllama:  # (at 1B the synchronous reference would double the tier's time)
            reports = run_behemoth(job(f"p4_sync_{r}", async_save=False))
            sync += block_times(reports)
            rates["sync"].append(step_rate(reports))
        print(f"repeat {r}: behemoth async {statistics.median(ours):.3f} s, behemoth sync "
              f"{statistics.median(sync or [0]):.3f} s, torch.save {statistics.median(plain):.3f} s", flush=True)
    what = (f"TinyLlama-1.1B shape{' (tiny: a dry run)' if args.tiny else ''}" if args.tinyllama
            else f"LM hidden {args.hidden}, {args.layers} layers")
    print(f"{what}: checkpoint of {size:.0f} MiB (model + AdamW state); "
          f"a checkpoint every {args.every} steps, {len(ours)} checkpoints per variant")
    print(f"  behemoth async (default):   blocked {spread(ours, '{:.4f}')} s per checkpoint")
    if sync:
        print(f"  behemoth sync (reference):  blocked {spread(sync, '{:.4f}')} s per checkpoint")
    print(f"  synchronous torch.save:     blocked {spread(plain, '{:.4f}')} s per checkpoint")
    ratio = statistics.median(plain) / statistics.median(ours)
    print(f"  ratio torch.save / behemoth async: {ratio:.1f}x less blocking (medians)")
    if sync:
        print(f"  whole-run step rate incl. checkpoints: async {spread(rates['async'])} vs sync "
              f"{spread(rates['sync'])} steps/s")
    shutil.rmtree(storage)  # ~6 GB of checkpoints after 5 repeats
    if not args.tinyllama:
        return 0
    steady = lost[1:] or lost
    if args.tiny:
        print("  floor not checked: a dry run on a CPU at a toy size (GPU time lost <= 1/10 of torch.save on one GPU)")
        return 0
    ratio = statistics.median(plain) / max(statistics.median(steady), 1e-9)
    met = ratio >= 10
    print(f"  floor: {'met' if met else 'FAILED'}: torch.save / GPU time lost {ratio:.1f}x (>= 10x) after the first "
          f"checkpoint")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
