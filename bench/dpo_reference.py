"""Benchmark: what DPO's reference costs a worker (issue 75), by data.reference: `copy` (a frozen copy of the
starting weights on the worker: what a plain DPO script holds, TRL's default without precomputation),
`precomputed` (behemoth's default for a full fine-tune: the reference's log-probabilities read from the table a
pass wrote before training) and `adapters_off` (LoRA: the same model with its adapters off). Each mode trains a
few DPO steps of a Llama-shaped model (~36 M parameters) with AdamW in a process of its own, on packed blocks of
a pair, and prints its peak resident memory, the model weights it holds and its step time.

    .venv/bin/python bench/dpo_reference.py [--steps 4] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(mode: str, args) -> dict:
    import resource
    import tempfile
    from types import SimpleNamespace

    import numpy as np
    import torch

    sys.path[:0] = [str(REPO / "platform"), str(REPO / "tests" / "unit")]
    from behemoth.job import config_from_dict
    from behemoth.tasks.preference import PreferenceLM
    from test_preference import _block as pair_block  # (a stored block of pairs, as the unit tests build them)

    torch.manual_seed(0)
    torch.set_num_threads(2)
    sizes = {"model_type": "llama", "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
             "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4,
             "max_position_embeddings": 512, "vocab_size": 8000}
    model_cfg = {"name": "causal_lm", "hf_config": sizes}
    if mode == "adapters_off":
        model_cfg["lora"] = {"r": 16}
    cfg = config_from_dict({"data": {"kind": "preference", "train_files": ["x.jsonl"], "val_fraction": 0.1,
                                     "tokenizer": "t", "seq_len": 512,
                                     "reference": "precomputed" if mode == "precomputed" else mode},
                            "model": model_cfg})
    index = SimpleNamespace(train=[0], val=[0], vocab_size=8000, eos_id=1, bos_id=None, stats={})
    task = PreferenceLM(cfg, index)
    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(8):  # 8 blocks of a pair each: a prompt of 150 tokens, replies of 40 and 60
        pairs = [(rng.integers(2, 8000, 150).tolist(), rng.integers(2, 8000, 40).tolist(),
                  rng.integers(2, 8000, 60).tolist())]
        blocks.append(pair_block(pairs, 512))
    batch = {"input_ids": torch.stack(blocks), "sample_id": torch.arange(8)}
    if mode == "precomputed":  # the table a pass would have written (its values do not matter here)
        folder = tempfile.mkdtemp()
        import hashlib
        import io
        data = io.BytesIO()
        np.savez(data, offsets=np.arange(0, 17, 2), logps=np.full(16, -50.0, np.float32))
        Path(folder, "train.npz").write_bytes(data.getvalue())
        index.stats["reference"] = {"folder": folder, "train": {"file": "train.npz",
                                                              "sha256": hashlib.sha256(data.getvalue()).hexdigest()}}
    model = task.build_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss, _ = task.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    if task._reference is not None:
        held += sum(p.numel() * p.element_size() for p in task._reference.parameters())
    steady = sorted(times[1:] or times)  # (the first step warms up)
    return {"mode": mode, "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "weights_held_mb": round(held / 2**20, 1), "step_s": round(steady[len(steady) // 2], 3),
            "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(one(args.mode, args)), flush=True)
        return
    out = {}
    for mode in ("copy", "precomputed", "adapters_off"):
        run = subprocess.run([sys.executable, __file__, "--mode", mode, "--steps", str(args.steps), "--hidden",
                              str(args.hidden), "--layers", str(args.layers)], capture_output=True, text=True,
                             check=True)
        out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps(out[mode]), flush=True)
    c, r = out["copy"], out["precomputed"]
    print(json.dumps({"precomputed_over_copy": {"peak_rss": round(r["peak_rss_gb"] / c["peak_rss_gb"], 3),
                                                "weights_held": round(r["weights_held_mb"] / c["weights_held_mb"], 3),
                                                "step_time": round(r["step_s"] / c["step_s"], 3)},
                      "adapters_off_over_copy": {
                          "peak_rss": round(out["adapters_off"]["peak_rss_gb"] / c["peak_rss_gb"], 3),
                          "step_time": round(out["adapters_off"]["step_s"] / c["step_s"], 3)}}), flush=True)


if __name__ == "__main__":
    main()
