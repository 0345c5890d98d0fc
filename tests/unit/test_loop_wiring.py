"""The worker loop's wiring, in the quick tier and without Ray (issue 65): the loop (worker/loop.py
train_loop_per_worker) runs whole, in this process, under a lane's host (hosts/lane.py, as a sweep's warm lane
runs it), on the full tier's task of one's own (linear regression on generated rows), 8 steps a run. The helpers each
have their own tests; these catch the loop not calling them: evaluation on the weight average (train.ema_decay),
fp32 parameters whatever dtype the task builds in, early stopping ending the loop, a non-finite step stopping
it. (The full tier runs the same through Ray Train: tests/integration/test_train_images.py.)"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from behemoth import Callback, hosts
from conftest import job_dict
from integration.toy_task import TRAIN, LinearRegression, ToyData


class Regression(LinearRegression):
    """The full tier's task of one's own (linear regression on generated rows), its batches on the host's
    device instead of Ray Train's, its model built in bfloat16 (as from_pretrained keeps a stored dtype)."""

    def build_model(self):
        return torch.nn.Linear(self.cfg.data.features, 1).to(torch.bfloat16)

    def _batches(self, offset, indices, batch_size):
        for start in range(0, len(indices), batch_size):
            ids = np.asarray(indices[start:start + batch_size], dtype=np.int64)
            yield {"x": torch.from_numpy(self.data["x"][offset + ids]),
                   "y": torch.from_numpy(self.data["y"][offset + ids]), "sample_id": torch.from_numpy(ids)}

    def example_batch(self, batch_size):
        return {"x": torch.zeros(batch_size, self.cfg.data.features), "y": torch.zeros(batch_size)}


KEPT = {"tokenizer/tokenizer.model": bytes(range(256)), "tokenizer/chat_template.jinja": b"{{ messages }}\n"}


class Keeping(Regression):
    """A task that keeps files for the export (bytes, in a folder; one of them a checkpoint file too)."""

    @classmethod
    def checkpoint_files(cls, cfg, prepared):
        return {"tokenizer/chat_template.jinja": "{{ messages }}\n"}

    @classmethod
    def kept_files(cls, cfg, prepared):
        return KEPT


def _run(tmp_path, monkeypatch, task: str = "Regression", **sections):
    """The loop, whole, under a lane's host on the CPU: (what it returned, every report, the run folder)."""
    from behemoth.checkpoints.retention import kept_indices
    from behemoth.driver.run.resume import run_place
    from behemoth.hosts import lane
    from behemoth.job import config_from_dict
    from behemoth.worker.loop import train_loop_per_worker

    job = job_dict(tmp_path, tmp_path / "runs", data={}, scaling={"num_workers": 1},
                   train={"epochs": 1, "global_batch_size": 64, "lr": 0.05, "log_every": 2},
                   checkpoint={"every_n_steps": 4, "async_save": False}, eval={"per_epoch": True})
    job["data"] = {"kind": f"unit.test_loop_wiring:{task}"}
    for section, values in sections.items():
        job[section].update(values)
    cfg = config_from_dict(job)
    reports = []
    recorder = SimpleNamespace(after_report=lambda _, metrics: reports.extend(metrics))
    monkeypatch.setattr(lane, "_lane_device", lambda: torch.device("cpu"))  # (not Ray's GPU ids: no Ray here)
    kept = functools.partial(kept_indices, keep=cfg.checkpoint.keep, order="min")  # (the task's val_mse)
    host = lane.LaneHost(run_place(cfg), kept, recorder, None, None)
    try:
        with hosts.hosted(host):
            returned = train_loop_per_worker({"job": cfg, "data": Regression.check(cfg), "fence": None})
            host.drain()
    finally:
        host.close()
    return returned, reports, tmp_path / "runs" / "t"


def _val_mse(weights: dict) -> float:
    data = Regression.check(SimpleNamespace(data=ToyData(), train=SimpleNamespace(seed=0)))
    x, y = torch.from_numpy(data["x"][TRAIN:]), torch.from_numpy(data["y"][TRAIN:])
    return float(((x @ weights["weight"].float().T + weights["bias"].float()).squeeze(1) - y).pow(2).mean())


