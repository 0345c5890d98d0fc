"""Driver side: what a run's rerun resumes from, checked before Ray starts, and checkpoint.keep as Ray Train's
CheckpointConfig (public: a run through Ray Train and a sweep's lane both call these).

- `run_place` / `run_dir`: where a job's run lives (storage/paths.RunPlace).
- `resumed_job`: the checkpoint a rerun resumes from and its job.yaml, read as export reads one (manifest first).
- `check_resume_compatible`: a rerun trained on another data or model config is refused (names each change).
- `describe_rerun`: what a rerun's changed train.* / scaling.* keys do; another optimizer is refused.
- `check_resume_data`: a rerun whose data now means something else (a class folder renamed) is refused.
- `resolve_init_from`: train.init_from resolved once to the folder every worker and restart loads.
- `retention`: checkpoint.keep as Ray Train's CheckpointConfig (the best by the run's metric, and the latest); the
  rule itself, and the removal of complete checkpoints Ray Train never registered, are the checkpoints room's
  (checkpoints/retention.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from behemoth.config import JobConfig
from behemoth.errors import CheckpointError, ConfigError
from behemoth.storage import paths
from behemoth.tasks import run_metric, task_of

# Keys that may change between a run and its resumption: they change speed or bookkeeping, not what is learnt.
_RESUMABLE_CHANGES = {"data.prefetch_batches", "data.cpus_per_task", "data.max_bad_samples"}


def run_place(cfg: JobConfig) -> paths.RunPlace:
    """Where the job's run lives (its storage and checked name): every path of the run is joined through it."""
    return paths.RunPlace.of(cfg.checkpoint.storage_path, cfg.checkpoint.run_name)


def run_dir(cfg: JobConfig) -> str:
    """The job's run folder (local: absolute; or a URI)."""
    return run_place(cfg).folder


def resumed_job(cfg: JobConfig, checkpoints: list[tuple[int, str]] | None = None) -> tuple[str, dict] | None:
    """(the checkpoint a rerun resumes from, its job.yaml's sections), or None for a new run. Its job.yaml is read
    as export reads a received one: checked against the manifest first (storage/checkpoint.job_sections). A
    checkpoint whose job.yaml fails that check is damaged, and restore skips it for an older one: so does this.
    One that passes it but is not a job config (`train: [1]`) was written so: one line naming it.
    `checkpoints`: the run folder's complete checkpoints, where the caller listed them (run/sequence.py)."""
    from behemoth.storage.checkpoint import job_sections, read_verified

    for _, ckpt in _listed(cfg, checkpoints):
        try:
            data = read_verified(ckpt, "job.yaml")
            read_verified(ckpt, "train_state.json")  # (describe_rerun reads its step: damage skips it too)
        except CheckpointError:
            continue
        return ckpt, job_sections(data, ckpt)
    return None


def _listed(cfg: JobConfig, checkpoints: list[tuple[int, str]] | None) -> list[tuple[int, str]]:
    """The run folder's complete checkpoints, newest first: the caller's listing, or listed now."""
    from behemoth.storage.checkpoint import complete_checkpoints

    return complete_checkpoints(run_dir(cfg)) if checkpoints is None else checkpoints


_LOOK = object()  # (a rerun's checkpoint not given: look it up)


def _section(before: dict, section: str) -> dict:
    return before.get(section) or {}


def check_resume_compatible(cfg: JobConfig, latest=_LOOK) -> None:
    """Refuse to resume a run whose latest checkpoint (local or under a URI) was trained on another data or
    model config. (A change of scaling.strategy is fine: either checkpoint layout loads under DDP and FSDP.)
    `latest`: resumed_job's answer, where the caller has it."""
    if cfg.checkpoint.resume_changed_config:
        return
    latest = resumed_job(cfg) if latest is _LOOK else latest
    if latest is None:
        return
    (latest, before), folder = latest, run_dir(cfg)
    name = latest.rstrip("/").rpartition("/")[2]
    now = cfg.to_dict()
    changed = [f"{section}.{key}: {_section(before, section).get(key)!r} -> {value!r}"
               for section in ("data", "model") for key, value in now[section].items()
               if _section(before, section).get(key) != value and f"{section}.{key}" not in _RESUMABLE_CHANGES]
    if changed:
        raise ConfigError(
            f"run '{cfg.checkpoint.run_name}' in {folder} was trained with a different config "
            f"({name}): {'; '.join(changed)}. Set them back to resume it as it was trained, start a new run with "
            f"another checkpoint.run_name, or resume anyway with --set checkpoint.resume_changed_config=true"
        )


