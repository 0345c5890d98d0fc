"""The run's tokenizer kept in every checkpoint (its `tokenizer/` folder: the files the tokenizer saves, the chat
template it was trained with included), and the job config `behemoth export` and `generate` build from: with
that copy in place of the paths the checkpoint's job.yaml names.

Why: a checkpoint may come from someone else, and its job.yaml is only data. Read from the path it names, a
"tokenizer" or "chat template" is whatever file that path reaches on the exporting machine (a credentials file
copied into the export as chat_template.jinja), and even the run's own file may have been edited or deleted
since the run. The kept copy is checked against the manifest like every other file of the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from behemoth.config import JobConfig
from behemoth.errors import ConfigError

KEPT_FOLDER = "tokenizer"


def kept_tokenizer_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """A checkpoint's files for a tokenizer saved as data/chat/chat.tokenizer_files saves it."""
    return {f"{KEPT_FOLDER}/{name}": data for name, data in files.items()}


def write_kept_tokenizer(ckpt: str, folder: Path) -> Path | None:
    """The checkpoint's kept tokenizer written into folder/tokenizer, each file checked against the manifest
    first (a damaged or edited one is a CheckpointError naming it); None where it keeps none (written by a
    behemoth before it kept one). The manifest's names were checked to stay inside the checkpoint's folder."""
    from behemoth.storage.checkpoint import read_manifest, read_manifest_bytes, read_verified

    manifest = read_manifest(read_manifest_bytes(ckpt, None, ckpt), ckpt)
    names = [name for name in manifest["files"] if name.startswith(KEPT_FOLDER + "/")]
    if not names:
        return None
    for name in names:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read_verified(ckpt, name, manifest=manifest))
    return folder / KEPT_FOLDER


def with_kept_tokenizer(cfg: JobConfig, ckpt: str, folder: Path, named: dict[str, str | None],
                        chat: bool = False) -> JobConfig:
    """`cfg` (a checkpoint's job) with data.tokenizer (and with `chat` data.chat_template) the checkpoint's kept
    copy, or what the user named on the command line (`named`: tokenizer, chat_template; it wins where given).
    A checkpoint that keeps none gets only what the user named: a path its job.yaml names is never read, so the
    key left unnamed is one ConfigError saying which flag names it."""
    kept = write_kept_tokenizer(ckpt, folder)
    tokenizer = named.get("tokenizer") or (str(kept) if kept is not None else None)
    if tokenizer is None:
        raise ConfigError(_unnamed(ckpt, "tokenizer", cfg.data.tokenizer))
    data = {"tokenizer": tokenizer}
    if chat:
        data["chat_template"] = named.get("chat_template") or _kept_template(cfg, ckpt, kept)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))


def _kept_template(cfg: JobConfig, ckpt: str, kept: Path | None) -> str:
    """data.chat_template as the export reads it without a --chat-template: the kept tokenizer's template file
    (it was saved with the run's template set; a --tokenizer of the user's gets it too), else its own; for a
    checkpoint that keeps none, `chatml` or the named tokenizer's own where the job says so. A file the job.yaml
    names is refused."""
    if kept is not None:
        template = kept / "chat_template.jinja"
        return str(template) if template.is_file() else ""
    if cfg.data.chat_template in ("", "chatml"):
        return cfg.data.chat_template
    raise ConfigError(_unnamed(ckpt, "chat template", cfg.data.chat_template, flag="--chat-template"))


def _unnamed(ckpt: str, what: str, given: str, flag: str = "--tokenizer") -> str:
    return (f"checkpoint {ckpt} keeps no copy of the run's {what} (written before behemoth kept one in each "
            f"checkpoint), and behemoth reads no file a checkpoint's job.yaml names (it names {given!r}): if that "
            f"is the run's {what}, name it yourself: {flag} PATH")
