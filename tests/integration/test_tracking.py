"""Runs you can watch, on a real run: a 2-worker image job with TensorBoard and MLflow (a sqlite store) on,
rank 0 SIGKILLed after step 38 (behemoth/hosts/faults.py; Ray Train restarts the group from checkpoint 20), then the
same command again (the finished run is re-evaluated). Checked: TensorBoard's own reader finds every reported
curve at the right steps, each once; MLflow holds one run (params, metrics with steps, artifacts) that the
rerun continued; the goodput account's lost work is the wall-clock time steps 21-38 took (the sample ledger's
clock, not the phase counters the account subtracts), and its terms add up to the measured wall time; the
report's files are there."""

import json
import os
import time

import pytest
from behemoth.storage.checkpoint import complete_checkpoints
from behemoth.driver.ray_cluster import session as ray_session
from behemoth.driver.run.trainer import train
from behemoth.hosts.faults import KILL_AT_STEP_ENV
from behemoth.job import config_from_dict
from behemoth.tracking.records import latest_per_step, read_jsonl
from behemoth.tracking.tensorboard import scalar_tags
from conftest import job_dict
from integration.ledger_audit import read_ledger

pytestmark = pytest.mark.integration
# 8 epochs of 6 steps; checkpoints at 20 and 40, evaluations at 12, 24, 36, 48: steps 21-38 are thrown away
STEPS, KILLED_AFTER = 48, 38


def test_tracking_and_goodput_of_a_run_with_a_killed_worker(ray_local, image_root, tmp_path, capfd, monkeypatch):
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = config_from_dict(job_dict(
        image_root, tmp_path, "watched", train={"epochs": 8, "log_every": 1, "sample_ledger": str(tmp_path / "ledger")},
        checkpoint={"every_n_steps": 20}, eval={"per_epoch": False, "every_n_steps": 12},
        failure={"max_failures": 1}, tracking={"report": True, "mlflow": {"uri": mlflow_uri, "experiment": "tests"}}))
    run, marker = tmp_path / "watched", tmp_path / "killed.json"
    env = ray_session.worker_env_vars
    monkeypatch.setattr(ray_session, "worker_env_vars", lambda: {**env(), KILL_AT_STEP_ENV: f"watched:{KILLED_AFTER}:{marker}"})
    started = time.time()
    summary = train(cfg)
    wall = time.time() - started
    killed = json.loads(marker.read_text())
    assert summary.resumed_from_step == 20 and summary.metrics["step"] == STEPS

    # Goodput: the lost work is what the steps after 20 took (their compute and data-wait) up to the killed
    # group's last recorded report; the evaluations at 24 and 36, the checkpoint of 20, the reports and the
    # failure's detection are not lost work. The truth is the wall clock: rank 0's ledger records each step's
    # end, so those steps and the reports between them span from record 20 to the last report's record; the
    # reports' own time (evaluation, checkpoint, report phases) is taken off. (The account's lost work is made
    # of other counters: the step and data-wait phases.) The worker hands its reports to Ray Train in a thread,
    # at most one a second (worker/reporting.py): the logged steps it had not handed over yet die with
    # it, and the records hold every logged step up to the last one handed over.
    acc = summary.goodput
    first, second = acc.groups
    assert first.restored_by_next == summary.resumed_from_step == 20
    reports = read_jsonl(str(run / "metrics.jsonl"))
    at = {r["step"]: r for r in reports if r["group_id"] == first.group_id}
    last = max(at)
    assert 20 < last <= KILLED_AFTER and sorted(at) == list(range(1, last + 1))  # every logged step, up to it
    ended = {r["step"]: r["time"] for r in read_ledger(tmp_path / "ledger") if r["rank"] == 0 and r["pid"] == killed["pid"]}
    spent = sum(at[last][f"time_{phase}_s"] - at[20][f"time_{phase}_s"] for phase in ("eval", "checkpoint", "report"))
    truth = ended[last] - ended[20] - spent
    print(f"goodput {acc.line()}; lost {first.terms['lost']:.3f} s, steps 21-{last} took {truth:.3f} s by "
          f"the ledger's clock ({ended[last] - ended[20]:.3f} s less {spent:.3f} s of reports); measured wall "
          f"{wall:.1f} s")
    assert abs(first.terms["lost"] - truth) <= 0.1 * truth, (first.terms["lost"], truth)
    # the measured terms cover the wall time, none counted twice (unaccounted is the rest: negative where a phase
    # was counted twice)
    assert abs(acc.terms["unaccounted"]) < 0.02 * acc.total_s, acc.terms
    # the account ends when the run does; the report and MLflow's artifacts are written after it (goodput.json
    # first, as soon as the account is made)
    accounted = (run / "goodput.json").stat().st_mtime - started
    assert abs(acc.total_s - accounted) < 0.02 * accounted + 1.0 and acc.total_s < wall, (acc.total_s, accounted)
    assert second.terms["downtime"] > 0 and acc.terms["productive"] > 0
    assert json.loads((run / "goodput.json").read_text())["goodput"] == acc.goodput
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
    assert events.Scalars("goodput/fraction")[-1].value == pytest.approx(acc.goodput, rel=1e-6)  # the same account

    # The report.
    assert summary.report == str(run / "report" / "report.html") and os.path.isfile(summary.report)
    assert (run / "report" / "goodput.png").stat().st_size > 5000
    assert f"<td>total (wall time)</td><td>{acc.total_s:.2f}</td>" in open(summary.report).read()

    # The same command again: the finished run is re-evaluated, and continues the same MLflow run.
    run_id = json.loads((run / "mlflow.json").read_text())["run_id"]
    kept, reported = complete_checkpoints(run), len(reports)
    again = train(cfg)
    assert again.resumed_from_step == STEPS and again.metrics["step"] == STEPS
    new = read_jsonl(str(run / "metrics.jsonl"))[reported:]
    assert len(new) == 1 and new[0]["step"] == STEPS and "loss" not in new[0]  # one evaluation, no training step
    assert new[0]["val_loss"] == summary.metrics["val_loss"]  # the same weights, evaluated again
    assert complete_checkpoints(run) == kept  # no checkpoint written
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
    logged = min(c.get_metric_history(run_id, "goodput/fraction"), key=lambda m: m.timestamp)
    assert logged.value == acc.goodput  # the first invocation's account (the rerun's comes later)
    artifacts = {a.path for a in c.list_artifacts(run_id)}
    assert {"report", "manifest.json"} <= artifacts
