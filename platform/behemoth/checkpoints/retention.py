"""Which of a run's checkpoints are kept (checkpoint.keep), and the removal of those Ray Train never registered.

A TorchTrainer's run keeps its checkpoints through Ray Train's checkpoint manager (its CheckpointConfig, made
by driver/run/resume.retention with the same rule); a sweep's lane applies `kept_indices` itself
(hosts/lane.py); every run's driver removes, when it ends, the complete checkpoints nobody registered
(`retire_unregistered`).
"""

from __future__ import annotations

from behemoth.metrics import CHECKPOINT_SCORE, checkpoint_score


def kept_indices(reported: list[dict], keep: int, order: str) -> list[int]:
    """Which of a run's checkpoints (their reports' metrics, in report order) checkpoint.keep keeps, as Ray Train
    applies it: the `keep` best by score (`order`: the run metric's "max" or "min"; one without a score ranks
    worst), a tie to the newer, and the latest whatever its score (a rerun resumes from it). Indices, in report
    order."""
    sign = 1 if order == "max" else -1
    best = sorted(range(len(reported)),
                  key=lambda i: (sign * checkpoint_score(reported[i].get(CHECKPOINT_SCORE), order), i))[-keep:]
    return sorted({*best, len(reported) - 1} if reported else set())


def retire_unregistered(place, kept: list, fence=None) -> list[str]:
    """Apply checkpoint.keep to the checkpoints Ray Train does not know: complete ones in the run folder (`place`:
    storage.paths.RunPlace) that it never registered (a driver or worker died between their upload and their
    registration; a rerun resumed from them) and that are older than every checkpoint it keeps (`kept`: the
    finished run's (checkpoint, metrics)). Retention would have deleted them had Ray Train known them; without
    this they stay forever. Returns the folders removed. `fence`: the run lock's (runlock.Fence), checked first:
    a driver whose folder another driver took over removes nothing there."""
    from behemoth.storage.run_store import RunStore

    if fence is not None:
        fence.check("removing the checkpoints Ray Train never registered")
    kept_paths = {place.as_uri(c.path).rstrip("/") for c, _ in kept}
    run = RunStore.at(place.folder)
    found = run.complete()  # (as the place names them: URIs for a URI's, as as_uri names the kept ones)
    kept_steps = [step for step, path in found if path.rstrip("/") in kept_paths]
    if not kept_steps:
        return []
    oldest_kept, removed = min(kept_steps), []
    for step, path in found:
        # (step -1: its train state could not be read, which a passing network error also gives: kept, not
        # judged; restoring it names the problem)
        if 0 <= step < oldest_kept and path.rstrip("/") not in kept_paths:
            run.delete(path)
            removed.append(path)
            print(f"[behemoth] removed {path} (step {step}): a checkpoint Ray Train never registered, older than "
                  f"the {len(kept_steps)} it keeps (checkpoint.keep)", flush=True)
    return removed
