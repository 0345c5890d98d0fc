"""Runs you can watch, on a real run: a 2-worker image job with TensorBoard and MLflow (a sqlite store) on,
a training worker SIGKILLed mid-run (Ray Train restarts the group from checkpoint 20 or 30), then the same
command again (the finished run is re-evaluated). Checked: TensorBoard's own reader finds every reported
curve at the right steps, each once; MLflow holds one run (params, metrics with steps, artifacts) that the
rerun continued; the goodput account's lost work is the time from the restored checkpoint to the kill, and
its terms add up to the measured wall time; the report's files are there."""

import json
import os
import signal
import time

import pytest
from behemoth.config import config_from_dict
from behemoth.driver.trainer import train
from behemoth.tracking.records import latest_per_step, read_jsonl
from behemoth.tracking.tensorboard import scalar_tags
from conftest import in_thread, job_dict, train_worker_pids

pytestmark = pytest.mark.integration
STEPS = 48  # 8 epochs of 6 steps: ~0.2 s a step here, time for the kill to land mid-run


def test_tracking_and_goodput_of_a_run_with_a_killed_worker(ray_local, image_root, tmp_path, capfd):
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = config_from_dict(job_dict(
        image_root, tmp_path, "watched", train={"epochs": 8, "log_every": 1},
        checkpoint={"every_n_steps": 10}, eval={"per_epoch": False, "every_n_steps": 12},
        failure={"max_failures": 1}, tracking={"report": True, "mlflow": {"uri": mlflow_uri, "experiment": "tests"}}))
    run = tmp_path / "watched"
    started = time.time()
    t, out = in_thread(lambda: train(cfg))
    deadline = time.time() + 300
    while not any(r.get("step", 0) >= 24 for r in read_jsonl(str(run / "metrics.jsonl"))):
        assert time.time() < deadline and t.is_alive(), out.get("error", "the run did not reach step 24")
        time.sleep(0.05)
    killed_at = time.time()
    os.kill(max(train_worker_pids()), signal.SIGKILL)
    t.join(timeout=400)
    wall = time.time() - started
    assert "error" not in out, out.get("error")
    summary = out["value"]
    assert summary.resumed_from_step in (20, 30) and summary.metrics["step"] == STEPS

    # Goodput: the lost work is the time from the restored checkpoint's report to the kill (+ the detection).
    acc = summary.goodput
    first, second = acc.groups
    restored = first.restored_by_next
    assert restored == summary.resumed_from_step
    reports = read_jsonl(str(run / "metrics.jsonl"))
    at_restored = next(r for r in reports if r["group_id"] == first.group_id and r["step"] == restored)
    truth = killed_at - at_restored["wall_time"]
    print(f"goodput {acc.line()}; lost {first.terms['lost']:.2f} s, kill - restored checkpoint's report "
          f"{truth:.2f} s; measured wall {wall:.1f} s")
    assert truth - 0.1 <= first.terms["lost"] <= truth + 1.5, (first.terms["lost"], truth)
    assert abs(sum(acc.terms.values()) - acc.total_s) < 1e-6
    assert acc.terms["unaccounted"] < 0.02 * acc.total_s  # the measured terms cover the wall time
    assert abs(acc.total_s - wall) < 0.02 * wall + 1.0, (acc.total_s, wall)  # + the thread's start and join
    assert second.terms["downtime"] > 0 and acc.terms["productive"] > 0
    assert json.loads((run / "goodput.json").read_text())["goodput"] == pytest.approx(acc.goodput)
    assert "goodput:" in "\n".join(summary.lines())

    # TensorBoard, read back with its own reader: every curve at the steps reported, each step once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    kept = latest_per_step([r for r in reports if r["step"] > r.get("resumed_from_step", 0)])
    expected: dict[str, dict[int, float]] = {}
    for r in kept:
        for tag, value in scalar_tags(r).items():
            expected.setdefault(tag, {})[r["step"]] = value
    assert {"train/loss", "val/accuracy", "speed/samples_per_s", "checkpoint/checkpoint_block_s"} <= set(expected)
    for tag, values in expected.items():
        seen = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in seen] == sorted(values), tag  # in order, no duplicates
        assert all(v == pytest.approx(values[s], rel=1e-6, abs=1e-7) for s, v in seen), tag
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert events.Scalars("goodput/fraction")[-1].value == pytest.approx(acc.goodput, rel=0.2)

    # The report.
    assert summary.report == str(run / "report" / "report.html") and os.path.isfile(summary.report)
    assert (run / "report" / "goodput.png").stat().st_size > 5000

    # The same command again: the finished run is re-evaluated, and continues the same MLflow run.
    run_id = json.loads((run / "mlflow.json").read_text())["run_id"]
    again = train(cfg)
    assert "nothing to train" in capfd.readouterr().out
    assert json.loads((run / "mlflow.json").read_text())["run_id"] == run_id
    assert len(again.goodput.invocations) == 2

    from behemoth.tracking import mlflow_run

    c = mlflow_run.client(mlflow_uri)
    runs = c.search_runs([c.get_experiment_by_name("tests").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["train.lr"] == "0.05" and runs[0].info.run_name == "watched"
    loss_steps = {m.step for m in c.get_metric_history(run_id, "train/loss")}
    assert loss_steps == set(range(1, STEPS + 1))  # redone steps were logged again (MLflow keeps both points)
    assert {m.step for m in c.get_metric_history(run_id, "val/accuracy")} == {12, 24, 36, 48}
    artifacts = {a.path for a in c.list_artifacts(run_id)}
    assert {"report", "manifest.json"} <= artifacts
