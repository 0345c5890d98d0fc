"""`behemoth report FOLDER`: a run's (or a sweep's) story as REPORT/report.html (one self-contained file, the
plots embedded) and the PNGs beside it. Read from the run's own records (metrics.jsonl, timeline.jsonl,
goodput account); matplotlib draws (Agg: no display needed).

A run: loss (training and validation), the task's validation metric, learning rate, throughput and data-wait,
model speed and memory, checkpoint stalls, world size over time, and the goodput account, with every
restart, resize and rerun marked. A sweep (a folder with results.csv): the table of trials, the metric
against each swept key, and each trial's validation curve, with the trials ASHA stopped marked.
"""

from __future__ import annotations

import base64
import html
import io
import os

from behemoth.storage import paths
from behemoth.storage.store import Store
from behemoth.errors import ConfigError, DataError
from behemoth.tracking import goodput
from behemoth.tracking.records import (METRICS, TIMELINE, exists, latest_per_step, read_jsonl, read_text,
                                       write_bytes, write_text)

FOLDER = "report"
_COLOURS = {"productive": "#2e7d32", "startup": "#90a4ae", "data_wait": "#fbc02d", "checkpoint": "#6a1b9a",
            "evaluation": "#1565c0", "reporting": "#80deea", "lost": "#c62828", "downtime": "#ef6c00",
            "preemption": "#ad1457", "shutdown": "#b0bec5", "unaccounted": "#eeeeee"}


def write_report(folder: str) -> str:
    """A run folder or a sweep folder -> its report.html (returned)."""
    folder = paths.storage_root(folder)
    if exists(paths.join(folder, "results.csv")):  # (also one that is not UTF-8: refused by its reader)
        return write_sweep_report(folder)
    if not exists(paths.join(folder, METRICS)):
        raise ConfigError(f"{folder} is neither a run folder (no {METRICS}) nor a sweep folder (no results.csv): "
                          f"give the folder `behemoth train` or `behemoth tune` printed")
    return write_run_report(folder)


# ---------------------------------------------------------------------------------------------------------
# A run


def write_run_report(run_dir: str, account: goodput.Account | None = None) -> str:
    """`account`: the goodput account to show (default: from the run's records)."""
    plt = _pyplot()
    reports = read_jsonl(paths.join(run_dir, METRICS))
    timeline = read_jsonl(paths.join(run_dir, TIMELINE))
    kept = latest_per_step(reports)
    if account is None and timeline:
        account = goodput.account(timeline, reports)
    figures = _step_figures(plt, kept, _restarts(reports))
    figures["world_size"] = _world_size(plt, reports, timeline, account)
    if account and account.groups:
        figures["goodput"] = _goodput_bars(plt, account)

    out = paths.join(run_dir, FOLDER)
    pngs = _save(figures, out)
    sections = [_run_summary(run_dir, kept, account)]
    if account:
        sections.append(_goodput_tables(account))
    sections += [f'<h2>{html.escape(name.replace("_", " ").title())}</h2><img src="data:image/png;base64,{b64}">'
                 for name, b64 in pngs.items()]
    sections += _profile_links(run_dir)
    sections += _samples(kept)
    page = _page(f"behemoth run {os.path.basename(run_dir.rstrip('/'))}", sections)
    target = paths.join(out, "report.html")
    write_text(target, page)
    return target


def _samples(kept: list[dict]) -> list[str]:
    """What the model said at each evaluation (val_outputs: a chat run's replies to a few validation prompts)."""
    rows = [(r["step"], sample) for r in kept if isinstance(r.get("val_outputs"), list) for sample in r["val_outputs"]]
    if not rows:
        return []
    cells = "".join(f"<tr><td>{step}</td><td><pre>{html.escape(str(s.get('prompt', '')))}</pre></td>"
                    f"<td><pre>{html.escape(str(s.get('reply', '')))}</pre></td></tr>" for step, s in rows)
    return [f"<h2>What the model says (val_outputs, greedy, at each evaluation)</h2><table><tr><th>step</th>"
            f"<th>prompt (its end)</th><th>reply</th></tr>{cells}</table>"]


def _profile_links(run_dir: str) -> list[str]:
    """The run's profiler traces (train.profile: RUN/profile/), linked from the report (beside it: ../profile)."""
    found = Store(paths.join(run_dir, "profile")).list_files()
    if not found:
        return []
    items = "".join(f'<li><a href="../profile/{html.escape(n)}">{html.escape(n)}</a></li>' for n in found)
    return [f"<h2>Profiler traces (train.profile)</h2><p>Open a .pt.trace.json in "
            f"<a href=\"https://ui.perfetto.dev\">ui.perfetto.dev</a> (or chrome://tracing); a .memory.pickle in "
            f"<a href=\"https://pytorch.org/memory_viz\">pytorch.org/memory_viz</a>.</p><ul>{items}</ul>"]


