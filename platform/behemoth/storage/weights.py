"""Model weights in and out: which folder to read them from (a behemoth checkpoint, a run
folder's best or latest checkpoint, a Hugging Face folder), reading them without running code, and loading
them into a freshly built model where every tensor must fit but a classification head of another size.

Used by fine-tuning (train.init_from, worker side), `behemoth eval` and `behemoth export` (driver side).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn, Optional

from behemoth.storage.checkpoint import (MANIFEST, SHARDED_FORMATS, complete_checkpoints, job_sections, read_manifest,
                                         read_verified, verify, weight_files)
from behemoth.storage.filesystem import filesystem, is_uri, read_file
from behemoth.storage.paths import is_inside
from behemoth.errors import CheckpointError

if TYPE_CHECKING:  # imported where used: reading a job config imports this module, and needs no torch
    import torch

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def is_checkpoint(path: str | Path) -> bool:
    return _is_file(f"{path}/{MANIFEST}")


def is_hf_folder(path: str | Path) -> bool:
    return _is_file(f"{path}/config.json") and any(_is_file(f"{path}/{name}") for name in HF_WEIGHT_FILES)


def _is_file(path: str) -> bool:
    """A local path or a URI (s3://...): read through pyarrow's filesystem."""
    import pyarrow.fs

    fs, where = filesystem(path)
    return fs.get_file_info(where).type == pyarrow.fs.FileType.File


@contextlib.contextmanager
def fetched(path: str) -> Iterator[Path]:
    """A weights folder as a local path while the block runs. A URI's (s3://...) is downloaded into a temporary
    folder, removed afterwards: of a checkpoint only its manifest and the files holding the weights (model.pt;
    a sharded checkpoint's state/ folder), of a Hugging Face folder every file."""
    if not is_uri(path):
        yield Path(path)
        return
    from behemoth.storage.model_copy import checked_listing, download
    from behemoth.storage.node_copy import _copy

    fs, where = filesystem(path)
    with tempfile.TemporaryDirectory(prefix="behemoth-weights-") as target:
        # file by file, by checked names: pyarrow's copy_files copies a name the store holds as a folder (keys
        # below it, no object) whole, and writes keys with '..' parts as named, outside `target`
        if is_checkpoint(path):
            text = read_file(f"{path}/{MANIFEST}")
            Path(target, MANIFEST).write_bytes(text)
            for name in weight_files(read_manifest(text, path)):  # (the manifest's names are checked there)
                Path(target, name).parent.mkdir(exist_ok=True)  # a sharded checkpoint's state/
                # (its sha256: checked by the reader)
                _copy(fs, f"{where}/{name}", Path(target, name), f"checkpoint {path}", name)
        else:
            download(fs, where, checked_listing(fs, where, path, CheckpointError), Path(target), path)
        yield Path(target)


def resolve(path: str, which: str = "best", best: tuple[str, str] = ("val_loss", "min"),
            reported: dict[str, str] | None = None) -> tuple[str, str]:
    """(the folder holding the weights, how it was chosen) for a checkpoint folder, a Hugging Face folder or a
    run folder, local or under a URI; of a run's complete checkpoints `which` picks the best by `best`
    (metric, "max"/"min") among those whose metrics.json records it, or the latest. `reported` (a task's
    metrics and their directions): where the run judged itself by another of them (train.early_stopping.metric
    in the job its newest checkpoint records), by that one, as its retention kept its checkpoints and its
    summary named the best."""
    import pyarrow.fs

    uri = is_uri(path)
    fs, where = filesystem(path if uri else Path(path).expanduser())
    if fs.get_file_info(where).type != pyarrow.fs.FileType.Directory:
        raise CheckpointError(f"{path} does not exist (or is not a folder): give a checkpoint folder, a run "
                              f"folder or a Hugging Face model folder")
    p = path if uri else str(Path(path).expanduser().resolve())
    if is_checkpoint(p) or is_hf_folder(p):
        return p, "as given"
    found = complete_checkpoints(p)  # (step, path), newest first
    if not found:
        raise CheckpointError(f"{path} is not a behemoth checkpoint (no {MANIFEST}), not a run folder with a "
                              f"complete checkpoint_* folder, and not a Hugging Face folder (config.json and "
                              f"{' or '.join(HF_WEIGHT_FILES)})")
    latest = f"its latest checkpoint (step {found[0][0]})"
    if which == "latest":
        return found[0][1], latest
    metric, mode = _run_metric(found[0][1], reported) or best
    # a diverged evaluation (NaN, inf) or a hand-edited value is no score: left out, never the best (retention
    # ranks it worst, behemoth.metrics.checkpoint_score)
    scored = [(m[metric], step, ckpt) for step, ckpt in found
              if _is_score(m := checkpoint_metrics(ckpt), metric)]
    if not scored:
        return found[0][1], f"{latest}: none of its checkpoints records {metric} as a finite number"
    # ties go to the later checkpoint
    value, step, ckpt = max(scored, key=lambda s: (s[0] if mode == "max" else -s[0], s[1]))
    return ckpt, f"its best checkpoint by {metric} ({value:.4f}, step {step})"


def _run_metric(ckpt: str, reported: dict[str, str] | None) -> tuple[str, str] | None:
    """The metric (and direction) the run of checkpoint `ckpt` judged itself by, where its job set
    train.early_stopping.metric to one of `reported`; None otherwise (or where its job cannot be read: verified
    against its manifest first, as everything read from a checkpoint)."""
    if not reported:
        return None
    try:
        raw = job_sections(read_verified(ckpt, "job.yaml"), ckpt)
    except (OSError, CheckpointError):
        return None
    rule = (raw.get("train") or {}).get("early_stopping")
    metric = rule.get("metric") if isinstance(rule, dict) else None
    return (metric, reported[metric]) if isinstance(metric, str) and metric in reported else None


def _is_score(metrics: dict, metric: str) -> bool:
    value = metrics.get(metric)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check(folder: str) -> None:
    """Before Ray starts, without loading the weights: a checkpoint's weight files (model.pt, or a sharded
    checkpoint's state/ files) must match its manifest (a Hugging Face folder has none; its files are read
    when the model loads them). Local files are hashed; under a URI they are not downloaded for this (each
    worker that reads them checks their sha256 before loading, or that of each chunk it reads of a sharded
    checkpoint's shard files): here the manifest must list them and their sizes must be the manifest's."""
    if not is_checkpoint(folder):
        return
    manifest = read_manifest(read_file(f"{folder}/{MANIFEST}"), folder)
    names = weight_files(manifest)
    if not is_uri(folder):
        verify(folder, only=names)
        return
    import pyarrow.fs

    for name in names:
        expected = manifest["files"].get(name)
        if expected is None:
            raise CheckpointError(f"checkpoint {folder}: {name} not in its {MANIFEST}")
        fs, where = filesystem(f"{folder}/{name}")
        info = fs.get_file_info(where)
        if info.type != pyarrow.fs.FileType.File:
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
        if info.size != expected["size"]:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its manifest (size {info.size}, "
                                  f"manifest {expected['size']})")


def checkpoint_metrics(ckpt: str | Path) -> dict:
    """What a run reported with a checkpoint ({} for checkpoints written before behemoth recorded it)."""
    try:
        metrics = json.loads(read_file(f"{ckpt}/metrics.json"))
    except (OSError, ValueError):  # (a UnicodeDecodeError is a ValueError)
        return {}
    return metrics if isinstance(metrics, dict) else {}


def read_state_dict(path: str | Path) -> dict:
    """A model state dict, read without running code: a checkpoint's model.pt (verified against its manifest
    first), or a Hugging Face folder's safetensors (one file or shards) or pytorch_model.bin (weights_only).
    A URI's folder is downloaded first, and removed once read (`fetched`); of a sharded checkpoint with its
    chunk hashes, only its index, and of its shard files the model's bytes, by range (checked chunk by chunk)."""
    if is_uri(str(path)) and is_checkpoint(path):
        from behemoth.storage import shard_reader  # DCP's modules: only when one is read

        fs, where = filesystem(str(path))
        remote = shard_reader.remote_shards(fs, where, str(path))
        if remote is not None:
            with tempfile.TemporaryDirectory(prefix="behemoth-weights-") as target:
                remote.download_rest(target, only=(shard_reader.INDEX_FILE,))
                verify(target, only=(shard_reader.INDEX_FILE,))
                return shard_reader.read_sharded_weights(target, remote)
    with fetched(str(path)) as p:
        return _read_state_dict(p, path)


def _read_state_dict(p: Path, path: str | Path) -> dict:
    import torch

    if is_checkpoint(p):
        manifest = read_manifest((p / MANIFEST).read_bytes(), p)
        verify(p, only=weight_files(manifest))
        if manifest["format_version"] in SHARDED_FORMATS:
            from behemoth.storage.shard_reader import read_sharded_weights  # DCP's modules: only when one is read

            return read_sharded_weights(p)
        (weights,) = weight_files(manifest)  # the weight average where the run kept one (train.ema_decay)
        return torch.load(p / weights, map_location="cpu", weights_only=True)
    if (p / "model.safetensors").is_file():
        return _load_safetensors(p / "model.safetensors", f"{path}/model.safetensors")
    if (p / "model.safetensors.index.json").is_file():
        return {k: v for shard in _index_shards(p, path)
                for k, v in _load_safetensors(p / shard, f"{path}/{shard}").items()}
    if (p / "pytorch_model.bin").is_file():
        return torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"{path}: no model weights found (a checkpoint's {MANIFEST} and model.pt, or "
                          f"{' / '.join(HF_WEIGHT_FILES)})")