def test_the_loop_evaluates_the_weight_average_and_trains_fp32_parameters(tmp_path, monkeypatch):
    """train.ema_decay: the reported val_mse is the weight average's (ema.pt), not the trained weights'
    (model.pt); the parameters and optimizer state are fp32 though the task builds its model in bfloat16."""
    from behemoth.storage.checkpoint import complete_checkpoints

    returned, reports, run = _run(tmp_path, monkeypatch, train={"ema_decay": 0.5})
    assert returned["final_step"] == 8
    (step, latest), *_ = complete_checkpoints(run)
    model = torch.load(f"{latest}/model.pt", weights_only=True)
    ema = torch.load(f"{latest}/ema.pt", weights_only=True)
    assert step == 8 and {v.dtype for v in model.values()} == {torch.float32}
    optim = torch.load(f"{latest}/optimizer.pt", weights_only=True)
    assert {s.dtype for state in optim["state"].values() for s in state.values() if s.is_floating_point()} == {
        torch.float32}
    reported = [r["val_mse"] for r in reports if r.get("step") == 8 and "val_mse" in r]
    assert reported and reported[-1] == pytest.approx(_val_mse(ema), rel=1e-5)
    assert abs(_val_mse(ema) - _val_mse(model)) > 1e-3 * _val_mse(model)  # (the two differ: the check can fail)


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_every_checkpoint_keeps_the_tasks_kept_files_checked_by_its_manifest(tmp_path, monkeypatch, layout):
    """Task.kept_files (a language model's tokenizer: what export and generate read, issue 72) reach every
    checkpoint the loop writes, as bytes, in their folder, each listed in the manifest, in either layout."""
    from behemoth.storage.checkpoint import complete_checkpoints, read_verified

    _run(tmp_path, monkeypatch, task="Keeping", checkpoint={"format": layout})
    written = complete_checkpoints(tmp_path / "runs" / "t")
    assert len(written) == 2
    for _, ckpt in written:
        assert {name: read_verified(ckpt, name) for name in KEPT} == KEPT


def test_early_stopping_ends_the_loop_at_its_patience_and_a_rerun_without_it_trains_on(tmp_path, monkeypatch, capsys):
    """val_mse cannot improve by more than min_delta 1e6: evaluated every 2 steps, the run stops at step 4 of
    8, checkpointed there with the decision. A rerun with the same rule trains nothing and says how to go on;
    one with early stopping off trains on to step 8 (issue 65)."""
    from behemoth.storage.checkpoint import complete_checkpoints, read_state

    rule = {"early_stopping": {"patience": 1, "min_delta": 1e6}}
    evaluations = {"per_epoch": True, "every_n_steps": 2}
    returned, reports, run = _run(tmp_path, monkeypatch, train=rule, eval=evaluations)
    assert returned["final_step"] == 4 and max(r["step"] for r in reports) == 4
    (step, latest), *_ = complete_checkpoints(run)
    assert step == 4 and read_state(latest).stopped_early_at == 4
    capsys.readouterr()
    again, _, _ = _run(tmp_path, monkeypatch, train=rule, eval=evaluations)
    assert again == {**again, "resumed_from_step": 4, "final_step": 4}
    assert "nothing to train. To train on from here: --set train.early_stopping=null" in capsys.readouterr().out
    on, reports, _ = _run(tmp_path, monkeypatch, eval=evaluations)
    assert on == {**on, "resumed_from_step": 4, "final_step": 8} and max(r["step"] for r in reports) == 8
    assert "early stopping is off now: it trains on from step 4" in capsys.readouterr().out


def test_a_non_finite_step_stops_the_loop_naming_it(tmp_path, monkeypatch):
    """train.nonfinite stop (the default): the first training row's target is NaN; the loop ends at the report
    after the step that trained on it, with one error naming the step."""
    from behemoth.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match=r"step \d+"):
        _run(tmp_path, monkeypatch, data={"nan_rows": 1})


class Slow(Regression):
    """Steps of ~20 ms (the toy's take microseconds): a notice's seconds span many steps."""

    def loss(self, model, batch):
        import time

        time.sleep(0.02)
        return super().loss(model, batch)