def _step_figures(plt, kept: list[dict], restarts: list) -> dict:
    """The curves against the step: loss, validation rates, LR, throughput + data-wait, speed + memory,
    checkpoint stalls."""
    figures = {}

    def by_step(name, title, ylabel, series, **kw):
        figures[name] = _by_step(plt, kept, restarts, title, ylabel, series, **kw)

    by_step("loss", "Loss", "loss", [("training (per report)", "loss", "-"), ("validation", "val_loss", "o-")])
    preference = any("rewards/accuracies" in r for r in kept)  # a DPO run's (TRL's names): a figure of its own
    val_keys = sorted({k for r in kept for k in r if k.startswith("val_") and k != "val_loss"
                       and not k.endswith(("samples", "tokens", "pairs"))  # rates, not the counts evaluated
                       and not (preference and "/" in k)})
    if val_keys:
        by_step("validation", "Validation", "value", [(k[4:], k, "o-") for k in val_keys])
    if preference:
        by_step("rewards", "Preference rewards (beta x log-ratio to the reference)", "reward",
                [("chosen", "rewards/chosen", "-"), ("rejected", "rewards/rejected", "-"),
                 ("held-out margin", "val_rewards/margins", "o-")],
                twin=("accuracy (training)", "rewards/accuracies", "--"))
    by_step("lr", "Learning rate and gradient norm", "lr", [("lr", "lr", "-")],
            twin=("gradient norm (before clipping)", "grad_norm", "-"))
    throughput = [("samples/s", "samples_per_s", "-")]
    if any("tokens_per_s" in r for r in kept):
        throughput = [("tokens/s", "tokens_per_s", "-")]
    by_step("throughput", "Throughput and data-wait", throughput[0][0], throughput,
            twin=("data-wait (share of step time)", "data_wait_frac", "--"))
    speed_key = ("MFU", "mfu") if any("mfu" in r for r in kept) else ("TFLOP/s per worker", "tflops_per_worker")
    by_step("speed", "Model speed and memory", speed_key[0], [(speed_key[0], speed_key[1], "-")],
            twin=("peak memory (GB)", "peak_mem_gb", "--"))
    by_step("checkpoints", "Checkpoint stalls (each at the first report after its checkpoint)",
            "seconds the loop was held", [("per checkpoint", "checkpoint_block_s", "o")], changes_only=True)
    return figures


