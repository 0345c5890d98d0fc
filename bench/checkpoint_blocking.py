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
weights and moments), two checkpoints, no synchronous reference run; floor (the GPU tier's): blocked per
checkpoint <= 1/10 of torch.save's, else exit 1 naming the figures. --tiny: the same at a CPU's size, floor
not checked (a dry run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import TINYLLAMA, TINYLLAMA_TINY, device_of, lm_corpus, lm_job, run_behemoth, spread


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--gpu", action="store_true", help="the model and its optimizer state on one GPU")
    p.add_argument("--tinyllama", action="store_true", help="TinyLlama 1.1B's shape on one GPU, with its floor")
    p.add_argument("--tiny", action="store_true", help="with --tinyllama: a dry run at a CPU's size")
    args = p.parse_args()
    shape = None
    if args.tinyllama:
        shape, args.gpu = (TINYLLAMA_TINY, False) if args.tiny else (TINYLLAMA, True)
        # the first checkpoint allocates its host buffers (pinned: seconds at 13 GB); the floor is held by the
        # ones after it, 30 steps apart (a real run checkpoints far less often than its disk writes)
        args.repeats, args.checkpoints, args.every = 1, 4, 30

    from behemoth.job import config_from_dict
    from behemoth.data.text_packing import prepare_text
    from behemoth.driver.ray_session import ensure_ray

    storage = Path(tempfile.mkdtemp(prefix="bench-p4-"))
    corpus = lm_corpus()

    def job(run, async_save=True):
        return lm_job(corpus, storage, run, hidden=args.hidden, layers=args.layers, batch=8, seq_len=64,
                      steps=args.every * args.checkpoints, log_every=args.every, checkpoint_every=args.every,
                      checkpoint={"async_save": async_save, "keep": 2}, gpu=args.gpu, hf_config=shape)

    cfg = config_from_dict(job("plain"))
    ensure_ray()
    tokens = prepare_text(cfg.data, seed=0)
    ours, sync, plain, rates = [], [], [], {"async": [], "sync": []}
    for r in range(args.repeats):
        reports = run_behemoth(job(f"p4_async_{r}"))
        ours += block_times(reports)
        rates["async"].append(step_rate(reports))
        plain += torch_save_seconds(cfg, tokens, storage, args.checkpoints - 1)
        if not args.tinyllama:  # (at 1B the synchronous reference would double the tier's time)
            reports = run_behemoth(job(f"p4_sync_{r}", async_save=False))
            sync += block_times(reports)
            rates["sync"].append(step_rate(reports))
        print(f"repeat {r}: behemoth async {statistics.median(ours):.3f} s, behemoth sync "
              f"{statistics.median(sync or [0]):.3f} s, torch.save {statistics.median(plain):.3f} s", flush=True)
    size = sum(f.stat().st_size for f in next(storage.glob("p4_async_0/checkpoint_*")).iterdir()) / 2**20
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
    if args.tiny:
        print("  floor not checked: a dry run on a CPU at a toy size (>= 10x on one GPU)")
        return 0
    steady = statistics.median(plain) / statistics.median(ours[1:] or ours)
    print(f"  floor: {'met' if steady >= 10 else 'FAILED'}: torch.save / behemoth async {steady:.1f}x (>= 10x) "
          f"after the first checkpoint (blocked {', '.join(f'{b:.3f}' for b in ours)} s)")
    return 0 if steady >= 10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
