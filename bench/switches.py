"""Benchmark: what each speed switch does on this machine — step rate and loss against the fp32 DDP run.

The same LM job (2 Ray Train workers over gloo, 1 torch thread each, global batch 16) is trained once per
switch for --steps steps; the step rate is from behemoth's first report to its last, by rank 0's clock
(one continuous span, reports included; the steps before the first report, with torch.compile's
compilation, are warm-up), the loss is the mean training loss of the last window. The
order of the variants rotates each repeat. On 2 CPU cores with workers talking over loopback, this shows
what the switches cost or buy *here*; on GPUs with NCCL the balance is different (see BENCHMARKS.md).

    .venv/bin/python bench/switches.py [--repeats 1] [--steps 40] [--only fp32,bf16,...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import lm_corpus, lm_job, run_behemoth, spread, steady_steps_per_s

VARIANTS = {
    "fp32": {},
    "bf16 autocast": {"train": {"precision": "bf16"}},
    "accumulation x2": {"train": {"micro_batch_size": 4}},
    "fp16 compression": {"train": {"grad_compression": "fp16"}},
    "bf16 compression": {"train": {"grad_compression": "bf16"}},
    "powersgd rank 4": {"train": {"grad_compression": "powersgd", "powersgd_rank": 4, "powersgd_warmup_steps": 5}},
    "fsdp_grad_op": {"scaling": {"strategy": "fsdp_grad_op"}},
    "fsdp_full": {"scaling": {"strategy": "fsdp_full"}},
    "torch.compile": {"train": {"compile": True}},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = p.parse_args()
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    storage = Path(tempfile.mkdtemp(prefix="bench-switches-"))
    corpus = lm_corpus()
    rates, losses, waits = ({n: [] for n in names} for _ in range(3))
    for r in range(args.repeats):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            overrides = {k: dict(v) for k, v in VARIANTS[name].items()}
            job = lm_job(corpus, storage, f"sw_{r}_{i}", hidden=args.hidden, batch=16, steps=args.steps,
                         workers=2, threads=1, **overrides)
            reports = [m for m in run_behemoth(job) if "samples_per_s" in m]
            rates[name].append(steady_steps_per_s(reports, 16))
            losses[name].append(reports[-1]["loss"])
            waits[name].append(statistics.mean(m["data_wait_frac"] for m in reports[1:]))
            print(f"repeat {r} {name}: {rates[name][-1]:.3f} steps/s, loss {losses[name][-1]:.4f}", flush=True)
    print(f"LM hidden {args.hidden}, 4 layers, seq 128, 2 workers x 1 thread, global batch 16, {args.steps} steps, "
          f"{args.repeats} repeat(s); ratios are paired (each repeat's variant over that repeat's fp32 run)")
    print(f"  {'variant':18s} {'steps/s':>8s} {'vs fp32: median (min, max)':>40s} {'loss':>8s} {'vs fp32':>8s} "
          f"{'data-wait':>9s}")
    for n in names:
        rate, loss = statistics.median(rates[n]), statistics.median(losses[n])
        rel_rate = spread([v / b for v, b in zip(rates[n], rates["fp32"])]) if "fp32" in rates else "-"
        rel_loss = (f"{statistics.median((v - b) / b for v, b in zip(losses[n], losses['fp32'])):+.1%}"
                    if "fp32" in losses else "-")
        print(f"  {n:18s} {rate:8.3f} {rel_rate:>40s} {loss:8.4f} {rel_loss:>8s} {statistics.median(waits[n]):9.1%}")

if __name__ == "__main__":
    main()
