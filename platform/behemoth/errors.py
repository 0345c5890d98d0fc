"""The errors behemoth raises for bad input or a run it cannot finish, and the one line a user sees.

Every room may import this module; it imports nothing of behemoth. Each message names the culprit (file,
row, key, checkpoint) and what to do; `did_you_mean` is the one suggestion of the closest valid name.
`behemoth` (the CLI) prints `user_facing_error(e)` as one line and exits with 2 for a ConfigError, 1 for the
others.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A job config that cannot run. The message names the file, the key and the fix."""


class DataError(ValueError):
    """Data that cannot be read. The message names the file or folder and what to do."""


class BadSampleError(RuntimeError):
    """An undecodable sample, with no budget (data.max_bad_samples) left to drop it."""


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged. The message names the directory and the file."""


class PartlyLoadedError(CheckpointError):
    """A checkpoint found damaged while it was being loaded (a chunk read by range), after some of its tensors
    reached the model and optimizer: another checkpoint's load may follow, a fresh start may not."""


class StorageFullError(RuntimeError):
    """A checkpoint that did not fit on its disk. The message names the folder, the space needed and free."""


class NonFiniteError(RuntimeError):
    """A training step whose gradient norm or loss was NaN or Inf, under train.nonfinite: stop. The message
    names the step; nothing after the last good checkpoint is saved. A restart would compute the same."""


class PreemptionExit(RuntimeError):
    """A worker group ending itself for a preemption, its last checkpoint written before the node's deadline (the
    notice's): Ray Train restarts the group from it at once (the driver's failure policy charges it to
    failure.max_preemptions, not max_failures), on the nodes that are left and the replacement."""


class RunFailedError(RuntimeError):
    """A run that Ray Train gave up on (workers kept dying past failure.max_failures). Checkpoints are kept."""


class LeaseLostError(RuntimeError):
    """A driver whose run folder another driver took over (storage/runlock.py): it stops before its next
    registering or deleting step. The message names the folder and the new holder. Also a driver that could not
    renew its lease and gave it up before its expiry: the message names the storage's answer."""


# What other trainers (transformers' TrainingArguments, Lightning, torchtitan) call some of our keys: a misspelt
# or borrowed name is matched against these too, so `learning_rat` suggests `lr`, not `min_lr_ratio`.
KEY_SYNONYMS = {
    "learning_rate": "lr", "batch_size": "global_batch_size", "train_batch_size": "global_batch_size",
    "num_epochs": "epochs", "max_epochs": "epochs", "num_train_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum_steps", "accumulate_grad_batches": "grad_accum_steps",
    "max_grad_norm": "grad_clip", "gradient_clip_val": "grad_clip", "warmup": "warmup_steps",
    "mixed_precision": "precision", "optim": "optimizer", "workers": "num_workers",
}


def closest_key(key: str, names: list[str]) -> str | None:
    """The valid name a mistyped `key` most likely meant (None: nothing is close), synonyms included."""
    import difflib

    synonyms = {alias: name for alias, name in KEY_SYNONYMS.items() if name in names}
    close = difflib.get_close_matches(key, [*names, *synonyms], n=1, cutoff=0.5)
    return synonyms.get(close[0], close[0]) if close else None


def did_you_mean(key: str, names: list[str], prefix: str = "") -> str:
    """"; did you mean 'PREFIX<closest>'?" for an error message, or "" when no valid name is close. The one
    did-you-mean of behemoth (config keys, choices, model names, task kinds, sweep keys)."""
    close = closest_key(str(key), [str(n) for n in names])
    return f"; did you mean '{prefix}{close}'?" if close else ""


USER_ERRORS = (ConfigError, DataError, BadSampleError, CheckpointError, StorageFullError, RunFailedError,
               LeaseLostError, NonFiniteError)


# What a retry cannot fix: the same config or the same data fails the same way on every restart of the worker
# group, and a full disk stays full (a restart would redo the steps since the last checkpoint and fail on the
# same write), a folder another driver took over stays taken, and a step that went non-finite goes so again from
# the same checkpoint (exact resume), so a run ends on them at once, without using failure.max_failures
# (driver/ray_cluster/failure_policy.py).
NOT_RETRIED = (ConfigError, DataError, BadSampleError, StorageFullError, LeaseLostError, NonFiniteError)


def user_facing_error(exc: BaseException, kinds: tuple = USER_ERRORS) -> str | None:
    """The innermost behemoth message (of one of `kinds`) in an exception and what it wraps (causes, Ray worker
    failures), or None when there is none. Inside a failed Ray Train run behemoth's errors arrive wrapped in
    Ray's exceptions, re-raised as new types whose text holds "BadSampleError: <message>"."""
    named = tuple(t for t in kinds if t is not RunFailedError)  # the driver's summary: never in worker text
    found = []
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kinds) and not isinstance(e, ConfigError):
            return str(e)
        text = str(e)
        found += [text[text.rindex(f"{t.__name__}: ") + len(t.__name__) + 2:].splitlines()[0]
                  for t in named if f"{t.__name__}: " in text]
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        todo += list((getattr(e, "worker_failures", None) or {}).values())
    return max(found, key=len) if found else None
