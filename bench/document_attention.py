"""Benchmark: attention over packed documents (data.document_mask, chat) without an L x L mask (issue 74 item 2).

A Llama-shaped model trains one step (forward and backward on a GPU; the forward alone on a CPU, where torch has
no FlexAttention backward) on --batch x --seq tokens packed with documents of random lengths (--doc tokens on
average), each variant in a process of its own, alternating, --repeats of each:
  causal: SDPA told is_causal, no documents (an unmasked step: the baseline the goal is set against);
  dense:  SDPA with the dense B x 1 x L x L boolean mask of the documents (what SDPA is handed without a block
          mask; on a CPU behemoth still trains this way);
  flex:   FlexAttention with the documents' block mask (tasks/causal_lm.document_block_mask; behemoth's default
          on a GPU), compiled by transformers on the first step (the first step's time is printed apart).
Figures: the median step time over --steps steps after a warm-up step, and the step's peak memory over what the
process held before it (resident memory; the kernel's peak reset before the measured step, so a compile's own
memory is not counted). The losses of the three agree where the documents are the same (dense and flex exactly,
causal not: it attends across documents).

    .venv/bin/python bench/document_attention.py [--seq 2048 8192] [--batch 1] [--hidden 256] [--layers 2]
    python bench/document_attention.py --device cuda --hidden 2048 --heads 32 --kv-heads 4 --layers 4  # (the kit)

On a GPU the step runs under bf16 autocast and its peak memory is the allocator's (torch.cuda.max_memory_allocated
over what was allocated before the step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # (Linux: "5" resets the peak resident set, VmHWM)
        f.write("5")


def one_side(args, seq: int) -> dict:
    """In the child: the model and the batch, a warm-up step (flex: its compile), the measured steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from behemoth.models.causal_lm import train_on_causal_attention
    from behemoth.tasks.causal_lm import CausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    implementation = "flex_attention" if args.side == "flex" else "sdpa"
    device = torch.device(args.device)
    heads = args.heads or max(args.hidden // 64, 1)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=args.kv_heads or heads, max_position_embeddings=seq,
                         attn_implementation=implementation)
    model = LlamaForCausalLM(config).to(device)
    if args.side == "causal":
        model = train_on_causal_attention(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(2, args.vocab, (args.batch, seq))
    gen = torch.Generator().manual_seed(1)
    starts = torch.rand(args.batch, seq, generator=gen) < 1.0 / args.doc  # a document begins here
    starts[:, 0] = False
    ids[:, :-1][starts[:, 1:]] = 1  # (an EOS before each start, as packed text has)
    ids, starts = ids.to(device), starts.to(device)
    labels = ids.masked_fill(starts, -100)
    cuda = device.type == "cuda"

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda), torch.set_grad_enabled(cuda):
            if args.side == "causal":
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            else:
                inputs = CausalLM.document_inputs(model, ids, starts, labels)
                loss = model(input_ids=ids, use_cache=False, **inputs).loss
        if cuda:  # (torch has no FlexAttention backward on a CPU: there every side takes the forward alone)
            loss.backward()
        return float(loss)  # (a host sync: each timed step is whole)

    t0 = time.perf_counter()
    step()  # (flex: transformers compiles FlexAttention here)
    first_s = time.perf_counter() - t0
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_bytes()
        reset_peak_rss()
    loss = step()
    peak = (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - before
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"side": args.side, "seq": seq, "peak_gb": peak / 1e9, "step_s": statistics.median(times),
            "first_step_s": first_s, "loss": loss, "documents": int(starts.sum()) + args.batch}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--doc", type=int, default=512, help="the documents' mean length in tokens")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: as many as heads)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast; the allocator's peak)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sides", default="causal,dense,flex")
    p.add_argument("--side", choices=["causal", "dense", "flex"], help=argparse.SUPPRESS)  # (the child's)
    args = p.parse_args()
    if args.side:
        print(json.dumps(one_side(args, args.seq[0])))
        return 0
    sides = args.sides.split(",")
    for seq in args.seq:
        results = {side: [] for side in sides}
        for r in range(args.repeats):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                env = {**os.environ,
                       "PYTHONPATH": f"{REPO / 'platform'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
                argv = [a for a in sys.argv[1:]]
                done = subprocess.run([sys.executable, __file__, *argv, "--seq", str(seq), "--side", side], env=env,
                                      check=True, capture_output=True, text=True)
                results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(results[side][-1]), flush=True)
        med = {side: {key: statistics.median(r[key] for r in runs) for key in ("peak_gb", "step_s", "first_step_s")}
               for side, runs in results.items()}
        print(f"seq {seq}, batch {args.batch}, documents of ~{args.doc} tokens, hidden {args.hidden}, "
              f"{args.layers} layers, {args.threads} threads, {args.repeats} repeats alternating")
        for side in sides:
            print(f"  {side:7s} step {med[side]['step_s']:.3f} s, the step's peak memory {med[side]['peak_gb']:.3f} GB, "
                  f"first step {med[side]['first_step_s']:.1f} s (loss {results[side][0]['loss']:.4f})")
        if "causal" in med:
            base = med["causal"]
            print("  against the unmasked step: " + ", ".join(
                f"{side} time {med[side]['step_s'] / base['step_s']:.2f}x, memory "
                f"{med[side]['peak_gb'] / max(base['peak_gb'], 1e-9):.2f}x" for side in sides if side != "causal"),
                flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