def _noticed(monkeypatch, at_step: int, ahead_s: float):
    """The lane's host gives a preemption notice `ahead_s` seconds ahead (inf: no deadline) from the first
    report at or after `at_step` (Ray Train's watcher tells the workers as this does: on every later ask)."""
    import time

    from behemoth.hosts import lane

    seen = {}

    def deadline(self):
        step = max([r.get("step", 0) for r in seen.get("reports", [])], default=0)
        if "at" not in seen and step >= at_step:
            seen["at"] = time.time() + ahead_s
        return seen.get("at")

    monkeypatch.setattr(lane.LaneHost, "preemption_deadline", deadline)
    return seen


@pytest.mark.parametrize("ahead_s", [3.0, 365 * 86400.0, float("inf")])
def test_a_preemption_notice_is_trained_through_to_a_last_checkpoint_before_its_deadline(
        tmp_path, monkeypatch, capsys, ahead_s):
    """Issue 73 item 5: the loop no longer holds through the notice. At the notice it checkpoints at once and
    trains on; the last checkpoint goes just before the deadline, the group waits for the node to go (Ray Train
    ends it failure.preemption_grace_s after the deadline, so that the next one is placed on the nodes left) and
    otherwise ends itself then (PreemptionExit: a preemption to Ray Train's failure policy). A deadline a year ahead (a wrong clock:
    issue 72 item 3 held the loop for that year) never stalls it: the run trains to its end. No deadline: the
    group ends right after its checkpoint."""
    import time

    from behemoth.errors import PreemptionExit
    from behemoth.storage.checkpoint import complete_checkpoints

    seen = _noticed(monkeypatch, at_step=6, ahead_s=ahead_s)
    from behemoth.hosts import lane

    real = lane.LaneHost.report

    def report(self, metrics, checkpoint=None, **kw):  # (the host's reports: what the notice keys on)
        seen.setdefault("reports", []).append(metrics)
        return real(self, metrics, checkpoint, **kw)

    monkeypatch.setattr(lane.LaneHost, "report", report)
    began = time.time()
    job = {"train": {"epochs": 40}, "checkpoint": {"every_n_steps": 1000, "async_save": False},
           "failure": {"preemption_grace_s": 0.5}}
    if ahead_s == 365 * 86400.0:
        returned, reports, run = _run(tmp_path, monkeypatch, task="Slow", **job)
        assert returned["final_step"] == 320 and time.time() - began < 60  # trained to its end, no hold
        return
    with pytest.raises(PreemptionExit, match="the worker group ends for a preemption, its last checkpoint at step"):
        _run(tmp_path, monkeypatch, task="Slow", **job)
    steps = [step for step, _ in complete_checkpoints(tmp_path / "runs" / "t")]
    noticed, last = min(steps), max(steps)
    out = capsys.readouterr().out
    if ahead_s == float("inf"):
        assert steps == [noticed] and "preemption notice with no deadline" in out
        return
    assert seen["at"] + 0.5 <= time.time() < seen["at"] + 5  # ended after the grace (Ray Train's would) ...
    assert last - noticed >= 40  # ... having trained on through most of the notice (~20 ms a step)
    assert f"last checkpoint at step {last}" in out and "training on" in out
    # the run resumes from the notice's last checkpoint having lost nothing: not an interruption for auto's M
    # (the first notice checkpoint is not marked: a node lost before the last one loses the steps since it)
    from behemoth.storage.checkpoint import read_state

    kept = dict(complete_checkpoints(tmp_path / "runs" / "t"))
    assert read_state(kept[last]).ended_on_notice and not read_state(kept[noticed]).ended_on_notice
    monkeypatch.setattr(lane.LaneHost, "preemption_deadline", lambda self: None)  # the replacement: no notice
    again, _, run = _run(tmp_path, monkeypatch, task="Slow", **job)
    assert again["resumed_from_step"] == last and again["final_step"] == 320
    ended = read_state(dict(complete_checkpoints(run))[320])
    assert ended.interruptions == 0 and not ended.ended_on_notice


