"""Records on an object store (issue 35): bytes and requests uploaded for a run's metrics.jsonl on the S3 test
server (moto's server, a versioned bucket: every PUT is kept, so what was uploaded is counted at the server).

- parts (behemoth now): JsonlLog buffers reports and PUTs one part object per flush (here every --every
  records, as a checkpoint flushes; in a run also every 10 s);
- rewrite (behemoth before): the whole file PUT again at every record, as JsonlLog did until then; run at
  --rewrite-records (default 1,000: the 10,000-record figure is O(n^2) bytes, printed computed from the
  same records).

Also printed: the longest and the total time append() blocked the writer (Ray Train's controller).

    .venv/bin/python bench/records_upload.py [--records 10000] [--every 200] [--rewrite-records 1000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _common import REPO

sys.path.insert(0, str(REPO / "tests"))


def record(i: int) -> dict:  # the size of one of the demo's reports (~440 bytes)
    return {"time": 1.8e9 + i, "invocation": "0123456789ab", "step": i, "epoch": i / 31, "loss": 1.0 / (i + 1),
            "lr": 0.05, "samples_per_s": 1234.5, "data_wait_frac": 0.01, "tflops_per_worker": 0.0153,
            "peak_mem_gb": 0.58, "world_size": 2, "group_id": "0123456789abcdef", "wall_time": 1.8e9 + i,
            "time_step_s": 0.05, "time_data_s": 0.001, "time_report_s": 0.002, "note": "x" * 60}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=10_000)
    p.add_argument("--every", type=int, default=200, help="records between flushes (checkpoints)")
    p.add_argument("--rewrite-records", type=int, default=1_000)
    args = p.parse_args()

    from behemoth.tracking.records import JsonlLog, read_jsonl, write_text
    from s3_server import moto_s3, object_versions

    def uploaded(endpoint: str, prefix: str) -> tuple[int, int]:
        versions = object_versions(endpoint, "bench", prefix)
        return sum(v["Size"] for v in versions), len(versions)

    with moto_s3("bench", versioned=True) as endpoint:
        log, waits = JsonlLog("s3://bench/parts/metrics.jsonl", flush_s=3600), []
        for i in range(args.records):
            t = time.perf_counter()
            log.append(record(i))
            if i % args.every == args.every - 1:
                log.flush()
            waits.append(time.perf_counter() - t)
        log.close()
        size = sum(len(json.dumps(record(i))) + 1 for i in range(args.records))
        assert len(read_jsonl("s3://bench/parts/metrics.jsonl")) == args.records
        sent, puts = uploaded(endpoint, "parts/")
        print(f"parts:   {args.records} records, log {size / 1e6:.2f} MB: uploaded {sent / 1e6:.2f} MB in {puts} "
              f"PUTs = {sent / size:.2f} x the log; append() blocked at most {max(waits) * 1e3:.1f} ms, "
              f"{sum(waits):.2f} s in all")

        text, waits = "", []
        for i in range(args.rewrite_records):
            t = time.perf_counter()
            text += json.dumps(record(i)) + "\n"
            write_text("s3://bench/rewrite/metrics.jsonl", text)
            waits.append(time.perf_counter() - t)
        sent, puts = uploaded(endpoint, "rewrite/")
        print(f"rewrite: {args.rewrite_records} records, log {len(text) / 1e6:.2f} MB: uploaded {sent / 1e6:.2f} MB "
              f"in {puts} PUTs = {sent / len(text):.0f} x the log; append() blocked at most "
              f"{max(waits) * 1e3:.1f} ms, {sum(waits):.2f} s in all")
        whole = sum(len(json.dumps(record(i))) + 1 for i in range(args.records))
        quadratic = sum((k + 1) * (len(json.dumps(record(k))) + 1) for k in range(args.records))  # ~ n^2/2 lines
        print(f"rewrite at {args.records} records (computed: each record PUTs the log so far): "
              f"{quadratic / 1e9:.2f} GB = {quadratic / whole:.0f} x the log")


if __name__ == "__main__":
    main()
