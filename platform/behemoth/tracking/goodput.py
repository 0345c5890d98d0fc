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
  lost         work a failure threw away: from the checkpoint the next group restored to the failure
               (steps trained again, and anything else the failed group did after that checkpoint)
  downtime     between a failed (or resized) worker group and the next one's first step
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
         "shutdown", "unaccounted")
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

    def line(self) -> str:
        shown = [f"{t.replace('_', '-')} {self.terms[t]:.1f} s" for t in TERMS if t != "productive" and
                 self.terms[t] >= 0.05]
        return (f"{self.goodput:.1%} of {self.total_s:.1f} s trained (productive {self.terms['productive']:.1f} s; "
                + ", ".join(shown) + ")")

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
    groups_of = {i: sorted((g for g, rs in by_group.items() if rs[0].get("invocation") == i),
                           key=lambda g: by_group[g][0]["wall_time"]) for i in order}
    sequence = [g for i in order for g in groups_of[i]]  # every worker group of the run, in time order

    terms = dict.fromkeys(TERMS, 0.0)
    detail = dict.fromkeys(STARTUP_PARTS, 0.0)
    groups, invocations = [], []
    for inv in order:
        start, end_event = starts[inv], ends.get(inv)
        t0 = start.get("marks", {}).get("process_start", start["time"])
        records = [e["time"] for e in timeline if e.get("invocation") == inv] + [
            r["wall_time"] for g in groups_of[inv] for r in by_group[g]]
        t_end = end_event["time"] if end_event else max(records)
        final_clock = (end_event or {}).get("clock") or {}
        inv_terms = dict.fromkeys(TERMS, 0.0)
        boundary, first = t0, True
        events = sorted((e for e in timeline if e.get("invocation") == inv and e.get("event") in
                         ("failure", "group_start")), key=lambda e: e["time"])
        for g in groups_of[inv]:
            rs = sorted(by_group[g], key=lambda r: r["wall_time"])
            last = rs[-1]
            loop_started = last.get("mark_loop_started", rs[0]["wall_time"])
            later = sequence[sequence.index(g) + 1:]
            restored = by_group[later[0]][0].get("resumed_from_step", 0) if later else None
            if final_clock.get("group_id") == g:  # the group returned normally: its final counters
                ended, cut_counters, cut_time = final_clock["wall_time"], final_clock, final_clock["wall_time"]
            else:  # failed, resized, or its driver was killed: ends when the controller acted (or at its last report)
                after = [e["time"] for e in events if e["time"] > last["wall_time"]]
                ended = min(after) if after else last["wall_time"]
                cut_counters, cut_time = last, last["wall_time"]
            if restored is not None:  # the next group went back to `restored`: what came after it is lost
                kept = [r for r in rs if r["step"] <= restored and r.get("mark_loop_started") is not None]
                cut_counters, cut_time = (kept[-1], kept[-1]["wall_time"]) if kept else ({}, loop_started)
            gt = dict.fromkeys(TERMS, 0.0)
            gt["startup" if first else "downtime"] = loop_started - boundary
            if first:
                marks = start.get("marks", {})
                points = [t0, *(marks.get(m, t0) for m in _STARTUP_MARKS),
                          last.get("mark_started", loop_started), loop_started]
                for key, a, b in zip(STARTUP_PARTS, points, points[1:]):
                    detail[key] += max(b - a, 0.0)
            for phase, term in _PHASE_TERMS.items():
                gt[term] = cut_counters.get(f"time_{phase}_s", 0.0)
            gt["unaccounted"] = (cut_time - loop_started) - sum(gt[t] for t in _PHASE_TERMS.values())
            gt["lost"] = ended - cut_time
            for t in TERMS:
                inv_terms[t] += gt[t]
            groups.append(GroupAccount(inv, g, int(last.get("world_size", 0)), last.get("mark_started", loop_started),
                                       loop_started, ended, rs[0]["step"], last["step"],
                                       int(last.get("resumed_from_step", 0)), restored, loop_started - boundary, gt))
            boundary, first = ended, False
        inv_terms["startup" if first else "shutdown"] += t_end - boundary
        for t in TERMS:
            terms[t] += inv_terms[t]
        invocations.append({"invocation": inv, "start": t0, "end": t_end, "total_s": t_end - t0,
                            "status": (end_event or {}).get("status", "killed (no end record)"), "terms_s": inv_terms})
    return Account(terms, sum(i["total_s"] for i in invocations), groups, invocations, detail)