def test_a_notice_a_replica_protects_against_is_met_by_its_last_checkpoint_alone(tmp_path, monkeypatch, capsys):
    """Issue 73: where a replica protects the run (checkpoint.every_n_steps auto, and the rescue or a lone
    worker's memory copies: rank 0's word, here said by the reporter's `protected`), a node gone before the
    deadline loses no more than one gone without notice, so the notice's immediate checkpoint is left out (its
    hold is the budget's): the one checkpoint the notice takes is its last, before the deadline."""
    from behemoth.errors import PreemptionExit
    from behemoth.hosts import lane
    from behemoth.storage.checkpoint import complete_checkpoints, read_json, read_state
    from behemoth.worker.reporting import Reporter

    seen = _noticed(monkeypatch, at_step=6, ahead_s=3.0)
    real = lane.LaneHost.report

    def report(self, metrics, checkpoint=None, **kw):
        seen.setdefault("reports", []).append(metrics)
        return real(self, metrics, checkpoint, **kw)

    monkeypatch.setattr(lane.LaneHost, "report", report)
    monkeypatch.setattr(Reporter, "protected", lambda self: True)
    with pytest.raises(PreemptionExit):
        _run(tmp_path, monkeypatch, task="Slow", train={"epochs": 40}, failure={"preemption_grace_s": 0.5},
             checkpoint={"every_n_steps": "auto", "async_save": False})
    noticed = [(step, path) for step, path in complete_checkpoints(tmp_path / "runs" / "t")
               if read_json(path, "metrics.json").get("preemption_checkpoint")]
    assert len(noticed) == 1 and read_state(noticed[0][1]).ended_on_notice, noticed
    kept = read_state(noticed[0][1])  # (the loop's wall time, the budget's base, counts more than its steps')
    assert kept.loop_s > kept.trained_s > 0
    out = capsys.readouterr().out
    assert "a replica protects the run until then, so its one checkpoint is the last" in out
    assert f"last checkpoint at step {noticed[0][0]}" in out


def test_a_rank_told_of_the_notice_after_the_others_takes_their_deadline(tmp_path, monkeypatch):
    """Ray Train's watcher tells each worker of a drain when that worker's own call returns, so at a report one
    rank may hold the notice and another not yet. The ranks agree on the deadline of those that have it: a rank
    without it took "no deadline" and ended the group alone while the others trained on (the 120 s storm: rank 1
    raised PreemptionExit at the notice's first checkpoint). Here the other rank is the all-reduce's: this rank's
    host has no notice, the sum carries another rank's, 3 s ahead."""
    import time

    import torch as _torch

    from behemoth.errors import PreemptionExit
    from behemoth.storage.checkpoint import complete_checkpoints
    from behemoth.worker import reporting

    real = reporting.all_reduce_sum
    seen = {}

    def with_another_rank(stats):
        real(stats)
        if len(stats) == 10 and stats[0] != 0:  # a report's vector, once a step has trained
            if "at" not in seen:
                seen["at"] = time.time() + 3.0
            other = _torch.zeros(10, dtype=stats.dtype)
            other[5], other[8] = 1.0, seen["at"]
            stats += other

    monkeypatch.setattr(reporting, "all_reduce_sum", with_another_rank)
    job = {"train": {"epochs": 40}, "checkpoint": {"every_n_steps": 1000, "async_save": False},
           "failure": {"preemption_grace_s": 0.5}}
    with pytest.raises(PreemptionExit, match="its last checkpoint at step"):
        _run(tmp_path, monkeypatch, task="Slow", **job)
    steps = [step for step, _ in complete_checkpoints(tmp_path / "runs" / "t")]
    assert max(steps) - min(steps) >= 40  # trained on through the other rank's notice, as that rank did
    assert seen["at"] + 0.5 <= time.time()  # and ended after its deadline and the grace, not at the notice