def _load_safetensors(file: Path, where: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_safetensors(file, where)
    try:
        return load_file(file)
    except SafetensorError as e:  # damage the header check cannot see (a tensor's bytes that do not fit its dtype)
        raise CheckpointError(f"{where} is damaged ({e}): copy it again from where it came from") from None


def check_hf_weights(folder: str | Path) -> None:
    """A local Hugging Face folder's safetensors files (model.safetensors, or the shards its index names), each
    checked as `check_safetensors` does, before transformers reads them (a URI's are checked once fetched)."""
    if is_uri(str(folder)):
        return
    p = Path(folder)
    if (p / "model.safetensors").is_file():
        check_safetensors(p / "model.safetensors", f"{folder}/model.safetensors")
    elif (p / "model.safetensors.index.json").is_file():
        for shard in _index_shards(p, folder):
            check_safetensors(p / shard, f"{folder}/{shard}")


def check_safetensors(file: Path, where: str) -> None:
    """A safetensors file's header and the tensor bytes it promises, checked without loading them: a copy cut
    short, or the Git LFS pointer a clone without LFS leaves in its place, otherwise fails deep in safetensors
    as "header too large" or "incomplete metadata", naming no file."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(64)
            length = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
            header = None
            if 0 < length <= size - 8:
                f.seek(8)
                header = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{where} cannot be read ({e.strerror or e})") from None
    if head.startswith(b"version https://git-lfs"):
        raise CheckpointError(f"{where} is a Git LFS pointer, not the weights: run `git lfs pull` in the clone it "
                              f"comes from (or download the file itself)")
    if header is None:
        _damaged(where, f"{size} bytes, too few for the header it announces")
    try:
        tensors = json.loads(header)
        end = max((t["data_offsets"][1] for k, t in tensors.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        _damaged(where, "its header is not safetensors' JSON")
    if not isinstance(end, int):
        _damaged(where, "its header is not safetensors' JSON")
    if 8 + length + end > size:
        _damaged(where, f"{size} bytes, where its header promises {8 + length + end}")


def _damaged(where: str, why: str) -> NoReturn:
    raise CheckpointError(f"{where} is damaged ({why}: cut short, or not a safetensors file): copy it again from "
                          f"where it came from") from None


def _index_shards(p: Path, path: str | Path) -> list[str]:
    """The shard files a Hugging Face folder's model.safetensors.index.json names, each checked to stay inside
    the folder: they are joined onto it and read, so '..' or an absolute name would load weights from elsewhere."""
    index = "model.safetensors.index.json"
    shards = sorted(set(json.loads((p / index).read_text())["weight_map"].values()), key=str)
    for shard in shards:
        if not is_inside(shard):
            raise CheckpointError(f"{path}/{index} names the shard {shard!r}, which is not a file inside its "
                                  f"folder (absolute, or with a '..' or empty part): name each shard by its "
                                  f"path inside the folder")
    return shards


# (key, tensor of the model, tensor of the source) -> may this key keep its fresh initialisation
ReinitPolicy = Callable[[str, "torch.Tensor", "torch.Tensor"], bool]


def frozen_names(model) -> set[str]:
    """The names of a LoRA model's parameters that do not train (its base; empty for a model without adapters),
    every name of a tied one: a frozen output layer tied to the embedding is under both, and named_parameters'
    default lists it once (its second name was kept in every checkpoint, then expected on load)."""
    if not hasattr(model, "peft_config"):  # (models/lora.is_adapted: this room does not import models)
        return set()
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def load_weights(model: torch.nn.Module, source: dict, where: str,
                 reinit_ok: Optional[ReinitPolicy] = None) -> list[str]:
    """Load `source` into `model`. Every tensor of the model must come from the source by name and shape,
    except those `reinit_ok` lets keep their fresh initialisation (returned), and parameters tied to one that
    does (a language model's output layer tied to its embedding: Hugging Face files store it once)."""
    own = model.state_dict()
    reinit = [k for k in own if k in source and source[k].shape != own[k].shape
              and reinit_ok is not None and reinit_ok(k, own[k], source[k])]
    wrong_shape = [f"{k} {tuple(source[k].shape)} (model: {tuple(own[k].shape)})" for k in own
                   if k in source and source[k].shape != own[k].shape and k not in reinit]
    tied = _tied_to_present(own, source)
    # a LoRA model (model.lora): its checkpoints hold what trains; the frozen base is the model's, as built
    frozen = frozen_names(model)
    missing = [k for k in own if k not in source and k not in tied and k not in frozen]
    unexpected = [k for k in source if k not in own]
    problems = [f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                for label, keys in (("other shape", wrong_shape), ("missing", missing),
                                    ("not in the model", unexpected)) if keys]
    if problems:
        raise CheckpointError(f"{where}: its weights do not fit the model this job builds ({'; '.join(problems)}): "
                              f"use the model config the weights were trained with")
    model.load_state_dict({k: v for k, v in source.items() if k not in reinit}, strict=False)
    return reinit


def classification_head(num_classes: int) -> ReinitPolicy:
    """The re-initialisation policy of a classifier (image or text): only the head for another number of classes, i.e. a
    tensor whose first dimension is this model's class count where the source's is another, all else equal."""

    def head(key: str, own: torch.Tensor, source: torch.Tensor) -> bool:
        return (own.dim() == source.dim() and own.shape[0] == num_classes != source.shape[0]
                and own.shape[1:] == source.shape[1:])

    return head


def _tied_to_present(own: dict, source: dict) -> set[str]:
    """Keys of the model's state dict that share storage with another key the source has."""
    by_storage: dict = {}
    for k, v in own.items():
        by_storage.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)), []).append(k)
    return {k for keys in by_storage.values() if len(keys) > 1 and any(x in source for x in keys)
            for k in keys}
