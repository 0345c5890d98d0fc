"""The run's records, the goodput account, TensorBoard, MLflow and the report, on records written here (the
integration test tests/integration/test_tracking.py runs them under a real run with a killed worker)."""

import json
import os
import time
from pathlib import Path

import pytest
from behemoth.tracking import goodput
from behemoth.tracking.records import JsonlLog, latest_per_step, read_jsonl
from behemoth.tracking.tensorboard import TensorBoardLog, scalar_tags

T0 = 1_000_000.0


def report(inv, group, step, at, loop, resumed=0, workers=2, times=None):
    """A report as the worker sends it: the PhaseClock snapshot taken as the report began."""
    r = {"invocation": inv, "group_id": group, "step": step, "wall_time": at, "mark_started": loop - 3,
         "mark_loop_started": loop, "resumed_from_step": resumed, "world_size": workers, "loss": 1.0 / step,
         "lr": 0.1, "samples_per_s": 100.0, "data_wait_frac": 0.1, "total_steps": 40}
    r.update({f"time_{k}_s": (times or {}).get(k, 0.0) for k in ("step", "data_wait", "eval", "checkpoint", "report")})
    return r


def steady(inv, group, first, last, loop, start_time, resumed=0, step_s=0.5, wait_s=0.1):
    """Reports at every step from `first` to `last`: each step 0.5 s of compute and 0.1 s of data-wait."""
    out = []
    for i, step in enumerate(range(first, last + 1)):
        n = i + 1
        out.append(report(inv, group, step, start_time + n * (step_s + wait_s), loop, resumed,
                          times={"step": n * step_s, "data_wait": n * wait_s}))
    return out


def start(inv, at, process_start):
    return {"event": "invocation_start", "invocation": inv, "time": at,
            "marks": {"process_start": process_start, "invoked": process_start + 1,
                      "data_checked": process_start + 2, "ray_ready": process_start + 4,
                      "data_ready": process_start + 5, "fit_called": at}}


def end(inv, at, clock=None, status="finished"):
    return {"event": "invocation_end", "invocation": inv, "time": at, "status": status, "clock": clock}


def test_a_finished_run_adds_up_and_counts_its_phases():
    reports = steady("a", "g1", 1, 10, loop=T0 + 20, start_time=T0 + 20)  # last report at T0 + 26
    final = {**reports[-1], "wall_time": T0 + 27.0, "time_step_s": 5.5, "time_eval_s": 0.4}
    timeline = [start("a", T0 + 8, T0), end("a", T0 + 30, final)]
    acc = goodput.account(timeline, reports)
    assert acc.total_s == pytest.approx(30.0)
    assert sum(acc.terms.values()) == pytest.approx(acc.total_s)
    assert acc.terms["startup"] == pytest.approx(20.0)  # process start -> the first step
    assert acc.terms["productive"] == pytest.approx(5.5) and acc.terms["evaluation"] == pytest.approx(0.4)
    assert acc.terms["data_wait"] == pytest.approx(1.0) and acc.terms["lost"] == 0.0
    assert acc.terms["shutdown"] == pytest.approx(3.0)  # the group returned at +27, the invocation ended at +30
    assert acc.goodput == pytest.approx(5.5 / 30)
    assert acc.startup_detail == pytest.approx({"imports": 1, "data_check": 1, "ray": 2, "data_prepare": 1,
                                                "tracking": 3, "workers": 9, "model_and_restore": 3})
    assert "18.3% of 30.0 s" in acc.line()
    assert acc.startup_line() is None  # the reports carry no first-step mark
    for r in reports:
        r["mark_first_step"] = T0 + 20.7
    line = goodput.account(timeline, reports).startup_line()
    assert line.startswith("20.7 s from process start to the end of the first step (imports 1.0, data check 1.0,")


def test_a_worker_failure_loses_the_time_its_thrown_away_steps_took():
    """Lost work is the compute and data-wait of the steps after the restored checkpoint, not the wall time
    since its report: an evaluation, a checkpoint and the failure's detection in that stretch are not lost."""
    first = steady("a", "g1", 1, 25, loop=T0 + 20, start_time=T0 + 20)  # step 20 reported at T0 + 32
    for r in first[20:]:  # steps 21-25: an evaluation (1.5 s) and a checkpoint (0.5 s) ran after step 21
        r["wall_time"] += 2.0
        r.update(time_eval_s=1.5, time_checkpoint_s=0.5)
    failure = {"event": "failure", "invocation": "a", "time": T0 + 39.0, "decision": "RETRY"}  # 2 s after 25
    second = steady("a", "g2", 21, 40, loop=T0 + 50, start_time=T0 + 50, resumed=20)
    final = {**second[-1], "wall_time": second[-1]["wall_time"]}
    timeline = [start("a", T0 + 5, T0), failure, end("a", final["wall_time"] + 2, final)]
    acc = goodput.account(timeline, first + second)
    g1, g2 = acc.groups
    assert g1.restored_by_next == 20 and g2.restored_by_next is None
    assert g1.terms["lost"] == pytest.approx(5 * (0.5 + 0.1))  # steps 21-25, trained again by g2
    assert g1.terms["productive"] == pytest.approx(20 * 0.5) and g1.terms["data_wait"] == pytest.approx(20 * 0.1)
    assert g1.terms["evaluation"] == pytest.approx(1.5) and g1.terms["checkpoint"] == pytest.approx(0.5)
    assert g1.terms["downtime"] == pytest.approx(39.0 - 37.0)  # its last report -> the failure seen
    assert g1.terms["unaccounted"] == pytest.approx(0.0)
    assert g2.terms["downtime"] == pytest.approx(50.0 - 39.0)  # failure -> the next group's first step
    assert sum(acc.terms.values()) == pytest.approx(acc.total_s)
    assert acc.terms["productive"] == pytest.approx(40 * 0.5)  # every step once