# What a rerun's changed train.* / scaling.* keys do from the step it resumes at (every other one applies):
# the optimizer's settings come back with its state; the data position is counted in steps of the global batch
# and the epoch's order drawn from the seed, so changing those would skip or repeat samples (refused unless
# checkpoint.resume_changed_config, which lets through just that); another optimizer cannot load the
# checkpoint's state at all (refused, whatever the config: a new run with train.init_from starts it fresh).
_IGNORED_ON_RESUME = {
    **dict.fromkeys(("train.lr", "train.momentum", "train.weight_decay", "train.adam_betas", "train.adam_eps"),
                    "the optimizer's settings come back with its state from the checkpoint"),
    **dict.fromkeys(("train.init_from", "train.init_from_checkpoint"), "init_from decides only how a run starts"),
}
_REFUSED_ON_RESUME = {
    "train.global_batch_size": "the position in the data is counted in steps of the global batch",
    "train.seed": "the order of the epoch in progress, and the augmentation, are drawn from the seed",
}
_NEVER_ON_RESUME = {
    "train.optimizer": "the checkpoint holds the other optimizer's state, which this one cannot load",
}


@dataclass
class Rerun:
    """How a rerun's config differs from its latest checkpoint's in train.* and scaling.* (`key: a -> b` each)."""

    step: int
    applied: list[str]
    ignored: list[str]  # with why

    def line(self, cfg: JobConfig) -> str:
        parts = [f"rerun of run '{cfg.checkpoint.run_name}' from step {self.step}"]
        if self.applied:
            parts.append(f"changed keys that apply from step {self.step}: {'; '.join(self.applied)}")
        if self.ignored:
            parts.append(f"ignored: {'; '.join(self.ignored)}")
        return ". ".join(parts) + f". {_new_run_hint(cfg)}"


def check_something_trained(cfg: JobConfig, rerun: Rerun | None, summary) -> None:
    """A rerun of a complete run trains nothing: where it was asked changes it ignored, it says so and fails
    (exit 2), so that a changed train.lr is never taken for a run that used it (docs/running.md)."""
    if rerun is None or not rerun.ignored or summary.metrics.get("step") != summary.resumed_from_step:
        return
    raise ConfigError(f"run '{cfg.checkpoint.run_name}' was already complete at step {summary.resumed_from_step}: "
                      f"nothing was trained, and {'; '.join(rerun.ignored)}. {_new_run_hint(cfg)}")


def _new_run_hint(cfg: JobConfig) -> str:
    return (f"To start a new run with these settings instead: --set checkpoint.run_name=NEW_NAME (and "
            f"--set train.init_from={run_dir(cfg)} to start from this run's weights)")


def describe_rerun(cfg: JobConfig, latest=_LOOK) -> Rerun | None:
    """The changes a rerun makes to train.* and scaling.*, or None (a new run, or none changed). A change that
    would skip or repeat samples (_REFUSED_ON_RESUME) is refused, unless checkpoint.resume_changed_config; another
    optimizer (_NEVER_ON_RESUME) is refused whatever the config: its state cannot load (KeyError in every worker,
    retried as a run failure). `latest`: resumed_job's answer, where the caller has it."""
    from behemoth.storage.checkpoint import verified_state

    latest = resumed_job(cfg) if latest is _LOOK else latest
    if latest is None:
        return None
    (ckpt, before), now, applied, ignored, refused = latest, cfg.to_dict(), [], [], []
    for section in ("train", "scaling"):
        for key, value in now[section].items():
            old = _section(before, section).get(key, value)
            if old == value:
                continue
            name, change = f"{section}.{key}", f"{section}.{key} {old!r} -> {value!r}"
            if name in _NEVER_ON_RESUME:
                raise ConfigError(f"run '{cfg.checkpoint.run_name}' in {run_dir(cfg)} cannot resume with {change} "
                                  f"({_NEVER_ON_RESUME[name]}; checkpoint.resume_changed_config does not change "
                                  f"that). {_new_run_hint(cfg)}")
            if name in _REFUSED_ON_RESUME:
                refused.append(f"{change} ({_REFUSED_ON_RESUME[name]})")
            elif name in _IGNORED_ON_RESUME:
                ignored.append(f"{change} ({_IGNORED_ON_RESUME[name]})")
            else:
                applied.append(change)
    if refused and not cfg.checkpoint.resume_changed_config:
        raise ConfigError(f"run '{cfg.checkpoint.run_name}' in {run_dir(cfg)} cannot resume with {'; '.join(refused)}. "
                          f"{_new_run_hint(cfg)}; or resume anyway with --set checkpoint.resume_changed_config=true")
    applied += [f"{r}, applied anyway (checkpoint.resume_changed_config)" for r in refused]
    if not (applied or ignored):
        return None
    return Rerun(verified_state(ckpt).step, applied, ignored)