def test_young_and_dalys_interval_from_the_measured_hold_and_the_interruptions_seen():
    """checkpoint.every_n_steps auto (issue 73 item 3): sqrt(2 C M) seconds of training, C the median measured
    hold, M what the run met (or the configured expectation before any); in steps, bounded."""
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.checkpoint_interval import FIRST_STEPS, CheckpointInterval, expected_interruption_s

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(every_n_steps="auto", interruption_every_s=3600.0,
                                                     hold_budget=None))
    interval = CheckpointInterval(cfg)
    state = TrainState(step=7)
    assert interval.propose(state, step_s=0.05) == FIRST_STEPS and not interval.due(state, 1000)
    assert interval.due(TrainState(step=FIRST_STEPS), 1000) and interval.due(TrainState(step=3), 3)
    for hold in (0.5, 0.02, 0.02):  # (the median: one slow first checkpoint does not set it)
        interval.measured(hold)
    assert interval.propose(state, step_s=0.05) == round((2 * 0.02 * 3600) ** 0.5 / 0.05)  # 12 s -> 240 steps
    met = TrainState(step=7, interruptions=3, trained_s=36.0)  # 3 met in 36 s of training: one every 12 s
    assert expected_interruption_s(cfg, met) == 12.0
    assert interval.propose(met, step_s=0.05) == round((2 * 0.02 * 12) ** 0.5 / 0.05)  # 0.69 s -> 14 steps
    # never closer than the last background write took (else a snapshot waits for both buffer sets' writes)
    assert interval.propose(met, step_s=0.05, write_s=2.0) == 40
    assert "no closer than the last write took (2.00 s)" in interval.line(met, 0.05, write_s=2.0)
    # said again only where its seconds move by a fifth: not at every report as the step time wobbles
    assert interval.line(met, 0.045, write_s=2.1) is None and interval.line(met, 0.07, write_s=2.0) is None
    assert "checkpoint every 60 steps" in interval.line(met, 0.05, write_s=3.0)
    assert interval.propose(met, step_s=0.05, write_s=0.1) == 14  # (a quick write: Young/Daly's)
    assert expected_interruption_s(cfg, TrainState(trained_s=7200.0)) == 7200.0  # none in 2 h: at least that
    assert interval.due(TrainState(step=120, next_checkpoint_at=120), 1000)
    assert not interval.due(TrainState(step=119, next_checkpoint_at=120), 1000)
    interval.measured(0.0)
    assert interval.propose(state, step_s=1e-9) >= 1  # (never below a step)
    fixed = CheckpointInterval(SimpleNamespace(checkpoint=SimpleNamespace(every_n_steps=5)))
    assert fixed.due(TrainState(step=10), 1000) and not fixed.due(TrainState(step=11), 1000)


def test_a_hold_budget_checkpoints_as_often_as_it_allows():
    """checkpoint.hold_budget (issue 73 item 3, compared at the plain script's blocking cost): the interval is
    the mean hold over the budget, whatever the interruptions, floored by the last write and bounded."""
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.checkpoint_interval import MAX_INTERVAL_S, CheckpointInterval

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(every_n_steps="auto", interruption_every_s=21600.0,
                                                     hold_budget=0.004))
    interval = CheckpointInterval(cfg)
    for hold in (0.006, 0.004, 0.005):  # (their mean: the budget is a share of the time)
        interval.measured(hold)
    calm, stormy = TrainState(step=7), TrainState(step=7, interruptions=5, trained_s=10.0, held_s=0.04)  # (all spent)
    assert interval.propose(calm, step_s=0.03) == interval.propose(stormy, step_s=0.03) == round(1.25 / 0.03)
    assert interval.propose(calm, step_s=0.03, write_s=2.4) == 80  # (never closer than a write takes)
    said = interval.line(calm, 0.03)
    assert "checkpoint.hold_budget 0.004" in said and "1.2 s" in said and "every 42 steps" in said
    for _ in range(4):
        interval.measured(100.0)
    assert interval.seconds(calm)[0] == MAX_INTERVAL_S  # (100 / 0.004 s: bounded)


