"""Benchmark P1: behemoth's steady-state training step rate (1 Ray Train worker) vs a plain PyTorch loop.

Both train the same Llama-style LM (built by behemoth from the same config and seed) on the same packed
token blocks in the same order, with AdamW, the same batch and the same torch thread count; the plain loop
runs in this process with nothing around it. Both are timed as one continuous span: the plain loop from its
first measured step to its last; behemoth from its first report (the --log-every steps before it are
warm-up, as the plain loop's) to its last, by rank 0's clock at each report, so the span holds everything
behemoth does: the sample order, the metrics all-reduce, every report to Ray Train and console line, the
data-wait timing. Checkpoints and evaluation happen only after the last measured step. Runs alternate,
--repeats of each.

    .venv/bin/python bench/step_overhead.py [--repeats 5] [--steps 60] [--threads 2] [--hidden 256] [--gpu]
    .venv/bin/python bench/step_overhead.py --fast [--repeats 3]
    .venv/bin/python bench/step_overhead.py --tinyllama [--tiny] [--repeats 1]

--fast: the fast shape (hidden 64, batch 4, one torch thread, 300 steps: a CPU step of ~20 ms, a GPU's step
time for a small model), where what a platform does around the step shows most: reports to Ray Train, the
all-reduce of the metrics, console lines. Floor: behemoth >= 0.97 of the plain loop (issue 55).

--gpu: both on one GPU in bf16 (behemoth's worker with nccl; the plain loop under torch.autocast), the GPU tier's
step-rate figure.

--tinyllama: the real shape, on one GPU: TinyLlama 1.1B's architecture (22 layers, hidden 2048, GQA 32/4 heads,
vocabulary 32000) from its config, blocks of 2048 tokens, bf16 autocast over fp32 master weights, each decoder
layer compiled, fused AdamW (betas 0.9/0.95); the plain loop is the script a careful user writes with the same
model, compile and optimizer. Floors (the GPU tier's): MFU >= 40 % of the GPU's data-sheet bf16 peak and
tokens/s >= 0.97 of the plain loop; a figure under one exits 1, naming it. --tiny: the same code paths at a size
a CPU trains in seconds (a dry run: the floors are not checked, and it says so).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import (REPO, TINYLLAMA, TINYLLAMA_TINY, device_of, lm_corpus, lm_job, run_behemoth, spread,
                     steady_steps_per_s)


def plain_steps_per_s(cfg, tokens, steps: int, warmup: int, threads: int) -> float:
    """The loop a user would write: same model, data order, optimizer and threads, the job's compile (each
    decoder layer, as a careful user compiles a transformer) and AdamW (fused on a GPU); no Ray."""
    import numpy as np
    import torch

    from behemoth.data.order import rank_train_indices
    from behemoth.tasks.causal_lm import CausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    device = device_of(cfg)
    model = CausalLM(cfg, tokens).build_model().to(device)
    if cfg.train.compile:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0, betas=tuple(cfg.train.adam_betas),
                            fused=device.type == "cuda")
    batch = cfg.train.global_batch_size
    order = rank_train_indices(len(tokens.train), batch, cfg.train.seed, 0, 0, 1)
    per_epoch = len(order) // batch
    half = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16")
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            started = time.perf_counter()
        at = (step % per_epoch) * batch  # (a small corpus: its epochs again)
        ids = torch.from_numpy(tokens.train[order[at:at + batch]].astype(np.int64)).pin_memory().to(
            device, non_blocking=True) if device.type == "cuda" else torch.from_numpy(
            tokens.train[order[at:at + batch]].astype(np.int64))
        opt.zero_grad(set_to_none=True)
        with half:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
    _sync(device)
    rate = steps / (time.perf_counter() - started)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next behemoth run's worker needs the GPU's memory
    return rate


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with the sizes resolved (the user's --steps and --log-every win over a shape's defaults:
    the GPU kit sizes this step to its lending)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, help="steps per behemoth run, the first window warm-up (60; --tinyllama 160)")
    p.add_argument("--log-every", type=int, help="steps per report window (10; --tinyllama 20)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gpu", action="store_true", help="both on one GPU, in bf16")
    p.add_argument("--fast", action="store_true", help="the fast shape: --hidden 64 --batch 4 --threads 1 --steps 300")
    p.add_argument("--tinyllama", action="store_true", help="TinyLlama 1.1B's shape on one GPU, with floors")
    p.add_argument("--tiny", action="store_true", help="with --tinyllama: a dry run at a CPU's size")
    p.add_argument("--floor", type=float, help="exit 1 if the median ratio behemoth / plain is under it")
    args = p.parse_args(argv)
    if args.fast:
        args.hidden, args.batch, args.threads = 64, 4, 1
        args.steps = args.steps or 300
    if args.tinyllama:
        args.batch = 4 if args.tiny else 8
        args.steps = args.steps or (40 if args.tiny else 160)
        args.log_every = args.log_every or (10 if args.tiny else 20)
        args.gpu = not args.tiny
    args.steps, args.log_every = args.steps or 60, args.log_every or 10
    return args


def main() -> int:
    args = options()

    from behemoth.job import config_from_dict
    from behemoth.data.text.text_packing import prepare_text
    from behemoth.driver.ray_cluster.session import ensure_ray

    storage = Path(tempfile.mkdtemp(prefix="bench-p1-"))
    shape, seq_len, extra = None, 128, {}
    if args.tinyllama:
        # a larger corpus for 2048-token blocks (~1M tokens: ~500 blocks, a few epochs' worth at 8 per step)
        corpus = lm_corpus(REPO / "data" / "bench_text_large", train_documents=8000) if not args.tiny else lm_corpus()
        shape = TINYLLAMA_TINY if args.tiny else TINYLLAMA
        seq_len = 128 if args.tiny else 2048
        extra = {"train": {"compile": True, "adam_betas": [0.9, 0.95], "precision": "bf16"}}
    else:
        corpus = lm_corpus()

    def job(run):
        return lm_job(corpus, storage, run, hidden=args.hidden, batch=args.batch, steps=args.steps, seq_len=seq_len,
                      threads=args.threads, log_every=args.log_every, gpu=args.gpu, hf_config=shape, **extra)

    cfg = config_from_dict(job("plain"))
    ensure_ray()
    tokens = prepare_text(cfg.data, seed=cfg.train.seed)
    ours, plain, mfus, flops = [], [], [], None
    for r in range(args.repeats):
        reports = run_behemoth(job(f"p1_{r}"))
        ours.append(steady_steps_per_s(reports, args.batch))
        mfus += [m["mfu"] for m in reports if "mfu" in m][-1:]
        flops = next((m["model_tflops_per_sample"] for m in reports if "model_tflops_per_sample" in m), flops)
        plain.append(plain_steps_per_s(cfg, tokens, args.steps - args.log_every, args.log_every, args.threads))
        # the ratio the moment it exists (a step cut short by its time limit keeps it)
        print(f"repeat {r}: behemoth {ours[-1]:.3f} steps/s, plain loop {plain[-1]:.3f} steps/s, ratio "
              f"{ours[-1] / plain[-1]:.3f}", flush=True)
        shutil.rmtree(storage / f"p1_{r}", ignore_errors=True)  # (at 1.1B its final checkpoint is ~13 GB)
    shutil.rmtree(storage, ignore_errors=True)
    ratios = [o / b for o, b in zip(ours, plain)]
    what = (f"TinyLlama-1.1B shape{' (tiny: a dry run)' if args.tiny else ''}, seq {seq_len}, each layer compiled"
            if args.tinyllama else f"LM hidden {args.hidden}, 4 layers, seq {seq_len}")
    print(f"{what}, batch {args.batch}, {args.threads} torch threads, {'one GPU, bf16, ' if args.gpu else ''}"
          f"{args.steps - args.log_every} measured steps, {args.repeats} repeats alternating")
    tokens_per_step = args.batch * seq_len
    print(f"  behemoth (1 Ray Train worker): {spread(ours)} steps/s ({statistics.median(ours) * tokens_per_step:,.0f} tokens/s)")
    print(f"  plain PyTorch loop:            {spread(plain)} steps/s ({statistics.median(plain) * tokens_per_step:,.0f} tokens/s)")
    print(f"  ratio behemoth / plain: {spread(ratios)}")
    if mfus:
        print(f"  MFU {100 * statistics.median(mfus):.1f}% (behemoth's report; the model's {flops:.4g} TFLOP per sample)")
    if not args.tinyllama:
        if args.floor is not None:
            met = statistics.median(ratios) >= args.floor
            print(f"  floor: {'met' if met else 'FAILED'}: ratio {statistics.median(ratios):.3f} (>= {args.floor})")
            return 0 if met else 1
        return 0
    if args.tiny:
        print("  floors not checked: a dry run on a CPU at a toy size (MFU >= 40 %, ratio >= 0.97 on one GPU)")
        return 0
    failed = [f"MFU {100 * statistics.median(mfus or [0]):.1f}% < 40%"] if statistics.median(mfus or [0]) < 0.40 else []
    failed += [f"ratio {statistics.median(ratios):.3f} < 0.97"] if statistics.median(ratios) < 0.97 else []
    print(f"  floors: {'FAILED: ' + '; '.join(failed) if failed else 'MFU >= 40 % and ratio >= 0.97: met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