def check_resume_data(cfg: JobConfig, prepared, checkpoints: list[tuple[int, str]] | None = None) -> None:
    """Refuse to resume a run whose data now says something else of what its weights mean: the task's files
    in the latest checkpoint (classes.json: class index -> name) differ from those this data gives. The data
    config can be unchanged while its content is not: a class folder renamed or replaced keeps the count and
    moves names to other indices, so the resumed run would train on with its labels silently renamed (a class
    added or removed changes the head's shape: its weights cannot load). checkpoint.resume_changed_config does
    not let either through: it is about changed config keys, and no key changed here."""
    # newest first; one whose task files fail their manifest is damaged: restore skips it
    for _, ckpt in _listed(cfg, checkpoints):
        try:
            differs = task_files_differ(cfg, prepared, ckpt)
            break
        except CheckpointError:
            continue
    else:
        return
    if differs:
        what, same_shape = differs
        # the same count: its weights would load, every class's learnt output then named as another
        why = {True: " (its weights would train on with their labels renamed)", None: "",
               False: " (its weights cannot resume with another number of classes)"}[same_shape]
        name = ckpt.rstrip("/").rpartition("/")[2]
        raise ConfigError(
            f"run '{cfg.checkpoint.run_name}' in {run_dir(cfg)} was trained on other data ({name}): {what}. "
            f"Start a new run with another checkpoint.run_name (train.init_from the old run's folder to start "
            f"from its weights){why}")


def task_files_differ(cfg: JobConfig, prepared, ckpt: str) -> tuple[str, bool | None] | None:
    """How checkpoint `ckpt`'s task files (Task.checkpoint_files) differ from those `prepared` gives, and
    whether their lists keep their length (None: a file that is not a list, a chat template); None where they
    agree or the checkpoint keeps none (written before the task kept them, or a Hugging Face folder). Each is checked against the manifest first: a damaged or
    edited one raises CheckpointError naming it (compared as it is, it would read as other data)."""
    from behemoth.storage import weights
    from behemoth.storage.checkpoint import read_manifest, read_manifest_bytes, read_verified

    ckpt = ckpt.rstrip("/")
    if not weights.is_checkpoint(ckpt):
        return None
    manifest = read_manifest(read_manifest_bytes(ckpt, None, ckpt), ckpt)
    for file, text in task_of(cfg).checkpoint_files(cfg, prepared).items():
        if file not in manifest["files"]:
            continue
        before = read_verified(ckpt, file, manifest=manifest).decode()
        if before == text:
            continue
        try:
            old, new = json.loads(before), json.loads(text)
        except ValueError:
            old = new = None
        if not (isinstance(old, list) and isinstance(new, list)):
            return f"its {file} differs from this data's (the run's is {ckpt}/{file})", None
        if old == new:
            continue  # the same list, written another way
        moved = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        detail = [f"its {file} lists {len(old)}, this data {len(new)}"]
        if moved < min(len(old), len(new)):
            detail.append(f"index {moved} was {old[moved]!r}, is {new[moved]!r}")
        for label, names in (("new", [n for n in new if n not in old]), ("gone", [n for n in old if n not in new])):
            if names:
                detail.append(f"{label}: {', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''}")
        return "; ".join(detail), len(old) == len(new)
    return None


def resolve_init_from(cfg: JobConfig, checkpoints: list[tuple[int, str]] | None = None) -> JobConfig:
    """train.init_from -> the one folder its weights come from (a run folder: its best or latest checkpoint),
    chosen once here so that every worker, and every restart, starts from the same weights; the run's
    checkpoints record the chosen folder in their job.yaml."""
    import dataclasses

    from behemoth.storage import weights

    source = cfg.train.init_from
    if not source:
        return cfg
    task = task_of(cfg)
    chosen, how = weights.resolve(source, cfg.train.init_from_checkpoint, task.best, task.reported)
    weights.check(chosen)  # damage it can see without the weights fails here, before Ray starts
    if _listed(cfg, checkpoints):
        print(f"[behemoth] train.init_from is set, but run '{cfg.checkpoint.run_name}' has checkpoints of its own: "
              f"it resumes from them (init_from decides only how a run starts)", flush=True)
    else:
        print(f"[behemoth] init_from {source}: {chosen} ({how})", flush=True)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=chosen))


def retention(cfg: JobConfig):
    """checkpoint.keep as Ray Train's CheckpointConfig: the `keep` best checkpoints by the run's metric (each
    checkpoint's report carries its score: metrics.CHECKPOINT_SCORE; one without an evaluation ranks below every
    evaluated one, the newer above the older: Ray's ties) and, whatever its score, the latest, which a rerun
    resumes from (Ray Train 2.60's checkpoint manager never deletes its latest).
    Newest-K alone would rotate the best out of a run that stops early (patience 3, keep 3: the 3 checkpoints
    after the best are kept). A lane keeps the same ones (checkpoints/retention.kept_indices, which hosts/lane.py
    applies)."""
    from ray.train import CheckpointConfig

    from behemoth.metrics import CHECKPOINT_SCORE

    return CheckpointConfig(num_to_keep=cfg.checkpoint.keep, checkpoint_score_attribute=CHECKPOINT_SCORE,
                            checkpoint_score_order=run_metric(task_of(cfg), cfg)[1])