def test_a_preemption_is_its_own_term_and_loses_no_work():
    """A group whose last report is a preemption's checkpoint (step 20) held until the deadline, then the next
    group resumed from it: the hold and the wait for the restart are `preemption`, not `downtime`, nothing is
    lost, and the line counts the preemption and its redone steps (none)."""
    first = steady("a", "g1", 1, 20, loop=T0 + 20, start_time=T0 + 20)  # step 20 reported at T0 + 32
    first[-1]["preemption_checkpoint"] = True
    failure = {"event": "failure", "invocation": "a", "time": T0 + 40.0, "decision": "RETRY"}  # the deadline
    second = steady("a", "g2", 21, 40, loop=T0 + 55, start_time=T0 + 55, resumed=20)
    final = {**second[-1]}
    timeline = [start("a", T0 + 5, T0), failure, end("a", final["wall_time"] + 2, final)]
    acc = goodput.account(timeline, first + second)
    g1, g2 = acc.groups
    assert g1.preempted and not g2.preempted and acc.preemptions == [g1]
    assert g1.terms["preemption"] == pytest.approx(40.0 - 32.0) and g1.terms["downtime"] == 0.0  # the hold
    assert g2.terms["preemption"] == pytest.approx(55.0 - 40.0) and g2.terms["downtime"] == 0.0  # the restart
    assert acc.terms["lost"] == 0.0 and sum(acc.terms.values()) == pytest.approx(acc.total_s)
    assert acc.line().endswith("; 1 preemption: 0 steps redone") and "preemption 23.0 s" in acc.line()


def test_a_killed_driver_and_its_rerun_are_summed():
    killed = steady("a", "g1", 1, 15, loop=T0 + 20, start_time=T0 + 20)  # the driver died after step 15
    rerun = steady("b", "g2", 11, 40, loop=T0 + 120, start_time=T0 + 120, resumed=10)
    timeline = [start("a", T0 + 5, T0), start("b", T0 + 105, T0 + 100),
                end("b", rerun[-1]["wall_time"] + 1, rerun[-1])]
    acc = goodput.account(timeline, killed + rerun)
    inv_a, inv_b = acc.invocations
    assert inv_a["total_s"] == pytest.approx(killed[-1]["wall_time"] - T0)  # ends at its last record
    assert "killed" in inv_a["status"]
    assert acc.groups[0].terms["lost"] == pytest.approx(killed[-1]["wall_time"] - killed[9]["wall_time"])
    assert acc.terms["startup"] == pytest.approx(20 + 20)  # each invocation's own start-up
    assert acc.total_s == pytest.approx(inv_a["total_s"] + inv_b["total_s"])  # not the gap between them
    assert sum(acc.terms.values()) == pytest.approx(acc.total_s)


def test_a_killed_drivers_resource_request_is_withdrawn_once():
    """Controllers of invocations without an end record died with their driver (driver/ray_cluster/stale_requests.py);
    a request a rerun has withdrawn is not withdrawn again."""
    from behemoth.driver.ray_cluster.stale_requests import requester_ids_of_killed_invocations

    def controller(inv, run_id):
        return {"time": T0, "event": "controller_start", "invocation": inv, "ray_train_run_id": run_id}

    timeline = [start("a", T0 + 5, T0), controller("a", "r1"), end("a", T0 + 60),  # finished
                start("b", T0 + 70, T0 + 65), controller("b", "r2"),  # killed
                start("c", T0 + 90, T0 + 85)]  # the rerun, before its controller starts
    assert requester_ids_of_killed_invocations(timeline) == ["train-r2"]
    timeline.append({"time": T0 + 91, "event": "requests_withdrawn", "invocation": "c", "requester_ids": ["train-r2"]})
    assert requester_ids_of_killed_invocations(timeline) == []
    acc = goodput.account(timeline, [])  # the new events change nothing in the account
    assert [i["invocation"] for i in acc.invocations] == ["a", "b", "c"]


def test_a_rerun_of_a_finished_run_loses_nothing():
    """The same command after the run finished: the rerun re-evaluates (a group that resumes at the last step);
    the finished group's tail (its last evaluation and checkpoint) is not lost work."""
    done = steady("a", "g1", 1, 10, loop=T0 + 20, start_time=T0 + 20)
    final = {**done[-1], "wall_time": T0 + 28.0, "time_step_s": 5.5, "time_eval_s": 1.5}
    again = {**report("b", "g2", 10, T0 + 120, T0 + 120, resumed=10), "time_step_s": 0.0}
    timeline = [start("a", T0 + 8, T0), end("a", T0 + 30, final), start("b", T0 + 105, T0 + 100),
                end("b", T0 + 125, {**again, "wall_time": T0 + 123})]
    acc = goodput.account(timeline, [*done, again])
    assert acc.groups[0].restored_by_next == 10 and acc.terms["lost"] == 0.0
    assert acc.terms["evaluation"] == pytest.approx(1.5) and acc.terms["productive"] == pytest.approx(5.5)
    assert sum(acc.terms.values()) == pytest.approx(acc.total_s) == pytest.approx(30 + 25)