def test_the_hold_budget_is_an_account_spent_where_no_replica_protects_the_run():
    """checkpoint.hold_budget over the whole run (issue 73): every checkpoint's hold is counted in the train
    state, and the next checkpoint waits until the account has earned its hold (and that of one being taken);
    while a replica protects the run (the rescue) the interval is PROTECTED_STRETCH times the budget's (the
    account saves), with one worker left it is DEGRADED_SPEEDUP times shorter while the savings last; a resumed
    group starts from the run's last mean hold (not a checkpoint FIRST_STEPS in)."""
    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.checkpoint_interval import (BORROW_SHARE, DEGRADED_SPEEDUP, FIRST_STEPS,
                                                     PROTECTED_STRETCH, CheckpointInterval)

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(every_n_steps="auto", interruption_every_s=21600.0,
                                                     hold_budget=0.01))
    interval = CheckpointInterval(cfg)
    state = TrainState(step=40, trained_s=2.0)
    for hold in (0.02, 0.02):
        interval.measured(hold, state)
    assert state.held_s == pytest.approx(0.04) and state.hold_s == pytest.approx(0.02)
    budget_s = 0.02 / 0.01  # 2 s of training earn a checkpoint's hold
    state.trained_s = 4.0  # earned 0.04 s, spent 0.04 s: the next when the next hold is earned
    assert interval.seconds(state)[0] == pytest.approx(budget_s)
    assert interval.seconds(state, pending_s=0.02)[0] == pytest.approx(2 * budget_s)  # (and this one's)
    assert interval.seconds(state, protected=True)[0] == pytest.approx(budget_s * PROTECTED_STRETCH)
    state.trained_s = 40.0  # protected for a while: 0.36 s of the budget saved
    assert interval.seconds(state)[0] == pytest.approx(budget_s / DEGRADED_SPEEDUP)
    assert interval.seconds(state, protected=True)[0] == pytest.approx(budget_s * PROTECTED_STRETCH)
    assert interval.propose(state, step_s=0.1, checkpointing=True) == round(budget_s / DEGRADED_SPEEDUP / 0.1)
    state.held_s = 0.5  # overspent by 0.1 s: 10 s of training to earn it back, 2 more for the next hold
    assert interval.seconds(state)[0] == pytest.approx(12.0)
    assert interval.seconds(state, protected=True)[0] == pytest.approx(budget_s * PROTECTED_STRETCH)
    said = interval.line(state, 0.1)  # (said again where the rule moves: the account's wait moves at every report)
    assert "checkpoint every 120 steps" in said and "with nothing to protect the run" in said
    assert "for now every 12.0 s, as the account over the run allows" in said
    # ... or sooner where the rest of the run will earn it: up to BORROW_SHARE of it may be spent ahead
    assert interval.seconds(state, ahead_s=10.0)[0] == pytest.approx(12.0 - BORROW_SHARE * 10.0)
    assert interval.seconds(state, ahead_s=100.0)[0] == pytest.approx(budget_s / DEGRADED_SPEEDUP)  # (the rule's)
    assert interval.propose(state, step_s=0.1, steps_left=100) == round((12.0 - BORROW_SHARE * 10.0) / 0.1)
    assert interval.propose(state, step_s=0.1, steps_left=0) == 120
    state.loop_s = 50.0  # the budget is a share of the loop's wall time (its reports, waits, holds): 0.5 s earned
    assert interval.seconds(state)[0] == pytest.approx(budget_s)  # (nothing owed: this hold earned in 2 s)
    state.loop_s = 0.0
    resumed = CheckpointInterval(cfg)
    assert resumed.propose(state, step_s=0.1) == FIRST_STEPS
    resumed.resumed(state)
    assert resumed.propose(state, step_s=0.1) == interval.propose(state, step_s=0.1) == 120
    # Young/Daly's interval (no budget) is stretched alike while protected
    yd = CheckpointInterval(SimpleNamespace(checkpoint=SimpleNamespace(every_n_steps="auto",
                                                                       interruption_every_s=3600.0, hold_budget=None)))
    yd.measured(0.02)
    assert yd.seconds(TrainState(), protected=True)[0] == pytest.approx(PROTECTED_STRETCH * (2 * 0.02 * 3600) ** 0.5)


def test_the_host_buffers_say_how_long_the_last_write_took():
    """checkpoint.every_n_steps auto's floor: the time from a set's snapshot to its write having read it."""
    import time

    from behemoth.checkpoints.saver import HostBuffers

    sets = HostBuffers()
    assert sets.last_write_s() is None
    _, written = sets.take()
    time.sleep(0.2)
    assert sets.last_write_s() is None  # (still being written)
    written.set()
    assert 0.19 <= sets.last_write_s() < 5
    _, quick = sets.take()
    quick.cpu_s = 0.03  # (what the write's thread spent: checkpoints/saver.store sets it)
    quick.set()
    assert sets.last_write_s() < 0.19  # the latest write's
    assert sets.last_write_cpu_s() == 0.03 and sets.totals["cpu_s"] == 0.03
    _, again = sets.take()
    assert again.cpu_s is None  # (a set taken again forgets its last write)
    again.cpu_s = 0.02
    again.set()
    assert sets.last_write_cpu_s() == 0.02 and sets.totals["cpu_s"] == 0.05


