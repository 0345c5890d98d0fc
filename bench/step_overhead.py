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

--fast: the fast shape (hidden 64, batch 4, one torch thread, 300 steps: a CPU step of ~20 ms, a GPU's step
time for a small model), where what a platform does around the step shows most: reports to Ray Train, the
all-reduce of the metrics, console lines. Floor: behemoth >= 0.97 of the plain loop (issue 55).

--gpu: both on one GPU in bf16 (behemoth's worker with nccl; the plain loop under torch.autocast), the GPU tier's
step-rate figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import device_of, lm_corpus, lm_job, run_behemoth, spread, steady_steps_per_s


def plain_steps_per_s(cfg, tokens, steps: int, warmup: int, threads: int) -> float:
    """The loop a user would write: same model, data order, optimizer and threads; no Ray."""
    import numpy as np
    import torch

    from behemoth.data.order import rank_train_indices
    from behemoth.tasks.causal_lm import CausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    device = device_of(cfg)
    model = CausalLM(cfg, tokens).build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
    batch = cfg.train.global_batch_size
    order = rank_train_indices(len(tokens.train), batch, cfg.train.seed, 0, 0, 1)
    half = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16")
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            started = time.perf_counter()
        ids = torch.from_numpy(tokens.train[order[step * batch:(step + 1) * batch]].astype(np.int64)).to(device)
        opt.zero_grad(set_to_none=True)
        with half:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    _sync(device)
    return steps / (time.perf_counter() - started)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="steps per behemoth run (the first window is warm-up)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gpu", action="store_true", help="both on one GPU, in bf16")
    p.add_argument("--fast", action="store_true", help="the fast shape: --hidden 64 --batch 4 --threads 1 --steps 300")
    args = p.parse_args()
    if args.fast:
        args.hidden, args.batch, args.threads, args.steps = 64, 4, 1, 300

    from behemoth.job import config_from_dict
    from behemoth.data.text import prepare_text
    from behemoth.driver.ray_session import ensure_ray

    storage = Path(tempfile.mkdtemp(prefix="bench-p1-"))
    corpus = lm_corpus()

    def job(run):
        return lm_job(corpus, storage, run, hidden=args.hidden, batch=args.batch, steps=args.steps,
                      threads=args.threads, log_every=args.log_every, gpu=args.gpu)

    cfg = config_from_dict(job("plain"))
    ensure_ray()
    tokens = prepare_text(cfg.data, seed=cfg.train.seed)
    ours, plain = [], []
    for r in range(args.repeats):
        ours.append(steady_steps_per_s(run_behemoth(job(f"p1_{r}")), args.batch))
        plain.append(plain_steps_per_s(cfg, tokens, args.steps - args.log_every, args.log_every, args.threads))
        print(f"repeat {r}: behemoth {ours[-1]:.3f} steps/s, plain loop {plain[-1]:.3f} steps/s", flush=True)
    ratios = [o / b for o, b in zip(ours, plain)]
    print(f"LM hidden {args.hidden}, 4 layers, seq 128, batch {args.batch}, {args.threads} torch threads, "
          f"{'one GPU, bf16, ' if args.gpu else ''}"
          f"{args.steps - args.log_every} measured steps, {args.repeats} repeats alternating")
    print(f"  behemoth (1 Ray Train worker): {spread(ours)} steps/s")
    print(f"  plain PyTorch loop:            {spread(plain)} steps/s")
    print(f"  ratio behemoth / plain: {spread(ratios)}")


if __name__ == "__main__":
    main()
