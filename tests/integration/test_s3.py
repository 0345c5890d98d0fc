"""Runs on S3 storage, against a real S3 API server on 127.0.0.1 (moto's standalone server, from the dev extra),
through pyarrow's S3 filesystem with its endpoint taken from AWS_ENDPOINT_URL, as a user of an S3-compatible
store sets it (docs/failures.md). No local path pretends to be a bucket.

Every safety check and record that works on local storage must work on s3://: the run lock, the resume
compatibility check, sharded (FSDP) checkpoints uploaded by every rank, recovery of complete checkpoints Ray Train never registered, and
metrics.jsonl / timeline.jsonl; and models come out of the bucket: `behemoth eval` and train.init_from."""

import json
from pathlib import Path
import os

import numpy as np
import pyarrow.fs
import pytest
import yaml
from behemoth.storage.checkpoint import complete_checkpoints, read_state
from behemoth.config import ConfigError
from behemoth.job import config_from_dict
from behemoth.driver.run.evaluation import evaluate_checkpoint
from behemoth.storage.lease_stores import read_lease
from behemoth.storage.runlock import RunLock, RunLockedError
from behemoth.driver.run.trainer import train
from behemoth.tracking.records import read_jsonl, read_text
from behemoth.storage.weights import resolve
from conftest import job_dict
from s3_server import moto_s3

pytestmark = pytest.mark.integration
BUCKET = "behemoth-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server in its own process, one bucket; the AWS_* variables set for this process and (Ray
    starts after this fixture, see ray_local below) every Ray worker."""
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def ray_local(s3_endpoint, ray_local):
    """The shared module Ray instance, started after the S3 variables are set (its workers inherit them)."""
    yield


def s3_files(uri: str) -> list[str]:
    fs, path = pyarrow.fs.FileSystem.from_uri(uri)
    return sorted(f.path[len(path) + 1:] for f in fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True,
                                                                                            allow_not_found=True)))


def test_the_run_lock_holds_on_s3(s3_endpoint):
    folder = f"s3://{BUCKET}/locks/a"
    with RunLock(folder, "run 'a'"):
        lease = read_lease(folder)
        assert lease["pid"] == os.getpid() and ".behemoth.lock" in s3_files(folder)
        with pytest.raises(RunLockedError, match=rf"held by another driver: pid {os.getpid()}"):
            RunLock(folder, "run 'a'").acquire()
    assert read_lease(folder) is None


def test_two_drivers_starting_at_once_on_s3_cannot_both_win(s3_endpoint, monkeypatch):
    """Both read the lease before either wrote it (none; then an expired one): S3's conditional writes
    (If-None-Match: * to create, If-Match: ETag to take over, through boto3) let only the first win. The
    winner's lease has the next generation, and its release removes only its own lease."""
    from behemoth.storage import lease_stores

    folder = f"s3://{BUCKET}/locks/race"
    fs, path = pyarrow.fs.FileSystem.from_uri(folder)
    expired = {"host": "elsewhere", "pid": 1, "token": "theirs", "generation": 7, "started": 0, "heartbeat": 0}
    for before, generation in ((None, 1), (expired, 8)):
        if before:
            with fs.open_output_stream(f"{path}/.behemoth.lock") as f:
                f.write(json.dumps(before).encode())
        first, second = RunLock(folder, "run 'race'"), RunLock(folder, "run 'race'")
        seen = lease_stores.S3Lease(folder, path, renewal_timeout_s=10.0).read()
        first.acquire()
        with monkeypatch.context() as m:
            m.setattr(lease_stores.S3Lease, "read", lambda self, seen=seen: seen)  # the second driver's read came first
            with pytest.raises(RunLockedError, match="another driver took it at the same moment"):
                second.acquire()
        assert read_lease(folder)["token"] == first.lease["token"] and read_lease(folder)["generation"] == generation
        second.release()  # the refused one removes nothing
        assert read_lease(folder)["token"] == first.lease["token"]
        first.release()
        assert read_lease(folder) is None