def test_auto_checkpoints_on_the_agreed_schedule_and_a_resumed_run_keeps_it(tmp_path, monkeypatch, capsys):
    """The loop under checkpoint.every_n_steps auto: the first checkpoint at FIRST_STEPS, the next ones where the
    report agreed (kept in the checkpoint's train state), the interval said; a rerun counts its resume as an
    interruption and goes on from the kept schedule."""
    from behemoth.storage.checkpoint import complete_checkpoints, read_state
    from behemoth.worker.checkpoint_interval import FIRST_STEPS

    job = {"train": {"epochs": 10}, "checkpoint": {"every_n_steps": "auto", "interruption_every_s": 1.0,
                                                   "async_save": False}}
    returned, reports, run = _run(tmp_path, monkeypatch, task="Slow", **job)
    saved = [r for r in reports if "checkpoint_score" in r]  # (the reports that carried a checkpoint)
    assert saved[0]["step"] == FIRST_STEPS and saved[-1]["step"] == 80 and len(saved) > 3
    planned = None  # each checkpoint at the step the reports before it agreed: set by the last checkpoint's, and
    for r in sorted(reports, key=lambda r: r["step"]):  # brought closer by a later report's shorter interval
        if "checkpoint_score" in r and r["step"] < 80:
            assert planned is None or r["step"] == planned
            planned = r["step"] + r["checkpoint_interval_steps"]
        elif planned is not None and "checkpoint_interval_steps" in r:
            planned = min(planned, r["step"] + r["checkpoint_interval_steps"])
    states = {step: read_state(ckpt) for step, ckpt in complete_checkpoints(run)}
    for step, state in states.items():
        assert state.next_checkpoint_at > step or step == 80
    assert "checkpoint every" in capsys.readouterr().out
    latest = max(states)
    again, _, _ = _run(tmp_path, monkeypatch, task="Slow", train={"epochs": 12},
                       checkpoint={"every_n_steps": "auto", "interruption_every_s": 1.0, "async_save": False})
    assert again["resumed_from_step"] == latest == 80
    resumed = {step: read_state(ckpt) for step, ckpt in complete_checkpoints(run)}
    assert resumed[max(resumed)].interruptions == 1 and resumed[max(resumed)].trained_s > states[latest].trained_s



class Points(Callback):
    """Records each point a callback is called at: (its name, the point, the state's step, the context's rank and
    total steps)."""

    seen: list = []
    name = "user"  # train.callbacks' class (each worker makes one with no arguments)

    def _saw(self, point, ctx, state):
        Points.seen.append((self.name, point, state.step, ctx.rank, ctx.total_steps))

    def before_step(self, ctx, state):
        self._saw("before_step", ctx, state)

    def after_update(self, ctx, state, micro_batches, loss_sum, n_valid):
        assert micro_batches and float(n_valid) > 0
        self._saw("after_update", ctx, state)

    def after_step(self, ctx, state):
        self._saw("after_step", ctx, state)

    def after_report(self, ctx, state):
        self._saw("after_report", ctx, state)


class TaskPoints(Points):
    name = "task"


class WithCallbacks(Regression):
    """A task that adds a callback of its own."""

    def callbacks(self):
        return [TaskPoints()]


class NotACallback:
    def after_step(self, ctx, state):
        pass


def test_a_tasks_callbacks_and_the_users_are_called_at_every_point_after_behemoths_with_the_step_context(
        tmp_path, monkeypatch):
    """Issue 77 item 2: a task's callbacks (Task.callbacks) and the user's (train.callbacks, module:Class) run at
    each step's four points, the task's before the user's, each handed the step context and the state."""
    Points.seen = []
    _run(tmp_path, monkeypatch, task="WithCallbacks", train={"callbacks": ["unit.test_loop_wiring:Points"]})
    assert len(Points.seen) == 8 * 4 * 2  # 8 steps, 4 points, 2 callbacks
    for k in range(8):
        at = [(name, point, step) for name, point, step, _, _ in Points.seen[k * 8:(k + 1) * 8]]
        assert at == [("task", "before_step", k), ("user", "before_step", k), ("task", "after_update", k),
                      ("user", "after_update", k), ("task", "after_step", k + 1), ("user", "after_step", k + 1),
                      ("task", "after_report", k + 1), ("user", "after_report", k + 1)], at
    assert {(rank, total) for *_, rank, total in Points.seen} == {(0, 8)}