def test_a_finished_runs_rerun_adds_its_evaluation_to_the_last_steps_record():
    """Rerunning a finished run evaluates its final weights and reports them at the last step, from a new group:
    that report replaced the step's record, and report.html said "steps 20 of None" and its curves lost their
    last point."""
    first = [{"step": s, "group_id": "a", "loss": 1.0 / s, "total_steps": 20, "lr": 0.1} for s in (10, 20)]
    rerun = {"step": 20, "group_id": "b", "resumed_from_step": 20, "val_loss": 0.5}
    kept = latest_per_step(first + [rerun])
    assert [r["step"] for r in kept] == [10, 20]
    assert kept[-1] == {**first[-1], **rerun}


def test_latest_per_step_keeps_the_surviving_record_of_each_step():
    first = steady("a", "g1", 1, 25, loop=T0, start_time=T0)
    second = steady("a", "g2", 21, 30, loop=T0 + 60, start_time=T0 + 60, resumed=20)
    kept = latest_per_step(first + second)
    assert [r["step"] for r in kept] == list(range(1, 31))
    assert {r["group_id"] for r in kept if r["step"] > 20} == {"g2"}


def test_records_go_through_pyarrow_for_a_uri(tmp_path):
    uri = f"file://{tmp_path}/run/metrics.jsonl"
    log = JsonlLog(uri)
    log.append({"step": 1})
    JsonlLog(uri).append({"step": 2})  # a second writer (a rerun) keeps what was there
    assert [r["step"] for r in read_jsonl(uri)] == [1, 2]
    (tmp_path / "run" / "metrics.jsonl").open("a").write('{"step": 3, "cut sho')  # a line a kill cut short
    assert [r["step"] for r in read_jsonl(uri)] == [1, 2]


@pytest.mark.parametrize("uri", [False, True])
def test_a_record_that_is_not_an_object_of_numbers_or_not_utf8_is_skipped_like_a_cut_line(tmp_path, uri):
    """Damaged lines (a bare number, a step written as text, bytes that are not UTF-8) are skipped as a line a
    kill cut short is, and the rest read: `behemoth report` draws the run (it crashed with a TypeError, or a
    UnicodeDecodeError before reading a line)."""
    from behemoth.tracking.records import METRICS, TIMELINE
    from behemoth.tracking.run_report import write_report

    run = tmp_path / "run"
    run.mkdir()
    good = steady("a", "g1", 1, 10, loop=T0 + 20, start_time=T0 + 20)
    damaged = [b"5", b'{"step": "3", "loss": 0.1}', b'{"step": 4, "wall_time": "soon"}', b'[{"step": 5}]',
               b'{"step": 6, "note": "\xff\xfe"}', b'{"event": "failure", "time": null}']
    lines = [json.dumps(r).encode() for r in good[:5]] + damaged + [json.dumps(r).encode() for r in good[5:]]
    (run / METRICS).write_bytes(b"\n".join(lines) + b"\n")
    (run / TIMELINE).write_bytes(json.dumps(start("a", T0 + 5, T0)).encode() + b"\n\xff" + b"\n" + damaged[-1])
    where = f"file://{run}" if uri else str(run)
    assert read_jsonl(f"{where}/{METRICS}") == good
    assert [e["event"] for e in read_jsonl(f"{where}/{TIMELINE}")] == ["invocation_start"]
    assert (run / "report" / "loss.png").exists() is False and write_report(where).endswith("report.html")
    assert (run / "report" / "loss.png").is_file()


@pytest.mark.parametrize("csv, says", [
    (b"", "results.csv cannot be read as a table (No columns to parse from file)"),
    (b"trial_id,val_accuracy,run_dir\nt0,0.5,/nowhere\n", "results.csv has no status column (it has: trial_id, "
                                                           "val_accuracy, run_dir)"),
    (b"trial_id,status,run_dir\nt0,fin\xffished,/nowhere\n", "results.csv cannot be read as a table ('utf-8'"),
])
def test_a_results_csv_that_cannot_be_read_is_one_line_naming_it(tmp_path, capsys, csv, says):
    from behemoth.driver.commands.cli import main

    (tmp_path / "results.csv").write_bytes(csv)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"behemoth: error: {tmp_path}/") and says in err and err.count("\n") == 1, err


def test_records_on_s3_upload_each_record_once(tmp_path):
    """On the S3 test server (a versioned bucket: every PUT is kept and counted), 10,000 reports written as a
    run writes them (buffered, flushed at every 200th as at a checkpoint) upload no more bytes than the log
    holds, in 50 part objects, and read back whole and in order. (Rewriting the whole file at every record
    uploaded O(n^2): ~2 GB for these 4.4 MB.)"""
    from s3_server import moto_s3, object_versions

    records = [{"step": i, "loss": 1.0 / (i + 1), "samples_per_s": 1234.5, "group_id": "g" * 12,
                "note": "x" * 380} for i in range(10_000)]
    with moto_s3("records", versioned=True) as endpoint:
        uri = "s3://records/run/metrics.jsonl"
        log = JsonlLog(uri, flush_s=3600)
        for i, r in enumerate(records):
            log.append(r)
            if i % 200 == 199:
                log.flush()
        log.close()
        assert read_jsonl(uri) == records
        size = sum(len(json.dumps(r)) + 1 for r in records)
        puts = object_versions(endpoint, "records", "run/")
    assert len([v for v in puts if v["Key"].endswith(".jsonl")]) == 50
    assert len(puts) <= 52  # and the folders' markers (empty), once
    assert sum(v["Size"] for v in puts) == size  # the bound is 2x


