"""Benchmark: where a checkpoint's CPU goes at the preemption storm's shape (issue 73). On a worker that trains on its
CPU the background write's CPU seconds are taken from training, and checkpoint.hold_budget charges them: at the
storm's 3 MB state they are most of a checkpoint's price. Times, in one process (thread CPU time, median over
`--rounds`), the snapshot to host memory (reused buffers) and `storage.checkpoint.write` of the storm's model (a
2-layer Llama-style LM of width 64, AdamW state, its tokenizer kept), and the write's parts: torch.save of each
state file, the sha256 of every file, the rest (texts, folders, manifest).

    .venv/bin/python bench/checkpoint_write.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))
sys.path.insert(0, str(REPO / "bench"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()

    import torch
    from _common import lm_corpus, lm_job
    from behemoth.checkpoints import live_state
    from behemoth.config.load import dump_yaml
    from behemoth.job import config_from_dict
    from behemoth.storage import checkpoint
    from behemoth.storage.train_state import TrainState
    from behemoth.tasks.causal_lm import build_lm

    torch.set_num_threads(1)
    corpus, work = lm_corpus(), Path(tempfile.mkdtemp(prefix="bench-ckpt-write-"))
    cfg = config_from_dict(lm_job(corpus, work, "w", hidden=64, layers=2, batch=16, steps=10, workers=2, threads=1))
    model = build_lm(cfg, 1024, 0, None, train=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (4, 128))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    kept = {f"tokenizer/{f.name}": f.read_bytes() for f in (corpus / "tokenizer").iterdir()}
    buffers, job_yaml = {}, dump_yaml(cfg)  # (the saver dumps the job once per run)
    times: dict[str, list[float]] = {}

    def timed(name: str, fn):
        began = time.thread_time()
        out = fn()
        times.setdefault(name, []).append(time.thread_time() - began)
        return out

    for r in range(args.rounds + 2):  # (the first two rounds warm the caches and fill the buffers)
        snap = timed("snapshot", lambda: live_state.snapshot(
            model=model, optimizer=opt, scheduler=sched, state=TrainState(step=r), task_files=kept,
            job_yaml=job_yaml, buffers=buffers))
        folder = timed("write", lambda: checkpoint.write(work / f"c{r}", snap))
        for name, sd in snap.state_dicts.items():
            with open(work / f"c{r}" / f"again-{name}", "wb") as f:
                timed(f"torch.save {name}", lambda: torch.save(sd, f))
        names = [*snap.state_dicts, *snap.texts]
        timed("sha256 of the files", lambda: [hashlib.sha256((folder / n).read_bytes()) for n in names])
    ms = {name: round(1000 * statistics.median(t[2:]), 2) for name, t in times.items()}
    saves = sum(v for k, v in ms.items() if k.startswith("torch.save"))
    ms["write: the rest (texts, folders, manifest)"] = round(ms["write"] - saves - ms["sha256 of the files"], 2)
    size = sum(f.stat().st_size for f in (work / "c2").iterdir() if f.is_file() and not f.name.startswith("again"))
    print(json.dumps({"state_mb": round(size / 1e6, 2), "cpu_ms": ms, "rounds": args.rounds}, indent=1))


if __name__ == "__main__":
    main()