def test_a_run_on_s3_keeps_every_check_and_record(s3_endpoint, ray_local, image_root, tmp_path):
    storage = f"s3://{BUCKET}/runs"
    folder = f"{storage}/r"
    job = job_dict(image_root, storage, "r", train={"epochs": 1})  # 6 steps; checkpoints at 3 and 6
    first = train(config_from_dict(job))
    assert first.metrics["step"] == 6 and first.resumed_from_step == 0 and first.latest_checkpoint.startswith(f"s3://{BUCKET}/runs/r/checkpoint_")
    kept = complete_checkpoints(folder)
    assert [step for step, _ in kept] == [6, 3] and all(p.startswith("s3://") for _, p in kept)
    assert read_state(kept[0][1]).step == 6
    assert [r["step"] for r in read_jsonl(f"{folder}/metrics.jsonl") if "step" in r][-1] == 6
    assert [r["event"] for r in read_jsonl(f"{folder}/timeline.jsonl")][-1] == "invocation_end"
    assert read_lease(folder) is None  # released

    # The resume check, before Ray is asked for anything: another model.
    changed = job_dict(image_root, storage, "r", train={"epochs": 2}, model={"name": "regnet_cifar"})
    with pytest.raises(ConfigError, match=r"was trained with a different config .*model.name: "
                                          r"'regnet_tiny_cifar' -> 'regnet_cifar'"):
        train(config_from_dict(changed))

    # Ray Train's registration of the checkpoints lost (a driver killed between an upload and its
    # registration leaves the same state): the rerun restores the newest complete checkpoint in the folder.
    # It switches to FSDP: DDP's full checkpoint loads under FSDP, whose checkpoints 9 and 12 are sharded, each
    # rank uploading its own DCP file into the bucket and rank 0 the manifest last.
    logged = len(read_jsonl(f"{folder}/metrics.jsonl"))
    fs, path = pyarrow.fs.FileSystem.from_uri(folder)
    fs.delete_file(f"{path}/checkpoint_manager_snapshot.json")
    second = train(config_from_dict(job_dict(image_root, storage, "r", train={"epochs": 2},
                                             scaling={"strategy": "fsdp_full"})))
    assert second.resumed_from_step == 6 and second.metrics["step"] == 12
    records = read_jsonl(f"{folder}/metrics.jsonl")
    assert len(records) > logged and min(r["step"] for r in records[logged:]) > 6  # appended; none redone
    # checkpoint.keep (2) reaches the checkpoints Ray Train forgot: 3 and 6 are older than the 9 and 12 it keeps
    assert [step for step, _ in complete_checkpoints(folder)] == [12, 9]
    twelve = complete_checkpoints(folder)[0][1].rpartition("/")[2]
    assert {f"{twelve}/state/__0_0.distcp", f"{twelve}/state/__1_0.distcp", f"{twelve}/state/.metadata",
            f"{twelve}/manifest.json"} <= set(s3_files(folder)) and f"{twelve}/model.pt" not in s3_files(folder)

    # Models out of the bucket: `behemoth eval` of the run folder (its best checkpoint) writes its JSON beside
    # the checkpoint; a local run fine-tunes from the s3 run folder (its weights downloaded and verified).
    metrics, written = evaluate_checkpoint(config_from_dict(job), folder)
    best, _ = resolve(folder, "best", ("val_accuracy", "max"))
    assert written == f"{best}.eval_val.json" and json.loads(read_text(written))["metrics"] == metrics
    assert metrics["val_accuracy"] == max(r["val_accuracy"] for r in records if "val_accuracy" in r and r["step"] >= 9)
    # `behemoth export` of the run folder in the bucket: the files the export of a local copy of it writes
    from behemoth.driver.commands.export import export

    exported, how = export(folder, str(tmp_path / "from_s3"))
    assert how.startswith(f"{best} ")
    pyarrow.fs.copy_files(path, str(tmp_path / "copy"), source_filesystem=fs)
    local, _ = export(str(tmp_path / "copy"), str(tmp_path / "from_copy"))
    for name in ("model.safetensors", "config.json", "preprocessor_config.json"):
        assert (exported / name).read_bytes() == (local / name).read_bytes(), name
    tuned = train(config_from_dict(job_dict(image_root, tmp_path / "local", "ft", train={
        "epochs": 1, "init_from": folder, "init_from_checkpoint": "latest"})))
    assert yaml.safe_load(read_text(f"{tuned.latest_checkpoint}/job.yaml"))["train"]["init_from"] == \
        complete_checkpoints(folder)[0][1]
    assert tuned.resumed_from_step == 0 and tuned.metrics["step"] == 6