def test_a_quiet_uri_writer_is_stored_by_its_timer(tmp_path):
    """A buffered writer that stops writing (a killed controller loses what is buffered) has its records
    stored by its timer once they are due, without another record or a flush; a second writer's records read
    back after the first's. The writer's clock is the test's: the records are due when the test moves it past
    the interval (its timer thread looks every 0.1 s of real time), whatever the machine's speed."""
    now = [0.0]
    uri = f"file://{tmp_path}/run/metrics.jsonl"
    log = JsonlLog(uri, flush_s=0.1, clock=lambda: now[0])
    for step in (1, 2, 3):
        log.append({"step": step})
    time.sleep(0.3)  # the timer has looked (at least twice, but on a stalled machine): nothing is due yet
    assert read_jsonl(uri) == []  # buffered
    now[0] += 0.1
    deadline = time.monotonic() + 60  # a bound on a hang, not on speed: the timer looks every 0.1 s
    while read_jsonl(uri) == []:
        assert time.monotonic() < deadline, "the timer did not store the due records"
        time.sleep(0.05)
    assert [r["step"] for r in read_jsonl(uri)] == [1, 2, 3]
    JsonlLog(uri).append({"step": 4})  # unbuffered: stored at once
    log.append({"step": 5})
    log.close()
    assert [r["step"] for r in read_jsonl(uri)] == [1, 2, 3, 4, 5]


def test_scalar_tags_name_the_curves_and_skip_bookkeeping():
    tags = scalar_tags({"step": 3, "loss": 0.5, "val_accuracy": 0.9, "samples_per_s": 10, "mark_started": 1.0,
                        "time_step_s": 2.0, "group_id": "x", "peak_mem_gb": 1.5, "world_size": 2})
    assert tags == {"train/loss": 0.5, "val/accuracy": 0.9, "speed/samples_per_s": 10.0, "memory/peak_mem_gb": 1.5,
                    "cluster/world_size": 2.0}


@pytest.mark.parametrize("uri", [False, True])
def test_tensorboard_shows_each_step_once_after_a_restart(tmp_path, uri, monkeypatch):
    import tempfile

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    run_dir = f"file://{tmp_path}/run" if uri else str(tmp_path / "run")
    first = steady("a", "g1", 1, 25, loop=T0, start_time=T0)
    second = [{**r, "loss": 100.0 + r["step"]} for r in steady("a", "g2", 21, 30, loop=T0 + 60,
                                                                start_time=T0 + 60, resumed=20)]
    tb = TensorBoardLog(run_dir)
    for r in first:
        tb.log(r)
    tb.finish()  # the first invocation ends (its controller finishes or aborts)
    # TensorBoard reads a folder's event files in name order, and a name holds the second it was made in, then
    # the process and a per-process counter (not zero-padded): two writers of one process made in the same
    # second sort by counter as text, "10" before "9", and the restart's purge then hid its own steps (seen
    # when earlier tests of the session had made 9 writers). A real restart starts seconds later.
    time.sleep(1.01 - time.time() % 1)
    tb = TensorBoardLog(run_dir)  # the recorder of a rerun
    for r in second:
        tb.log(r, checkpoint=r["step"] == 30)
    assert os.path.isdir(tb.local)
    tb.finish()  # the run ends
    # under a URI the local copy (a temp folder) goes once the run folder has the files; a local run writes there
    assert os.path.isdir(tb.local) != uri
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in loss] == list(range(1, 31))  # no duplicates, no gaps
    assert dict(loss)[21] == pytest.approx(121.0) and dict(loss)[20] == pytest.approx(1 / 20)
    TensorBoardLog(run_dir).log_final(30, {"goodput/fraction": 0.5})  # the driver's scalars of the whole run
    assert os.listdir(tmp_path / "tmp") == []  # nothing left in the temp folder


