"""Goodput: where a run's wall time went, over every worker-group restart and every rerun of the driver.

Pure: the run's records in (timeline.jsonl, metrics.jsonl), an account out. The wall time of each invocation
(from its process start to its end; a killed driver's ends at its last record) is cut into:

  startup      process start -> the first worker group's first step: Python imports, Ray, data preparation,
               Ray Train's controller and workers, model build, checkpoint restore
  productive   training steps whose result survived (forward, backward, optimizer step)
  data_wait    waiting for the next batch (in the kept part of each group)
  checkpoint   the training loop held by a checkpoint (snapshot, or the whole save when synchronous)
  evaluation   validation passes
  reporting    metrics all-reduce, ray.train.report, console lines
  lost         work a failure threw away: the measured compute and data-wait of the steps after the
               checkpoint the next group restored (they are trained again); the evaluation, checkpoints and
               reports of that stretch stay in their own terms (they were spent all the same)
  downtime     a failed (or resized) worker group's last report -> the next one's first step: the failure's
               detection, the restart, and the steps trained after that report (not measured: no report
               carries them; at most train.log_every - 1 of them plus the step under way)
  preemption   the same for a group ended by a preemption (its last report carries the preemption's
               checkpoint, the last one before the notice's deadline): the wait for nodes and the restart
  shutdown     the last group's end -> the invocation's end (Ray Train's shutdown, the report, MLflow's
               artifacts)
  unaccounted  the rest of the kept spans (loop bookkeeping between the measured phases)

goodput = productive / total. Every term is measured on its own (the workers' PhaseClock, the driver's and
the controller's timestamps), so `unaccounted` shows how complete the account is. Times come from each
process's wall clock: on a cluster, the skew between the driver's and rank 0's nodes enters startup/downtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERMS = ("startup", "productive", "data_wait", "checkpoint", "evaluation", "reporting", "lost", "downtime",
         "preemption", "shutdown", "unaccounted")
# The first group's start-up, by milestone: process start -> `train` called -> data checked (images: the index
# built) -> Ray up -> data prepared (text: tokenised and packed) -> trackers opened (MLflow) and fit called ->
# rank 0's training function starts (Ray Train's controller and workers) -> its first step (model, restore).
STARTUP_PARTS = ("imports", "data_check", "ray", "data_prepare", "tracking", "workers", "model_and_restore")
_STARTUP_MARKS = ("invoked", "data_checked", "ray_ready", "data_ready", "fit_called")
_PHASE_TERMS = {"step": "productive", "data_wait": "data_wait", "checkpoint": "checkpoint", "eval": "evaluation",
                "report": "reporting"}


@dataclass
class GroupAccount:
    invocation: str
    group_id: str
    workers: int
    started: float  # the training function's start on rank 0
    loop_started: float
    ended: float
    first_step: int
    last_step: int
    resumed_from_step: int
    restored_by_next: int | None  # the step the next group continued from (None: this group finished the run)
    before: float  # startup (first group of an invocation) or downtime (a restart) before its first step
    terms: dict = field(default_factory=dict)
    preempted: bool = False  # its last report carries a preemption's checkpoint


@dataclass
class Account:
    terms: dict  # seconds per term (TERMS), summed over every invocation
    total_s: float
    groups: list[GroupAccount]
    invocations: list[dict]  # per invocation: id, start, end, status, terms
    startup_detail: dict  # seconds per STARTUP_PARTS, summed over invocations

    @property
    def goodput(self) -> float:
        return self.terms["productive"] / self.total_s if self.total_s > 0 else 0.0

    @property
    def preemptions(self) -> list[GroupAccount]:
        """The worker groups a preemption ended (a notice, a checkpoint, a restart)."""
        return [g for g in self.groups if g.preempted and g.restored_by_next is not None]

    def line(self) -> str:
        shown = [f"{t.replace('_', '-')} {self.terms[t]:.1f} s" for t in TERMS if t != "productive" and
                 self.terms[t] >= 0.05]
        preempted = self.preemptions
        tail = (f"; {len(preempted)} preemption{'s' if len(preempted) > 1 else ''}: "
                f"{sum(g.last_step - g.restored_by_next for g in preempted)} steps redone" if preempted else "")
        return (f"{self.goodput:.1%} of {self.total_s:.1f} s trained (productive {self.terms['productive']:.1f} s; "
                + ", ".join(shown) + ")" + tail)

    def startup_line(self) -> str | None:
        """Time to the first step of the latest invocation (the command just run) and where it went."""
        latest = self.invocations[-1] if self.invocations else {}
        if latest.get("first_step_s") is None:
            return None
        parts = ""
        if len(self.invocations) == 1:  # the detail is summed over invocations: shown for a single one
            shown = [f"{k.replace('_', ' ')} {v:.1f}" for k, v in self.startup_detail.items() if v >= 0.05]
            parts = f" ({', '.join(shown)} s; then the first batch and step)"
        return f"{latest['first_step_s']:.1f} s from process start to the end of the first step{parts}"

    def as_dict(self) -> dict:
        return {"goodput": self.goodput, "total_s": self.total_s, "terms_s": self.terms,
                "startup_detail_s": self.startup_detail, "invocations": self.invocations,
                "groups": [g.__dict__ for g in self.groups]}


def account(timeline: list[dict], reports: list[dict]) -> Account:
    starts = {e["invocation"]: e for e in timeline if e.get("event") == "invocation_start"}
    ends = {e["invocation"]: e for e in timeline if e.get("event") == "invocation_end"}
    order = sorted(starts, key=lambda i: starts[i]["time"])
    by_group: dict[str, list[dict]] = {}
    for r in reports:
        if r.get("group_id") and "step" in r:
            by_group.setdefault(r["group_id"], []).append(r)
    for rs in by_group.values():
        rs.sort(key=lambda r: r["wall_time"])
    groups_of = {i: sorted((g for g, rs in by_group.items() if rs[0].get("invocation") == i),
                           key=lambda g: by_group[g][0]["wall_time"]) for i in order}
    sequence = [g for i in order for g in groups_of[i]]  # every worker group of the run, in time order
    restored_by_next = {g: by_group[nxt][0].get("resumed_from_step", 0) for g, nxt in zip(sequence, sequence[1:])}

    terms, detail = dict.fromkeys(TERMS, 0.0), dict.fromkeys(STARTUP_PARTS, 0.0)
    groups, invocations = [], []
    for inv in order:
        start, end_event = starts[inv], ends.get(inv) or {}
        t0 = start.get("marks", {}).get("process_start", start["time"])
        t_end = end_event.get("time") or max([e["time"] for e in timeline if e.get("invocation") == inv]
                                             + [r["wall_time"] for g in groups_of[inv] for r in by_group[g]])
        acted = sorted(e["time"] for e in timeline if e.get("invocation") == inv and e.get("event") in
                       ("failure", "group_start"))  # when Ray Train's controller ended or replaced a group
        inv_terms, boundary, after_preemption = dict.fromkeys(TERMS, 0.0), t0, False
        for n, g in enumerate(groups_of[inv]):
            group = _group(inv, g, by_group[g], end_event.get("clock") or {}, acted, restored_by_next.get(g),
                           boundary, first=n == 0, after_preemption=after_preemption)
            after_preemption = group.preempted
            if n == 0:
                _startup_parts(detail, t0, start.get("marks", {}), by_group[g][-1], group.loop_started)
            groups.append(group)
            for t in TERMS:
                inv_terms[t] += group.terms[t]
            boundary = group.ended
        inv_terms["shutdown" if groups_of[inv] else "startup"] += t_end - boundary
        for t in TERMS:
            terms[t] += inv_terms[t]
        first_step = next((r["mark_first_step"] for g in groups_of[inv] for r in by_group[g]
                           if "mark_first_step" in r), None)
        invocations.append({"invocation": inv, "start": t0, "end": t_end, "total_s": t_end - t0,
                            "status": end_event.get("status", "killed (no end record)"), "terms_s": inv_terms,
                            "first_step_s": None if first_step is None else first_step - t0})
    return Account(terms, sum(i["total_s"] for i in invocations), groups, invocations, detail)


def _group(inv: str, g: str, rs: list[dict], final_clock: dict, acted: list[float], restored: int | None,
           boundary: float, first: bool, after_preemption: bool = False) -> GroupAccount:
    """One worker group's account: the time before its first step (start-up, downtime, or the preemption's
    wait where the group before was preempted), its measured phases up to the point its work was kept, and what
    a failure threw away after that."""
    last = rs[-1]
    loop_started = last.get("mark_loop_started", rs[0]["wall_time"])
    if final_clock.get("group_id") == g:  # it returned normally: its final counters, nothing lost
        ended, cut, cut_time = final_clock["wall_time"], final_clock, final_clock["wall_time"]
    else:  # failed, resized, or its driver was killed: it ended when the controller acted (or at its last report)
        ended = min([t for t in acted if t > last["wall_time"]], default=last["wall_time"])
        cut, cut_time = last, last["wall_time"]
    kept = cut  # the counters as of the last step whose result survived
    if restored is not None and cut is last:  # the next group went back to step `restored`: later steps are lost
        before = [r for r in rs if r["step"] <= restored and r.get("mark_loop_started") is not None]
        kept = before[-1] if before else {}
    terms = dict.fromkeys(TERMS, 0.0)
    terms["startup" if first else "preemption" if after_preemption else "downtime"] = loop_started - boundary
    for phase, term in _PHASE_TERMS.items():  # evaluation, checkpoints, reports: spent, whether kept or not
        terms[term] = cut.get(f"time_{phase}_s", 0.0)
    for phase in ("step", "data_wait"):  # the thrown-away steps' own time (compute and data) is the lost work
        terms[_PHASE_TERMS[phase]] = kept.get(f"time_{phase}_s", 0.0)
        terms["lost"] += cut.get(f"time_{phase}_s", 0.0) - kept.get(f"time_{phase}_s", 0.0)
    terms["unaccounted"] = (cut_time - loop_started) - sum(terms[t] for t in (*_PHASE_TERMS.values(), "lost"))
    preempted = bool(last.get("preemption_checkpoint")) and cut is last
    # its last report -> the failure seen (unreported steps, detection); after a preemption's last checkpoint, the
    # group's end
    terms["preemption" if preempted else "downtime"] += ended - cut_time
    return GroupAccount(inv, g, int(last.get("world_size", 0)), last.get("mark_started", loop_started), loop_started,
                        ended, rs[0]["step"], last["step"], int(last.get("resumed_from_step", 0)), restored,
                        loop_started - boundary, terms, preempted)


def _startup_parts(detail: dict, t0: float, marks: dict, report: dict, loop_started: float) -> None:
    points = [t0, *(marks.get(m, t0) for m in _STARTUP_MARKS), report.get("mark_started", loop_started), loop_started]
    for key, a, b in zip(STARTUP_PARTS, points, points[1:]):
        detail[key] += max(b - a, 0.0)
