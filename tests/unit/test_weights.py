"""behemoth.storage.weights: which folder the weights come from, and loading them into a freshly built model."""

import json
import re

import pyarrow.fs
import pytest
import torch

from behemoth.storage import checkpoint, node_copy, weights
from behemoth.storage.checkpoint import Snapshot
from behemoth.errors import CheckpointError


def _checkpoint(folder, step, metrics=None, model=None):
    model = model or torch.nn.Linear(3, 2)
    texts = {"train_state.json": json.dumps({"step": step})}
    if metrics is not None:
        texts["metrics.json"] = json.dumps(metrics)
    return checkpoint.write(folder, Snapshot({"model.pt": model.state_dict()}, texts, step))


def test_a_run_folders_best_and_latest_and_what_is_not_a_source(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run / "checkpoint_1", 10, {"val_accuracy": 0.5})
    _checkpoint(run / "checkpoint_2", 20, {"val_accuracy": 0.8})
    _checkpoint(run / "checkpoint_3", 30, {"val_accuracy": 0.8})  # a tie: the later one
    _checkpoint(run / "checkpoint_4", 40, {"loss": 0.1})  # no evaluation with this one
    (run / "checkpoint_5").mkdir()  # an upload that never finished: no manifest, never chosen
    best, how = weights.resolve(str(run), "best", ("val_accuracy", "max"))
    assert best.endswith("checkpoint_3") and how == "its best checkpoint by val_accuracy (0.8000, step 30)"
    assert weights.resolve(str(run), "best", ("val_accuracy", "min"))[0].endswith("checkpoint_1")
    assert weights.resolve(str(run), "latest")[0].endswith("checkpoint_4")
    fallback, how = weights.resolve(str(run), "best", ("val_loss", "min"))
    assert fallback.endswith("checkpoint_4") and "none of its checkpoints records val_loss" in how
    assert weights.resolve(str(run / "checkpoint_1"))[1] == "as given"
    with pytest.raises(CheckpointError, match="does not exist"):
        weights.resolve(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a behemoth checkpoint .* not a run folder"):
        weights.resolve(str(tmp_path / "empty"))


def test_a_nan_inf_or_non_numeric_metric_is_never_the_best(tmp_path):
    """A diverged evaluation (NaN, inf) or a hand-edited value is no score: `best` never picks it, whichever way
    the metric is ranked; a run with no finite score falls back to its latest checkpoint, saying so."""
    run = tmp_path / "run"
    _checkpoint(run / "checkpoint_1", 10, {"val_loss": 0.9})
    _checkpoint(run / "checkpoint_2", 20, {"val_loss": 0.5})
    _checkpoint(run / "checkpoint_3", 30, {"val_loss": float("nan")})
    _checkpoint(run / "checkpoint_4", 40, {"val_loss": float("-inf")})
    _checkpoint(run / "checkpoint_5", 50, {"val_loss": "0.1"})
    best, how = weights.resolve(str(run), "best", ("val_loss", "min"))
    assert best.endswith("checkpoint_2") and how == "its best checkpoint by val_loss (0.5000, step 20)"
    assert weights.resolve(str(run), "best", ("val_loss", "max"))[0].endswith("checkpoint_1")
    nan_only = tmp_path / "nan_only"
    _checkpoint(nan_only / "checkpoint_1", 10, {"val_loss": float("nan")})
    _checkpoint(nan_only / "checkpoint_2", 20, {"val_loss": float("inf")})
    latest, how = weights.resolve(str(nan_only), "best", ("val_loss", "min"))
    assert latest.endswith("checkpoint_2") and "none of its checkpoints records val_loss as a finite number" in how


@pytest.mark.parametrize("rule, chosen", [(None, "checkpoint_1"), ({"metric": "val_loss", "patience": 3},
                                                                     "checkpoint_2")])
def test_a_run_folders_best_is_the_one_its_run_kept_and_named(tmp_path, rule, chosen):
    """An image run with train.early_stopping on val_loss keeps its best checkpoints by val_loss, and its summary
    names the best by it; weights.resolve (what export, eval, generate and init_from call) chose by the task's
    val_accuracy among them, another checkpoint. Now by the run's own metric, read from the job its newest
    checkpoint records."""
    import yaml

    from behemoth.tasks.image import ImageClassification as task

    run = tmp_path / "run"
    job = {"data": {"kind": "image_folder", "root": "x"}, "train": {"early_stopping": rule}}
    for i, (step, loss, accuracy) in enumerate([(10, 0.5, 0.9), (20, 0.3, 0.8)], start=1):
        model = torch.nn.Linear(3, 2)
        texts = {"train_state.json": json.dumps({"step": step}), "job.yaml": yaml.safe_dump(job),
                 "metrics.json": json.dumps({"val_loss": loss, "val_accuracy": accuracy})}
        checkpoint.write(run / f"checkpoint_{i}", Snapshot({"model.pt": model.state_dict()}, texts, step))
    best, how = weights.resolve(str(run), "best", task.best, task.reported)
    assert best.endswith(chosen) and how.startswith(f"its best checkpoint by {rule['metric'] if rule else 'val_'}")
    # a metric the task does not report (another task's run) is not one to rank by: the task's own
    assert weights.resolve(str(run), "best", ("val_accuracy", "max"), {"val_perplexity": "min"})[0].endswith(
        "checkpoint_1")


def test_a_damaged_or_git_lfs_pointer_safetensors_file_is_one_line_naming_it(tmp_path):
    """A copy cut short, or the pointer a clone without Git LFS leaves: a CheckpointError naming the file (and
    `git lfs pull`), never safetensors' own "header too large"; the shards an index names alike."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file(torch.nn.Linear(3, 2).state_dict(), hf / "model.safetensors")
    whole = (hf / "model.safetensors").read_bytes()
    for cut, why in ((whole[:-4], "where its header promises"), (whole[:20], "too few for the header"),
                     (b"\x10\0\0\0\0\0\0\0not json at all!", "its header is not safetensors' JSON")):
        (hf / "model.safetensors").write_bytes(cut)
        with pytest.raises(CheckpointError, match=re.escape(f"{hf}/model.safetensors is damaged")) as e:
            weights.read_state_dict(hf)
        assert why in str(e.value) and "\n" not in str(e.value)
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1234\n"
    (hf / "model.safetensors").write_bytes(pointer)
    with pytest.raises(CheckpointError, match=re.escape(f"{hf}/model.safetensors is a Git LFS pointer, not the "
                                                        f"weights: run `git lfs pull`")):
        weights.read_state_dict(hf)
    (hf / "model.safetensors").unlink()
    (hf / "a.safetensors").write_bytes(pointer)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match=re.escape(f"{hf}/a.safetensors is a Git LFS pointer")):
        weights.check_hf_weights(hf)


def test_read_verifies_a_checkpoint_and_reads_hugging_face_files(tmp_path):
    model = torch.nn.Linear(3, 2)
    ckpt = _checkpoint(tmp_path / "ckpt", 1, model=model)
    assert torch.equal(weights.read_state_dict(ckpt)["weight"], model.weight)
    data = (ckpt / "model.pt").read_bytes()
    (ckpt / "model.pt").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="model.pt does not match its manifest"):
        weights.read_state_dict(ckpt)
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file(model.state_dict(), hf / "model.safetensors")
    assert weights.is_hf_folder(hf) and torch.equal(weights.read_state_dict(hf)["bias"], model.bias)


def test_a_sharded_hugging_face_folder_reads_only_shards_inside_it(tmp_path):
    """model.safetensors.index.json's shard names are joined onto the folder and loaded: one in a subfolder
    reads, one with '..' or an absolute one (a file elsewhere, here real weights) is refused naming the index
    file and the shard, before anything is loaded."""
    from safetensors.torch import save_file

    model = torch.nn.Linear(3, 2)
    hf = tmp_path / "hf"
    (hf / "sub").mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    save_file({"weight": model.weight.detach()}, hf / "sub" / "a.safetensors")
    save_file({"bias": model.bias.detach()}, tmp_path / "elsewhere.safetensors")

    def index(bias_shard):
        weight_map = {"weight": "sub/a.safetensors", "bias": bias_shard}
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    save_file({"bias": model.bias.detach()}, hf / "b.safetensors")
    index("b.safetensors")
    assert torch.equal(weights.read_state_dict(hf)["weight"], model.weight)
    outside = ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors"), "sub/../../elsewhere.safetensors")
    for shard in outside:
        index(shard)
        with pytest.raises(CheckpointError, match=re.escape(f"index.json names the shard {shard!r}, which is not")):
            weights.read_state_dict(hf)


def test_load_takes_every_tensor_but_an_allowed_head_and_names_what_does_not_fit():
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 10)).state_dict()
    three = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    fresh_head = three[1].weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"other shape: 1.weight \(10, 8\) \(model: \(3, 8\)\)"):
        weights.load_weights(three, source, "src")  # no policy: another head is an error
    assert weights.load_weights(three, source, "src", weights.classification_head(3)) == ["1.weight", "1.bias"]
    assert torch.equal(three[0].weight, source["0.weight"]) and torch.equal(three[1].weight, fresh_head)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Linear(9, 10))
    with pytest.raises(CheckpointError, match=r"other shape: 0.weight \(8, 4\) \(model: \(9, 4\)\), 0.bias"):
        weights.load_weights(wider, source, "src", weights.classification_head(10))  # a hidden layer, not the head
    with pytest.raises(CheckpointError, match=r"missing: 1.bias.*not in the model: extra"):
        weights.load_weights(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 10)),
                             {**{k: v for k, v in source.items() if k != "1.bias"}, "extra": torch.zeros(1)}, "src")


def test_a_tied_output_layer_stored_once_loads():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    source = {"embed.weight": torch.randn(5, 3)}  # as save_pretrained stores tied weights: once
    model = Tied()
    assert weights.load_weights(model, source, "src") == []
    assert torch.equal(model.head.weight, source["embed.weight"])
    untied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    with pytest.raises(CheckpointError, match="missing: head.weight"):
        weights.load_weights(untied, source, "src")


def test_the_ledger_reader_skips_a_torn_line_and_the_writer_starts_after_it(tmp_path):
    from behemoth.worker.ledger import _ends_mid_line
    from integration.ledger_audit import read_ledger

    f = tmp_path / "rank0.jsonl"
    f.write_text('{"step": 1}\n{"step": 2, "ids": [1, 2')  # a writer killed mid-record
    assert _ends_mid_line(str(f)) and [r["step"] for r in read_ledger(tmp_path)] == [1]
    f.write_text(f.read_text() + '\n{"step": 2}\n{"step": 3')  # the next group's writer starts a new line
    assert [r["step"] for r in read_ledger(tmp_path)] == [1, 2]  # step 3: a line still being written
    f.write_text('{"step": 1}\n{"step": 2}}\n')  # complete yet unreadable: not a torn line, an error
    with pytest.raises(AssertionError, match="not torn"):
        read_ledger(tmp_path)
    f.write_text('{"step": 1}\n')
    assert not _ends_mid_line(str(f))


def test_a_checkpoint_under_a_uri_is_fetched_without_its_optimizer_state_and_removed_after(tmp_path, monkeypatch):
    """Reading weights from an object store (a file:// URI here, through the same pyarrow path as s3://)
    downloads the manifest and model.pt only, verifies model.pt, and leaves no copy behind. The driver's check
    before Ray starts downloads nothing (the manifest and model.pt's size): the workers download it once."""
    model = torch.nn.Linear(3, 2)
    ckpt = _checkpoint(tmp_path / "ckpt", 1, model=model)
    uri = f"file://{ckpt}"
    with weights.fetched(uri) as local:
        assert sorted(p.name for p in local.iterdir()) == ["manifest.json", "model.pt"]  # no train_state.json
    assert not local.exists()
    assert torch.equal(weights.read_state_dict(uri)["weight"], model.weight)
    (ckpt / "train_state.json").write_text("damaged")  # not the weights: reading them does not care
    copies = []
    real_copy, real_file_copy = pyarrow.fs.copy_files, node_copy._copy  # (fetched copies file by file: _copy)
    monkeypatch.setattr(pyarrow.fs, "copy_files", lambda *a, **k: (copies.append(a[0]), real_copy(*a, **k)))
    monkeypatch.setattr(node_copy, "_copy", lambda *a, **k: (copies.append(a[1]), real_file_copy(*a, **k))[1])
    with weights.fetched(uri):  # (the spies see a download)
        assert len(copies) == 1
    copies.clear()
    weights.check(uri)  # the driver's check: the manifest and model.pt's size, nothing downloaded
    assert copies == []
    data = (ckpt / "model.pt").read_bytes()
    (ckpt / "model.pt").write_bytes(data[:-8] + bytes(8))  # same size, other bytes: the reader's sha256 sees it
    weights.check(uri)
    with pytest.raises(CheckpointError, match="model.pt does not match its manifest"):
        weights.read_state_dict(uri)
    (ckpt / "model.pt").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"model.pt does not match its manifest \(size"):
        weights.check(uri)
    (ckpt / "model.pt").unlink()
    with pytest.raises(CheckpointError, match="model.pt is missing"):
        weights.check(uri)
    (ckpt / "model.pt").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["model.pt"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model.pt not in its manifest.json"):
        weights.read_state_dict(ckpt)  # locally too: a manifest that does not cover the weights verifies nothing


def _ddp_rank(rank: int, port: int, source: dict, out: str) -> None:
    """One of 2 gloo ranks: reads the source weights only if reads_init_from says so, then wraps in DDP."""
    import torch.distributed as dist

    from behemoth.checkpoints.restore import reads_init_from

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)  # every rank starts from other weights
    model = torch.nn.Linear(3, 2)
    if reads_init_from("ddp", rank, 2):
        weights.load_weights(model, source, "src")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch.save(ddp.module.state_dict(), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_under_ddp_only_rank_0_reads_the_init_from_weights_and_every_rank_starts_from_them(tmp_path):
    """The rule (checkpoints/restore.reads_init_from): under DDP with several workers only rank 0 reads; FSDP (each
    rank shards its own full copy) and a single worker read their own. And what it relies on: wrapping in DDP
    gives every rank rank 0's weights (two real gloo processes, rank 1 never reading the source)."""
    import socket

    import torch.multiprocessing as mp

    from behemoth.checkpoints.restore import reads_init_from

    assert [reads_init_from("ddp", r, 2) for r in range(2)] == [True, False]
    assert reads_init_from("ddp", 0, 1)
    assert [reads_init_from("fsdp", r, 2) for r in range(2)] == [True, True]

    torch.manual_seed(42)
    source = torch.nn.Linear(3, 2).state_dict()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(port, source, str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(got[k], source[k]) for k in source), rank