def test_the_scalar_writer_writes_the_events_torchs_summary_writer_writes(tmp_path):
    """ScalarWriter (no torch import: it runs in Ray Train's controller) against torch.utils.tensorboard's
    SummaryWriter, the same calls: the same events, wall times aside, and the same file name but for its time."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    from behemoth.tracking.tensorboard import ScalarWriter

    def events(folder):
        (name,) = os.listdir(folder)
        read = list(EventFileLoader(str(folder / name)).Load())
        for event in read:
            event.wall_time = 0
        return name, [e.SerializeToString() for e in read]

    for purge_step in (None, 21):
        for kind, make in (("ours", ScalarWriter), ("torch", SummaryWriter)):
            with make(str(tmp_path / f"{kind}{purge_step}"), purge_step=purge_step) as writer:
                writer.add_scalar("train/loss", 0.25, 21, walltime=T0)
                writer.add_scalar("speed/samples_per_s", 1200, 22)
        (ours, mine), (theirs, torchs) = events(tmp_path / f"ours{purge_step}"), events(tmp_path / f"torch{purge_step}")
        assert mine == torchs and len(mine) == 3 + 2 * (purge_step is not None)
        assert ours.split(".")[:3] == theirs.split(".")[:3] == ["events", "out", "tfevents"]


def test_mlflow_run_is_continued_and_nested(tmp_path):
    from behemoth.tracking import mlflow_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = mlflow_run.client(uri)
    parent = c.create_run(mlflow_run.experiment_id_of(c, uri, "sweeps")).info.run_id
    run_dir = str(tmp_path / "run")
    run_id = mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1}, "model": {"name": "m"}}, parent)
    metrics = mlflow_run.MlflowMetrics(uri, run_id)
    for step in (1, 2, 3):
        metrics.log({"train/loss": 1.0 / step}, step, T0 + step)
    metrics.close()
    (tmp_path / "art.txt").write_text("hello")
    mlflow_run.finish(uri, run_id, "FINISHED", {"goodput/fraction": 0.5}, 3, artifacts=[str(tmp_path / "art.txt")])
    again = mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1}})  # a resume: the same run
    assert again == run_id
    run = c.get_run(run_id)
    assert run.data.params == {"train.lr": "0.1", "model.name": "m"}
    assert run.data.tags["mlflow.parentRunId"] == parent and run.info.run_name == "r1"
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, "train/loss")] == [(1, 1.0), (2, 0.5),
                                                                                      (3, pytest.approx(1 / 3))]
    assert [a.path for a in c.list_artifacts(run_id)] == ["art.txt"]
    # artifacts beside the database, not in ./mlruns of the current folder (MLflow's default for sqlite)
    assert run.info.artifact_uri.startswith(f"file://{tmp_path}/mlartifacts/exp/")
    assert (tmp_path / "mlartifacts" / "exp" / run_id / "artifacts" / "art.txt").is_file()


def test_a_run_folders_mlflow_run_deleted_since_is_replaced_by_a_new_one(tmp_path, capsys):
    """The run recorded in mlflow.json deleted in MLflow (or the store recreated at the same URI): every later
    rerun failed to reopen it and turned MLflow off for that run folder for good."""
    from behemoth.tracking import mlflow_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = str(tmp_path / "run")
    first = mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1}})
    mlflow_run.client(uri).delete_run(first)
    again = mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1}})
    assert again != first and mlflow_run.client(uri).get_run(again).info.status == "RUNNING"
    assert json.loads((tmp_path / "run" / mlflow_run.RUN_FILE).read_text())["run_id"] == again
    assert f"MLflow run {first} of " in capsys.readouterr().out
    assert mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1}}) == again  # and kept


def test_mlflow_to_a_folder(tmp_path):
    """tracking.mlflow.uri as a plain folder: MLflow's file store (which MLflow 3 allows only when asked)."""
    from behemoth.tracking import mlflow_run

    folder = str(tmp_path / "mlruns")
    run_id = mlflow_run.open_run(folder, "exp", str(tmp_path / "run"), "r1", {"train": {"lr": 0.1}})
    mlflow_run.finish(folder, run_id, "FINISHED", {"goodput/fraction": 0.25}, 7)
    run = mlflow_run.client(folder).get_run(run_id)
    assert run.data.metrics == {"goodput/fraction": 0.25} and run.info.status == "FINISHED"
    assert (tmp_path / "mlruns").is_dir()


def test_mlflow_down_warns_once_and_never_raises(capsys):
    from behemoth.tracking import mlflow_run

    metrics = mlflow_run.MlflowMetrics("http://127.0.0.1:9", "0" * 32)  # nothing listens on port 9
    for step in range(3):
        metrics.log({"train/loss": 1.0}, step, T0)
    metrics.close(timeout_s=60)
    out = capsys.readouterr().out
    assert out.count("MLflow tracking to http://127.0.0.1:9 failed") == 1 and metrics.failed


def test_run_report_files_and_goodput_table(tmp_path):
    from behemoth.tracking.records import METRICS, TIMELINE
    from behemoth.tracking.run_report import write_report

    run = tmp_path / "run"
    run.mkdir()
    first = steady("a", "g1", 1, 25, loop=T0 + 20, start_time=T0 + 20)
    second = steady("a", "g2", 21, 40, loop=T0 + 50, start_time=T0 + 50, resumed=20)
    for r in second[-5:]:
        r["val_loss"], r["val_accuracy"], r["val_samples"] = 0.3, 0.9, 500  # (an image task's count of samples)
    second[-1]["val_outputs"] = [{"prompt": "Who found the <key>?", "reply": "Ada did."}]  # (a chat run's replies)
    timeline = [start("a", T0 + 5, T0), {"event": "failure", "invocation": "a", "time": T0 + 36.0},
                end("a", second[-1]["wall_time"] + 2, second[-1])]
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in first + second))
    (run / TIMELINE).write_text("".join(json.dumps(e) + "\n" for e in timeline))
    page = write_report(str(run))
    acc = goodput.account(timeline, first + second)
    for name in ("loss", "validation", "lr", "throughput", "speed", "checkpoints", "world_size", "goodput"):
        png = run / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
    html = Path(page).read_text()
    assert html.count("data:image/png;base64,") == 8
    assert f"<td>lost</td><td>{acc.terms['lost']:.2f}</td>" in html
    assert f"<td>productive</td><td>{acc.terms['productive']:.2f}</td>" in html
    assert "final val_accuracy</td><td>0.9" in html
    assert "What the model says" in html and "Who found the &lt;key&gt;?" in html and "Ada did." in html


def test_a_preference_runs_report_plots_its_rewards_apart(tmp_path, monkeypatch):
    """A DPO run's records (TRL's names) get a rewards figure; its held-out rewards and log-probabilities stay out
    of the validation figure, whose scale they would flatten (logps near -20 beside accuracies near 1)."""
    from behemoth.tracking.records import METRICS, TIMELINE
    from behemoth.tracking.run_report import write_report

    run = tmp_path / "run"
    run.mkdir()
    rows = steady("a", "g1", 1, 20, loop=T0 + 20, start_time=T0 + 20)
    for i, r in enumerate(rows):
        r.update({"rewards/chosen": 0.01 * i, "rewards/rejected": -0.05 * i, "rewards/accuracies": 0.5 + 0.02 * i,
                  "rewards/margins": 0.06 * i, "logps/chosen": -3.0, "logps/rejected": -15.0 - i})
    for r in rows[9::10]:
        r.update({"val_loss": 0.6, "val_pairs": 40, "val_rewards/accuracies": 0.9, "val_rewards/margins": 0.4,
                  "val_logps/chosen": -3.1, "val_nll_loss": 0.5})
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / TIMELINE).write_text(json.dumps(start("a", T0 + 5, T0)) + "\n")
    write_report(str(run))
    png = run / "report" / "rewards.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    from behemoth.tracking import run_report

    seen = {}
    real = run_report._by_step
    monkeypatch.setattr(run_report, "_by_step", lambda plt, kept, restarts, title, ylabel, series, **kw: (
        seen.setdefault(title, [k for _, k, _ in series]), real(plt, kept, restarts, title, ylabel, series, **kw))[1])
    write_report(str(run))
    assert seen["Validation"] == ["val_nll_loss"]  # (val_pairs is a count; the rewards and logps have their figure)