def _by_step(plt, kept, restarts, title, ylabel, series, twin=None, changes_only=False):
    """One figure: `series` (label, report key, line style) against the step, an optional `twin` on a second
    axis, restarts marked."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for label, key, style in series:
        pts = [(r["step"], r[key]) for r in kept if isinstance(r.get(key), (int, float))]
        if changes_only:  # a value every report carries until it changes (the last checkpoint's stall)
            pts = [p for i, p in enumerate(pts) if i == 0 or p[1] != pts[i - 1][1]]
        if pts:
            ax.plot(*zip(*pts), style, label=label, markersize=4)
    if twin:
        label, key, style = twin
        pts = [(r["step"], r[key]) for r in kept if isinstance(r.get(key), (int, float))]
        ax2 = ax.twinx()
        if pts:
            ax2.plot(*zip(*pts), style, label=label, color="#ef6c00", markersize=3)
        ax2.set_ylabel(label)
        _legend(ax2, loc="upper right")
    _mark_restarts(ax, restarts)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax, loc="upper left" if twin else "best")
    ax.grid(alpha=0.3)
    _margins(fig, 0.88 if twin else 0.97)
    return fig


def _restarts(reports: list[dict]) -> list[tuple[int, str]]:
    """(step, label) where a worker group after the first started: a restart in the same invocation, or a
    rerun of the driver (resume)."""
    seen, marks, last_inv = set(), [], None
    for r in reports:
        g = r.get("group_id")
        if g and g not in seen and "step" in r:
            if seen:
                kind = "rerun" if r.get("invocation") != last_inv else "restart"
                marks.append((int(r.get("resumed_from_step", r["step"])), kind))
            seen.add(g)
            last_inv = r.get("invocation")
    return marks


def _mark_restarts(ax, restarts) -> None:
    for i, (step, kind) in enumerate(restarts):
        ax.axvline(step, color="#c62828" if kind == "restart" else "#6a1b9a", linestyle=":", linewidth=1.2,
                   label=f"{kind} from step {step}" if i < 4 else None)


def _world_size(plt, reports: list[dict], timeline: list[dict], account):
    """Workers training over wall time (0 while a group starts, restarts or the driver is down), with the
    invocations' starts, Ray Train's worker-group starts (first start, restart, resize) and failures marked."""
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    times = [e["time"] for e in timeline] + [r["wall_time"] for r in reports if "wall_time" in r]
    t0 = min([*times, *(i["start"] for i in (account.invocations if account else []))], default=0.0)
    if account and account.groups:
        xs, ys = [0.0], [0]
        for g in account.groups:
            xs += [g.loop_started - t0, g.ended - t0]
            ys += [g.workers, 0]
        ax.step(xs, ys, where="post", label="workers training", linewidth=2)
    else:
        pts = sorted((r["wall_time"] - t0, r.get("world_size", 0)) for r in reports if "wall_time" in r)
        if pts:
            ax.step(*zip(*pts), where="post", label="workers (at each report)")
    styles = {"invocation_start": ("run / rerun starts", "#6a1b9a", "-", 1.2),
              "group_start": ("worker group starts (restart, resize)", "#1565c0", ":", 1.2),
              "failure": ("failure", "#c62828", "--", 2.0)}
    starts = {e["invocation"]: e["time"] for e in timeline if e.get("event") == "invocation_start"}
    starts.update({i["invocation"]: i["start"] for i in (account.invocations if account else [])})  # process start
    marks = {"invocation_start": sorted(starts.values()),
             **{ev: [e["time"] for e in timeline if e.get("event") == ev] for ev in ("group_start", "failure")}}
    for event, (label, colour, style, width) in styles.items():  # failures drawn last: on top
        for i, at in enumerate(marks[event]):
            ax.axvline(at - t0, color=colour, linestyle=style, linewidth=width, label=None if i else label)
    ax.set_xlabel("seconds since the run's first start")
    ax.set_ylabel("workers")
    ax.set_title("World size over time")
    ax.set_ylim(bottom=0, top=max([g.workers for g in (account.groups if account else [])] + [1]) * 1.6)
    _legend(ax, loc="upper left")
    ax.grid(alpha=0.3)
    _margins(fig)
    return fig


def _goodput_bars(plt, account: goodput.Account):
    """One stacked bar per worker group (its start-up or downtime, its phases, its lost work), and the whole."""
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(account.groups) + 1.8))
    rows = [(f"group {i + 1} ({g.workers} workers)", g.terms) for i, g in enumerate(account.groups)]
    rows.append(("whole run", account.terms))
    for y, (_, terms) in enumerate(rows):
        left = 0.0
        for term in goodput.TERMS:
            width = max(terms.get(term, 0.0), 0.0)
            ax.barh(y, width, left=left, color=_COLOURS[term], label=term if y == 0 else None,
                    edgecolor="white", linewidth=0.5)
            left += width
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"Where the wall time went (goodput {account.goodput:.1%})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.subplots_adjust(left=0.2, right=0.82, bottom=0.45 / (0.6 * len(rows) + 1.2), top=0.88)
    return fig


def _run_summary(run_dir: str, kept: list[dict], account) -> str:
    last = kept[-1] if kept else {}
    rows = [("run folder", paths.redacted(run_dir)), ("steps", f"{last.get('step')} of {last.get('total_steps')}"),
            ("samples seen", last.get("samples_seen"))]
    finals = {}
    for r in kept:
        finals.update({k: v for k, v in r.items() if k.startswith("val_") and isinstance(v, (int, float))})
    rows += [(f"final {k}", f"{v:.4g}") for k, v in sorted(finals.items())]
    if account:
        rows.append(("goodput", account.line()))
    return "<h2>Run</h2>" + _table(["", ""], rows)


def _goodput_tables(account: goodput.Account) -> str:
    total = account.total_s or 1.0
    rows = [(t, f"{account.terms[t]:.2f}", f"{account.terms[t] / total:.1%}") for t in goodput.TERMS]
    rows.append(("total (wall time)", f"{account.total_s:.2f}", "100%"))
    detail = [(k.replace("_", " "), f"{v:.2f}") for k, v in account.startup_detail.items()]
    inv = [(i["invocation"], i["status"], f"{i['total_s']:.1f}") for i in account.invocations]
    groups = [(str(n + 1), g.invocation, g.workers, f"{g.first_step}-{g.last_step}", g.resumed_from_step,
               "-" if g.restored_by_next is None else g.restored_by_next, f"{g.terms['productive']:.1f}",
               f"{g.terms['lost']:.1f}") for n, g in enumerate(account.groups)]
    return ("<h2>Goodput</h2><p>Share of the wall time (every invocation, from its process start) that made "
            "training progress that was kept.</p>" + _table(["term", "seconds", "share"], rows)
            + "<h3>Start-up, summed over invocations</h3>" + _table(["part", "seconds"], detail)
            + "<h3>Invocations</h3>" + _table(["invocation", "status", "seconds"], inv)
            + "<h3>Worker groups</h3>" + _table(["group", "invocation", "workers", "steps reported", "started from",
                                                 "next restored", "productive s", "lost s"], groups))


# ---------------------------------------------------------------------------------------------------------
# A sweep


def write_sweep_report(sweep_dir: str) -> str:
    import pandas as pd

    plt = _pyplot()
    table = _results_table(sweep_dir)
    fixed = {"trial_id", "status", "epoch", "step", "best_checkpoint", "run_dir", "lr"}
    metric = next((c for c in table.columns if c.startswith("val_")), None)
    keys = [c for c in table.columns if c not in fixed and c != metric]
    figures = {}
    stopped = table["status"].astype(str).str.startswith("stopped")
    for key in keys:
        if metric is None:
            break
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        ax.scatter(table.loc[~stopped, key], table.loc[~stopped, metric], label="trained to the end", zorder=3)
        ax.scatter(table.loc[stopped, key], table.loc[stopped, metric], marker="x", color="#c62828",
                   label="stopped early (ASHA)", zorder=3)
        numeric = pd.to_numeric(table[key], errors="coerce")
        if numeric.notna().all() and (numeric > 0).all() and numeric.max() / numeric.min() >= 20:
            ax.set_xscale("log")
            values = sorted(numeric.unique())  # ticks at the swept values only, written plainly
            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xlabel(key)
        ax.set_ylabel(f"{metric} (last evaluation)")
        ax.set_title(f"{metric} against {key}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        _margins(fig)
        figures[f"{metric}_vs_{key.replace('.', '_')}"] = fig
    if metric is not None:
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        for _, row in table.iterrows():
            kept = latest_per_step(read_jsonl(paths.join(str(row["run_dir"]), METRICS)))
            pts = [(r["epoch"], r[metric]) for r in kept if "epoch" in r and isinstance(r.get(metric), (int, float))]
            if pts:
                label = ", ".join(f"{k}={row[k]}" for k in keys)
                ax.plot(*zip(*pts), "o-", label=label, markersize=4)
                if str(row["status"]).startswith("stopped"):
                    ax.plot(*pts[-1], "x", color="#c62828", markersize=12, mew=2)
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} per trial (x: stopped early by ASHA)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        _margins(fig)
        figures["trials"] = fig
    out = paths.join(sweep_dir, FOLDER)
    pngs = _save(figures, out)
    shown = [c for c in ["trial_id", "status", *keys, "lr", metric, "epoch", "step"] if c in table.columns]
    rows = [[_cell(row[c]) for c in shown] for _, row in table.iterrows()]
    sections = ["<h2>Trials (best first)</h2>" + _table(shown, rows)]
    sections += [f'<h2>{html.escape(name.replace("_", " "))}</h2><img src="data:image/png;base64,{b64}">'
                 for name, b64 in pngs.items()]
    target = paths.join(out, "report.html")
    write_text(target, _page(f"behemoth sweep {os.path.basename(sweep_dir.rstrip('/'))}", sections))
    return target


def _results_table(sweep_dir: str):
    """results.csv as `behemoth tune` writes it, or one line naming it (empty, cut short, not UTF-8, or without
    the columns read here)."""
    import pandas as pd

    path = paths.join(sweep_dir, "results.csv")
    try:  # (pandas' EmptyDataError and ParserError are ValueErrors)
        table = pd.read_csv(io.StringIO(read_text(path) or ""))
    except (UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path} cannot be read as a table ({(str(e).strip() or type(e).__name__).splitlines()[0]})"
                        f": give the sweep folder `behemoth tune` wrote, or a run folder") from None
    missing = [c for c in ("status", "run_dir") if c not in table.columns]
    if missing:
        raise DataError(f"{path} has no {' or '.join(missing)} column (it has: {', '.join(map(str, table.columns))}): "
                        f"not the results.csv `behemoth tune` writes; give the sweep folder it wrote")
    return table


# ---------------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figures: dict, out: str) -> dict[str, str]:
    """Each figure as OUT/NAME.png; returns their base64 for the page."""
    import matplotlib.pyplot as plt

    encoded = {}
    for name, fig in figures.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        data = buf.getvalue()
        write_bytes(paths.join(out, f"{name}.png"), data)
        encoded[name] = base64.b64encode(data).decode()
    return encoded


def _margins(fig, right: float = 0.97) -> None:
    """Fixed margins (tight_layout draws every figure an extra time to measure it)."""
    fig.subplots_adjust(left=0.11, right=right, bottom=0.15, top=0.9)


def _legend(ax, **where) -> None:
    if ax.get_legend_handles_labels()[0]:  # a plot with no data (e.g. no checkpoint yet) has none
        ax.legend(fontsize=8, **where)


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(header, rows) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _page(title: str, sections: list[str]) -> str:
    style = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:left;font-size:13px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>")