def test_a_token_cache_in_the_bucket_trains_like_a_local_one(s3_endpoint, ray_local, text_corpus, tmp_path):
    """data.cache_dir on s3:// with token_store: files: the packed corpus is built once and uploaded into the
    bucket, read back as shard files, and the workers train from the bucket (ranged reads: TokenShards; their
    order and count are tests/unit/test_token_store.py's): 8 steps end on exactly the weights of the same run
    from a local cache in memory."""
    import torch

    from behemoth.data.text.text_packing import prepare_text
    from conftest import lm_job_dict

    cache = f"s3://{BUCKET}/token-cache"
    remote = config_from_dict(lm_job_dict(text_corpus, tmp_path, "remote", train={"max_steps": 8},
                                          data={"cache_dir": cache, "token_store": "files"}))
    index = prepare_text(remote.data, seed=0)
    names = s3_files(cache)
    assert any(n.endswith("/meta.json") for n in names) and any(n.endswith("/train-00000.npy") for n in names)
    assert index.stats["cache"].startswith(cache) and type(index.train).__name__ == "TokenShards"
    local = config_from_dict(lm_job_dict(text_corpus, tmp_path, "local", train={"max_steps": 8}))
    assert np.array_equal(index.train[np.arange(len(index.train))], prepare_text(local.data, seed=0).train)

    a, b = (train(cfg) for cfg in (remote, local))
    assert a.metrics["step"] == b.metrics["step"] == 8
    wa, wb = (torch.load(f"{s.latest_checkpoint}/model.pt") for s in (a, b))
    assert len(wa) > 0 and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_model_and_its_tokenizer_in_the_bucket_are_copied_once_per_node_and_trained(s3_endpoint, ray_local,
                                                                                        text_corpus, tmp_path, capsys):
    """Issue 67 item 3: model.pretrained on s3:// (a from_pretrained folder with its tokenizer; data.tokenizer left
    empty is the model's own): `behemoth check` reads the bucket's listing, each node copies the folder once (the
    copy named by the URI and the listing, sizes checked, reused by the next reader: the node's workers, the next
    run; a changed folder is a new copy), and the workers train from the bucket's weights (at a learning rate of
    1e-12, the weights the run ends on are the bucket's)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from behemoth.driver.commands.cli import main
    from behemoth.storage.model_copy import COMPLETE, local_source
    from behemoth.storage.weights import read_state_dict
    from conftest import lm_job_dict

    folder = tmp_path / "tiny"
    tok = AutoTokenizer.from_pretrained(text_corpus / "tokenizer")
    torch.manual_seed(7)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=32)).save_pretrained(folder)
    tok.save_pretrained(folder)
    uri = f"s3://{BUCKET}/models/tiny"
    fs, where = pyarrow.fs.FileSystem.from_uri(uri)
    pyarrow.fs.copy_files(str(folder), where, destination_filesystem=fs)

    copy = local_source(uri, "model.pretrained")
    marker = os.stat(f"{copy}/{COMPLETE}").st_mtime_ns
    assert sorted(p.name for p in folder.iterdir()) == sorted(n for n in os.listdir(copy) if n != COMPLETE)
    assert local_source(uri, "model.pretrained") == copy and os.stat(f"{copy}/{COMPLETE}").st_mtime_ns == marker

    job = lm_job_dict(text_corpus, tmp_path, "from_bucket", train={"max_steps": 4, "lr": 1e-12, "warmup_steps": 0},
                      data={"tokenizer": ""})
    job["model"] = {"name": "causal_lm", "pretrained": uri}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    assert main(["check", str(config)]) == 0
    nodes = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("# nodes: "))
    assert "data.train_files[0]" in nodes and "model.pretrained" not in nodes  # a new node fetches the model itself
    summary = train(config_from_dict(job))
    assert yaml.safe_load(read_text(f"{summary.latest_checkpoint}/job.yaml"))["model"]["pretrained"] == uri
    trained, uploaded = read_state_dict(summary.latest_checkpoint), read_state_dict(str(folder))
    assert trained.keys() == uploaded.keys()
    assert all(torch.allclose(trained[k], uploaded[k], atol=1e-6) for k in trained)
    markers = {p: json.loads((p / COMPLETE).read_text()) for p in Path(copy).parent.iterdir()
               if (p / COMPLETE).is_file()}
    copies = [p for p, marker in markers.items() if marker["uri"] == uri and marker["weights"]]
    assert copies == [Path(copy)]  # the driver's and the workers' one copy on this node (an older one removed)
    # check's and the tokenizer loads' one copy without the weights (issue 72 item 6)
    (light,) = [p for p, marker in markers.items() if marker["uri"] == uri and not marker["weights"]]
    assert "model.safetensors" not in os.listdir(light) and "config.json" in os.listdir(light)

    fs.delete_file(f"{where}/config.json")
    job["model"]["pretrained"] = uri
    config.write_text(yaml.safe_dump(job))
    assert main(["check", str(config)]) == 2  # the folder in the bucket lost its config.json: refused before Ray
    changed = local_source(uri, "model.pretrained")  # a changed folder: a new copy, the URI's older one removed
    assert changed != copy and not Path(copy).exists() and not (Path(changed) / "config.json").exists()