def test_sweep_report(tmp_path):
    import pandas as pd
    from behemoth.tracking.run_report import write_report

    rows = []
    for i, (lr, status, value) in enumerate([(0.05, "finished", 0.95), (0.005, "finished", 0.7),
                                             (0.0005, "stopped early", 0.4)]):
        run = tmp_path / "runs" / f"t{i}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": e * 10, "epoch": e, "group_id": "g", "val_accuracy": value * e / 2}) + "\n" for e in (1, 2)))
        rows.append({"trial_id": f"t{i}", "status": status, "train.lr": lr, "lr": lr, "val_accuracy": value,
                     "epoch": 2, "step": 20, "best_checkpoint": "", "run_dir": str(run)})
    pd.DataFrame(rows).to_csv(tmp_path / "results.csv", index=False)
    page = write_report(str(tmp_path))
    assert (tmp_path / "report" / "val_accuracy_vs_train_lr.png").is_file()
    assert (tmp_path / "report" / "trials.png").is_file()
    html = Path(page).read_text()
    assert html.count("<tr>") == 4 and "stopped early" in html


def test_report_of_a_folder_that_is_neither_names_it(tmp_path):
    from behemoth.errors import ConfigError
    from behemoth.tracking.run_report import write_report

    with pytest.raises(ConfigError, match="neither a run folder"):
        write_report(str(tmp_path))


@pytest.mark.parametrize("uri", [False, True])
def test_the_end_of_a_run_shows_one_account_everywhere(tmp_path, uri):
    """The summary, goodput.json, the report's table and MLflow's goodput metrics are one account, made once
    after the invocation's end (an account made before the report was drawn differed from the final one by
    the seconds the report and MLflow took: 134.31 s in the report, 136.0 s in the summary). The report is an
    MLflow artifact, also of a run folder under a URI (file://, through the same pyarrow calls as s3://)."""
    from behemoth.job import config_from_dict
    from behemoth.tracking import mlflow_run
    from behemoth.tracking.records import METRICS
    from behemoth.tracking.invocation import GOODPUT, RunTracking
    from conftest import job_dict

    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = config_from_dict(job_dict(tmp_path / "images", tmp_path, "one", tracking={
        "report": True, "mlflow": {"uri": mlflow_uri, "experiment": "tests"}}))
    now = time.time()
    run_dir = f"file://{tmp_path}/one" if uri else str(tmp_path / "one")
    tracking = RunTracking(cfg, run_dir, process_start=now - 30)
    tracking.callbacks()  # the invocation's start (and its MLflow run), as just before fit
    reports = steady(tracking.invocation, "g1", 1, 10, loop=now - 20, start_time=now - 20)
    for r in reports:  # as the controller's recorder writes them
        JsonlLog(f"{run_dir}/{METRICS}").append(r)
    tracking.finish("finished", {**reports[-1], "wall_time": now - 13})
    acc = tracking.account
    saved = json.loads((tmp_path / "one" / GOODPUT).read_text())
    assert saved["total_s"] == acc.total_s and saved["terms_s"] == acc.terms and saved["goodput"] == acc.goodput
    html = (tmp_path / "one" / "report" / "report.html").read_text()
    assert f"<td>total (wall time)</td><td>{acc.total_s:.2f}</td>" in html
    assert f"<td>shutdown</td><td>{acc.terms['shutdown']:.2f}</td>" in html and acc.line() in html
    logged = mlflow_run.client(mlflow_uri).get_run(tracking.mlflow_run_id).data.metrics
    assert logged["goodput/fraction"] == acc.goodput and logged["goodput/shutdown_s"] == acc.terms["shutdown"]
    report = mlflow_run.client(mlflow_uri).list_artifacts(tracking.mlflow_run_id, "report")
    assert "report/report.html" in [a.path for a in report]


PROBE = '''
import json, subprocess, sys, time
from behemoth.tracking.invocation import process_start as _process_start

def test_probe():
    time.sleep(1.0)  # a process this Python starts later (it inherits run.sh's variable) dates from its own start
    child = subprocess.run([sys.executable, "-c", "from behemoth.tracking.invocation import process_start as p; "
                            "import time; print(p(), time.time())"], capture_output=True, text=True, check=True)
    with open(OUT, "w") as f:
        json.dump({"start": _process_start(), "now": time.time(), "child": child.stdout.split()}, f)
'''


