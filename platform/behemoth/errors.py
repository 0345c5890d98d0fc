"""The errors behemoth raises for bad input or a run it cannot finish, and the one line a user sees.

Every room may import this module; it imports nothing of behemoth. Each message names the culprit (file,
row, key, checkpoint) and what to do. `behemoth` (the CLI) prints `user_facing_error(e)` as one line and exits
with 2 for a ConfigError, 1 for the others.
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


class RunFailedError(RuntimeError):
    """A run that Ray Train gave up on (workers kept dying past failure.max_failures). Checkpoints are kept."""


USER_ERRORS = (ConfigError, DataError, BadSampleError, CheckpointError, RunFailedError)


def user_facing_error(exc: BaseException) -> str | None:
    """The innermost behemoth message in an exception and what it wraps (causes, Ray worker failures), or
    None when there is none. Inside a failed Ray Train run behemoth's errors arrive wrapped in Ray's
    exceptions, re-raised as new types whose text holds "BadSampleError: <message>"."""
    found = []
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, USER_ERRORS) and not isinstance(e, ConfigError):
            return str(e)
        text = str(e)
        found += [text[text.rindex(f"{t.__name__}: ") + len(t.__name__) + 2:].splitlines()[0]
                  for t in USER_ERRORS[:4] if f"{t.__name__}: " in text]
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        todo += list((getattr(e, "worker_failures", None) or {}).values())
    return max(found, key=len) if found else None
