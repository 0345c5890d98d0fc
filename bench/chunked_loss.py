"""Benchmark: the causal LM's loss in chunks against transformers' loss over the whole logits (issue 74 item 3).

A Llama-shaped model with Llama 3's vocabulary (128,256 words) trains one step (forward and backward) on
--batch x --seq tokens, each variant in a process of its own, alternating, --repeats of each:
  dense:   transformers' own loss (the logits [batch, seq, vocab] made whole, upcast to fp32 for the loss);
  chunked: behemoth's (models/chunked_loss.py: the output projection and the cross-entropy over chunks of
           tokens, the gradients made chunk by chunk; what the workers train with);
  decoder: the same step without the output projection and its loss (the mean of the last hidden states): what
           the rest of the step holds, subtracted from both to give the loss's own peak.
Figures: the step's peak memory over what the process held before it (the model, its gradients' buffers and the
batch allocated first: the rest is the step's activations and the loss's tensors; peak resident memory, read
from the kernel), and the median step time over --steps steps after a warm-up. The loss of both is printed (they
agree within float rounding: tests/unit/test_chunked_loss.py).

    .venv/bin/python bench/chunked_loss.py [--vocab 128256] [--hidden 256] [--layers 2] [--batch 2] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_side(args) -> dict:
    """In the child: the model, one measured step's peak, then the timed steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from behemoth.models.chunked_loss import use_chunked_loss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                         max_position_embeddings=args.seq, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if args.side == "chunked":
        assert use_chunked_loss(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # (a trained model holds them: not the step's)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step() -> float:
        if args.side == "decoder":
            loss = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state.mean()
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return float(loss)

    before = rss_bytes()
    loss = step()  # the first step: its peak is the figure (the allocator's pools are empty before it)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"side": args.side, "peak_gb": peak / 1e9, "step_s": statistics.median(times), "loss": loss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--side", choices=["dense", "chunked", "decoder"], help=argparse.SUPPRESS)  # (the child's)
    args = p.parse_args()
    if args.side:
        print(json.dumps(one_side(args)))
        return 0
    results = {"dense": [], "chunked": [], "decoder": []}
    for r in range(args.repeats):
        for side in (["dense", "chunked", "decoder"] if r % 2 == 0 else ["decoder", "chunked", "dense"]):
            env = {**os.environ, "PYTHONPATH": f"{REPO / 'platform'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side], env=env, check=True,
                                  capture_output=True, text=True)
            results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[side][-1]), flush=True)
    med = {side: {key: statistics.median(r[key] for r in runs) for key in ("peak_gb", "step_s")}
           for side, runs in results.items()}
    logits_gb = args.batch * args.seq * args.vocab * 4 / 1e9
    print(f"vocabulary {args.vocab:,}, hidden {args.hidden}, {args.layers} layers, {args.batch} x {args.seq} tokens "
          f"(whole fp32 logits: {logits_gb:.2f} GB), {args.threads} threads, {args.repeats} repeats alternating")
    rest = med["decoder"]["peak_gb"]
    for side in ("dense", "chunked"):
        print(f"  {side:8s} step's peak memory {med[side]['peak_gb']:.2f} GB (the loss's own: "
              f"{med[side]['peak_gb'] - rest:.2f} GB), step {med[side]['step_s']:.3f} s (loss {results[side][0]['loss']:.4f})")
    print(f"  decoder alone: peak {rest:.2f} GB, step {med['decoder']['step_s']:.3f} s")
    print(f"  ratio chunked / dense: the loss's peak memory "
          f"{(med['chunked']['peak_gb'] - rest) / (med['dense']['peak_gb'] - rest):.3f}, the step's "
          f"{med['chunked']['peak_gb'] / med['dense']['peak_gb']:.3f}; step time "
          f"{med['chunked']['step_s'] / med['dense']['step_s']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