def test_run_sh_counts_from_when_python_starts_not_its_install(tmp_path):
    """`./run.sh demo` installs, then execs Python: the process (and /proc's start time) is the shell's, so the
    install was counted as the run's imports (first step 104.1 s, imports 79.9). The account starts when Python
    does; run.sh reports the install once, on its own. The install here is a stand-in pip that takes 1.5 s, in a
    virtual environment whose python runs this one."""
    import subprocess

    from conftest import stand_in_venv

    venv = stand_in_venv(tmp_path, pip="sleep 0.5")
    out = tmp_path / "probe.json"
    (tmp_path / "test_probe.py").write_text(f"OUT = {str(out)!r}\n{PROBE}")
    repo = Path(__file__).resolve().parents[2]
    spawned = time.time()
    ran = subprocess.run([str(repo / "run.sh"), "test", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_probe.py")],
                         env={**os.environ, "BEHEMOTH_VENV": str(venv)}, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    probe = json.loads(out.read_text())
    assert spawned + 1.5 <= probe["start"] <= probe["now"] - 1.0, (spawned, probe)  # after the install
    child_start, child_now = map(float, probe["child"])
    assert probe["start"] + 1.0 <= child_start <= child_now  # the child's own start, not the inherited time
    installed = [line for line in ran.stdout.splitlines() if line.startswith("[run.sh] installed in ")]
    assert len(installed) == 1 and "not in a run's start-up or goodput" in installed[0], ran.stdout


def _wandb_records(folder: Path) -> list:
    """The protobuf records of W&B's offline run files under `folder` (its .wandb transaction logs: a 7-byte
    header, then LevelDB-style 32 KiB blocks of records, each with a 7-byte header of its own), oldest first."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, payload = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            payload, pos = payload + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = pb.Record()
                record.ParseFromString(payload)
                records.append(record)
                payload = b""
    return records


def test_wandb_gets_the_same_curves_as_mlflow_in_an_offline_run_resumed_by_id(tmp_path, monkeypatch):
    """tracking.wandb (issue 58), in W&B's offline mode (no network): the run's W&B id is kept in the run folder
    (a rerun continues the same W&B run), every report's curves are logged with their step under the names
    TensorBoard and MLflow use, a step trained again after a restart appears once in the run's history (W&B's
    steps only increase: the next test checks behemoth does not send it), and the job config is the run's
    config. The run's files are whole when the recorder's close returns, even where W&B's service has not yet
    acted on `finish()` (its stream closes, and writes the .wandb file, only then: CI, under load, once read a
    file without its history); here the service never hears the finish."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    from behemoth.job import config_from_dict
    from behemoth.tracking.callbacks import RunRecorder
    from behemoth.tracking.invocation import RunTracking

    job = {"data": {"kind": "image_folder", "root": str(tmp_path)}, "model": {"name": "regnet_tiny_cifar"},
           "train": {"lr": 0.07}, "tracking": {"wandb": {"project": "behemoth-test", "mode": "offline"}}}
    cfg = config_from_dict(job)
    run = tmp_path / "run"
    target = RunTracking(cfg, str(run))._wandb_target()
    assert target["id"] == json.loads((run / "wandb.json").read_text())["id"]
    assert RunTracking(cfg, str(run))._wandb_target()["id"] == target["id"]  # the rerun's: the same W&B run
    recorder = RunRecorder(str(run), "inv", tensorboard=False, wandb=target)
    for step in (1, 2, 3, 4, 3, 5):  # a restart from step 2's checkpoint trains 3 and 4 again
        report = {"step": step, "loss": 1.0 / step, "lr": 0.07, "grad_norm": 2.0 + step, "samples_per_s": 100.0}
        if step == 4:
            report["val_accuracy"] = 0.5
        recorder._record(report, checkpoint=False)
    monkeypatch.setattr(ServiceConnection, "inform_finish", lambda self, run_id: None)
    recorder.close()
    records = _wandb_records(run)
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5]
    assert history[2]["train/loss"] == pytest.approx(1 / 3) and history[2]["train/grad_norm"] == 5.0
    assert history[3]["val/accuracy"] == 0.5 and history[4]["speed/samples_per_s"] == 100.0
    (opened,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert opened.run_id == target["id"] and opened.project == "behemoth-test"
    config = {u.key: json.loads(u.value_json) for u in opened.config.update}
    assert config["train"]["lr"] == 0.07


def test_wandb_keys_are_checked_before_ray(tmp_path):
    from behemoth.errors import ConfigError
    from behemoth.job import config_from_dict

    job = {"data": {"kind": "image_folder", "root": str(tmp_path)}, "model": {"name": "regnet_tiny_cifar"}}
    for wandb, message in (({"project": " "}, "tracking.wandb.project is empty"),
                           ({"mode": "disabled"}, r"tracking.wandb.mode must be one of \['online', 'offline'\]"),
                           ({"entity": "team"}, "tracking.wandb.entity is set without tracking.wandb.project")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**job, "tracking": {"wandb": wandb}})


def test_wandb_metrics_hand_wandb_no_step_twice():
    """WandbMetrics itself leaves out a step at or below the last one it logged (W&B would drop it anyway, with
    a warning per retrained step): the offline test above sees the same history either way, this one the call."""
    from behemoth.tracking.wandb_run import WandbMetrics

    logged = []
    metrics = WandbMetrics({})
    metrics.run = type("Run", (), {"log": lambda self, values, step: logged.append(step)})()
    for step in (1, 2, 3, 4, 3, 4, 5):
        metrics.log({"train/loss": 1.0}, step)
    assert logged == [1, 2, 3, 4, 5]