@pytest.mark.parametrize("path, said", [("unit.test_loop_wiring:Nowhere", "cannot import"),
                                        ("unit.test_loop_wiring:NotACallback", "not a subclass of behemoth.Callback"),
                                        ("no_colon", "is not module:Class")])
def test_a_callback_path_that_is_not_a_callback_is_one_line_before_ray(tmp_path, path, said):
    from behemoth.driver.run.sequence import check_data
    from behemoth.errors import ConfigError
    from behemoth.job import config_from_dict

    job = job_dict(tmp_path, tmp_path / "runs", data={}, train={"callbacks": [path]})
    job["data"] = {"kind": "unit.test_loop_wiring:Regression"}
    with pytest.raises(ConfigError, match=f"train.callbacks: .*{said}"):
        check_data(config_from_dict(job))


class FrozenCount(Callback):
    seen: list = []

    def after_step(self, ctx, state):
        import gc

        FrozenCount.seen.append(gc.get_freeze_count())


def test_what_the_worker_built_before_its_loop_is_frozen_through_the_loop_and_given_back_after(tmp_path, monkeypatch):
    """A full collection scans every object the process holds: in a training worker one took ~0.6 s (BENCHMARKS.md,
    R9's stall). The loop freezes what was built before it (gc.freeze: full collections scan only what the steps
    make; 0.6-0.7 ms there after) and unfreezes it when it ends, so that a lane's next trial can collect it."""
    import gc

    assert gc.get_freeze_count() == 0
    FrozenCount.seen = []
    _run(tmp_path, monkeypatch, train={"callbacks": ["unit.test_loop_wiring:FrozenCount"]})
    assert len(FrozenCount.seen) == 8 and min(FrozenCount.seen) > 10_000, FrozenCount.seen  # torch, the model, ...
    assert gc.get_freeze_count() == 0


def test_the_learning_rate_reported_is_the_one_the_step_trained_with(tmp_path, monkeypatch):
    """The report read the scheduler after the step had moved it on: warm-up's rates one step high, and the last
    report min_lr where the last step trained at more. Warm-up 4 steps, then linear to 0 over 8."""
    _, reports, _ = _run(tmp_path, monkeypatch, train={"warmup_steps": 4, "schedule": "linear", "min_lr_ratio": 0.0})
    lrs = {r["step"]: r["lr"] for r in reports if "lr" in r}
    # step s trained at index s - 1: (s / 4) x 0.05 in warm-up, then 0.05 x (1 - (s - 1 - 4) / 4)
    assert lrs == pytest.approx({2: 0.025, 4: 0.05, 6: 0.0375, 8: 0.0125})


class EvalBuilt(Regression):
    """A task whose model comes built in eval mode, as transformers' from_pretrained returns every model, with a
    layer that records the mode of every training forward."""

    modes: list = []

    def build_model(self):
        class Mode(torch.nn.Module):
            def forward(self, x):
                if torch.is_grad_enabled():
                    EvalBuilt.modes.append(self.training)
                return x

        return torch.nn.Sequential(torch.nn.Linear(self.cfg.data.features, 1), Mode()).eval()


def test_a_model_built_in_eval_mode_trains_in_training_mode_on_every_rank(tmp_path, monkeypatch):
    """A pretrained transformers model (from_pretrained: eval mode) trained with its BatchNorm statistics frozen
    and dropout and drop-path off on every rank but 0, whose FLOP count happened to call train(), and on rank 0
    too in a warm lane that had counted the model before; with train.ema_decay the first evaluation's train() went
    to the average, so for the whole run. Here the count is skipped, as on those ranks: every step's forward is
    in training mode."""
    from behemoth.worker.speed import SpeedMeter

    monkeypatch.setattr(SpeedMeter, "count", lambda self, task, model: None)  # (ranks other than 0 never count)
    EvalBuilt.modes.clear()
    _run(tmp_path, monkeypatch, task="EvalBuilt", train={"ema_decay": 0.9})
    assert EvalBuilt.modes and all(EvalBuilt.modes), EvalBuilt.modes[:10]