def test_a_uris_password_never_reaches_a_tracker_or_the_report(tmp_path):
    """A password in a URI the job names (pyarrow's s3://KEY:SECRET@bucket, MLflow's postgresql://user:PASSWORD@
    host) went into MLflow's params, W&B's config and report.html's run folder as written."""
    from behemoth.job import config_from_dict
    from behemoth.storage.paths import redacted
    from behemoth.tracking import mlflow_run
    from behemoth.tracking.invocation import RunTracking
    from behemoth.tracking.run_report import _run_summary

    secret = "s3://AKIAEXAMPLE:wJalr/SECRETKEY@bucket/images"
    assert redacted(secret) == "s3://AKIAEXAMPLE:***@bucket/images"
    assert redacted("postgresql://mlf:Pa55w0rd@db/mlflow") == "postgresql://mlf:***@db/mlflow"
    assert redacted({"a": [secret, "s3://bucket/x", "http://host:5000/p"]}) == {
        "a": ["s3://AKIAEXAMPLE:***@bucket/images", "s3://bucket/x", "http://host:5000/p"]}
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = config_from_dict({"data": {"kind": "image_folder", "root": secret}, "model": {"name": "regnet_tiny_cifar"},
                            "tracking": {"mlflow": {"uri": uri}, "wandb": {"project": "p", "mode": "offline"}}})
    tracking = RunTracking(cfg, str(tmp_path / "run"))
    tracking.callbacks()
    params = mlflow_run.client(uri).get_run(tracking.mlflow_run_id).data.params
    assert params["data.root"] == "s3://AKIAEXAMPLE:***@bucket/images"
    assert tracking._wandb_target()["config"]["data"]["root"] == "s3://AKIAEXAMPLE:***@bucket/images"
    assert "SECRETKEY" not in _run_summary("s3://K:SECRETKEY@bucket/run", [], None)


@pytest.mark.parametrize("error, failure, status", [(KeyboardInterrupt(), None, "KILLED"),
                                                    (SystemExit(0), None, "KILLED"),
                                                    (RuntimeError("restarts used up"), RuntimeError, "FAILED")])
def test_an_invocation_that_ends_without_an_end_of_its_own_is_killed_in_mlflow_not_left_running(
        tmp_path, error, failure, status):
    """Ctrl-C in the driver, or a sweep's trial the scheduler stopped (SystemExit in its lane): the invocation
    writes no end record, and its MLflow run stayed RUNNING for good (a sweep's stopped trials shown running
    under a finished parent)."""
    import contextlib

    from behemoth.driver.run.sequence import run_sequence
    from behemoth.job import config_from_dict
    from behemoth.tracking import mlflow_run
    from behemoth.tracking.invocation import RunTracking
    from conftest import job_dict

    class Launcher:  # (Ray Train's or a lane's, up to the launch)
        def prepare(self, run, mark):
            return None

        def launch(self, run, data):
            tracking.callbacks()
            raise error

        def records_failure(self, e):
            return failure is not None and isinstance(e, failure)

        @contextlib.contextmanager
        def ending(self):
            yield

    (tmp_path / "images").mkdir()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = config_from_dict(job_dict(tmp_path / "images", tmp_path / "runs", "r",
                                    tracking={"mlflow": {"uri": uri, "experiment": "e"}}))
    tracking = RunTracking(cfg, str(tmp_path / "runs" / "r"))
    with pytest.raises(type(error)):
        run_sequence(cfg, Launcher(), tracking)
    assert mlflow_run.client(uri).get_run(tracking.mlflow_run_id).info.status == status


@pytest.mark.parametrize("result_error, aborted, exit_code", [(None, False, 0), (RuntimeError("x"), False, 1),
                                                              (None, True, 1)])
def test_a_failed_or_aborted_run_ends_its_wandb_run_failed(monkeypatch, result_error, aborted, exit_code):
    """W&B's run was finished with no exit code whatever the controller's result: a run whose restarts were used
    up showed as finished in W&B and as failed in MLflow."""
    from types import SimpleNamespace

    from behemoth.tracking import wandb_run
    from behemoth.tracking.callbacks import RunRecorder

    monkeypatch.setattr(wandb_run, "_wait_for_the_files", lambda: None)
    finished = []
    recorder = RunRecorder.__new__(RunRecorder)
    recorder._metrics = recorder._tb = recorder._mlflow = None
    recorder._warned = set()
    recorder._wandb = wandb_run.WandbMetrics({})
    recorder._wandb.run = SimpleNamespace(finish=lambda exit_code=None: finished.append(exit_code))
    if aborted:
        recorder.before_controller_abort()
    else:
        recorder.after_controller_finish(SimpleNamespace(error=result_error))
    assert finished == [exit_code]


def test_a_rerun_with_a_changed_config_says_so_in_its_mlflow_run(tmp_path):
    """A rerun that changes train.lr (from the step it resumes at) continued its MLflow run with the first
    invocation's params alone: the run's page said lr 0.1 for a run that trained on at 0.05. MLflow refuses a
    param's second value: the change is the tag rerun.train.lr (gone when a later rerun goes back to 0.1); a key
    new to the run is logged as a param."""
    from behemoth.tracking import mlflow_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = str(tmp_path / "run")
    run_id = mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1, "epochs": 4}})
    c = mlflow_run.client(uri)
    assert mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.05, "epochs": 4, "max_steps": 9}}) \
        == run_id
    run = c.get_run(run_id)
    assert run.data.params == {"train.lr": "0.1", "train.epochs": "4", "train.max_steps": "9"}
    assert {k: v for k, v in run.data.tags.items() if k.startswith("rerun.")} == {"rerun.train.lr": "0.05"}
    mlflow_run.open_run(uri, "exp", run_dir, "r1", {"train": {"lr": 0.1, "epochs": 4, "max_steps": 9}})
    assert not [k for k in c.get_run(run_id).data.tags if k.startswith("rerun.")]
