"""A folder in an object store copied to this node (storage/model_copy.py, and every other copy of a store's
listing: a Hugging Face folder's weights, a run's report for MLflow), against a real S3 API server (moto's,
tests/s3_server.py), the hostile keys put there with boto3 as a bucket's writer would (issue 72 items 1, 5, 6).

What the store does with such keys, seen here: pyarrow's listing gives 'org/team/llama/../../../X' as a file of
the folder, and reading it returns the bucket's 'X' (the `..` parts are resolved on the way: the premise each test
asserts); pyarrow's copy_files writes it as named, outside its target."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pyarrow.fs
import pytest
import yaml

from behemoth.errors import CheckpointError, ConfigError, DataError
from behemoth.storage import model_copy, weights
from behemoth.storage.store import Store

BUCKET = "models"
HOSTILE = "../../../X"  # below org/team/llama: three '..' parts, as deep as the prefix, read as the bucket's X


@pytest.fixture(scope="module")
def s3():
    from s3_server import _client, moto_s3

    with moto_s3(BUCKET) as endpoint:
        yield _client(endpoint)


@pytest.fixture
def node_temp(tmp_path, monkeypatch) -> Path:
    """The node's temp folder (where copies live, and weights.fetched's temporary folders) two folders below
    tmp_path: a hostile key's '..' parts then land inside the test's own folder (where the old code wrote it)."""
    temp = tmp_path / "b" / "tmp"
    temp.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def _put(s3, prefix: str, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}" if prefix else name, Body=data)
    return f"s3://{BUCKET}/{prefix}"


def _read(uri: str) -> bytes:
    fs, where = pyarrow.fs.FileSystem.from_uri(uri)
    with fs.open_input_stream(where) as f:
        return f.read()


def _hostile_folder(s3, prefix: str) -> str:
    """A model folder at `prefix` (3 levels below the bucket) whose listing holds `prefix/../../../X`, and the
    bucket's own X (what reading that key returns, the same size)."""
    _put(s3, "", {"X": b"EVIL"})
    uri = _put(s3, prefix, {"config.json": b"{}", HOSTILE: b"evil"})
    assert _read(f"{uri}/{HOSTILE}") == b"EVIL"  # the premise: the store resolves '..' when the key is read
    return uri


def _llama_folder(folder: Path, tokenizer: Path) -> Path:
    """A model folder as save_pretrained leaves one: config, the tokenizer's files, and weights (bytes a check
    must not fetch: never loaded here)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=512, max_position_embeddings=64).save_pretrained(folder)
    for f in tokenizer.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    return folder


def _check(tmp_path: Path, job: dict, capsys) -> tuple[int, str, str]:
    from behemoth.driver.commands.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_listed_key_that_leaves_the_folder_is_refused_by_check_before_anything_is_written(s3, node_temp, tmp_path,
                                                                                            text_corpus, capsys):
    """Item 1: `behemoth check` of model.pretrained s3://models/org/team/llama, whose listing holds
    'org/team/llama/../../../X', wrote the bucket's X three folders above the copy (a sitecustomize.py in
    site-packages, in the issue) and exited 0. Now the listing is refused in one line naming the key and the URI,
    exit 2, and nothing is written; the node's copy refuses it the same way."""
    from conftest import lm_job_dict

    uri = _hostile_folder(s3, "org/team/llama")
    job = lm_job_dict(text_corpus, tmp_path)
    job["model"] = {"name": "causal_lm", "pretrained": uri}
    code, out, err = _check(tmp_path, job, capsys)
    assert [p for p in tmp_path.rglob("*") if p.name == "X"] == []
    assert (code, out) == (2, ""), err
    assert err == (f"behemoth: config error: model.pretrained {uri}: the object {HOSTILE!r} is not a plain relative "
                   f"path (it is absolute, or has an empty, '.' or '..' part, a backslash, a NUL or a part over 255 "
                   f"bytes): copied as named it would not be one file inside the copy's folder: rename or remove it "
                   f"in the store (nothing was copied)\n")
    with pytest.raises(ConfigError, match=r"model.pretrained s3://models/org/team/llama: the object '\.\./\.\./\.\./X'"):
        model_copy.local_source(uri, "model.pretrained")
    assert [p for p in tmp_path.rglob("*") if p.name == "X"] == []


@pytest.mark.parametrize("name", ["/abs", "a//b", "./a", "a\\b", "a/" + "y" * 256])
def test_every_kind_of_name_that_is_not_one_file_inside_the_copy_is_refused(s3, node_temp, name):
    """The rule for every listed name (paths.is_inside): absolute, an empty or '.' part, a backslash, a part no
    filesystem takes; one line naming the key, nothing copied. (A NUL cannot be put into an S3 key; a manifest's
    is refused: test_remote_shards.)"""
    prefix = f"kinds/{abs(hash(name))}"
    uri = _put(s3, prefix, {"config.json": b"{}", name: b"x"})
    fs, where = pyarrow.fs.FileSystem.from_uri(uri)
    listed = [i.path[len(where) + 1:] for i in fs.get_file_info(pyarrow.fs.FileSelector(where, recursive=True))
              if i.type == pyarrow.fs.FileType.File]
    bad = next(n for n in listed if n != "config.json")
    with pytest.raises(ConfigError) as e:
        model_copy.local_source(uri, "model.pretrained")
    assert str(e.value).startswith(f"model.pretrained {uri}: the object {bad!r} is not a plain relative path")
    assert "\n" not in str(e.value)
    assert [p for p in node_temp.rglob("*") if p.is_file()] == []


def test_a_key_that_is_another_keys_folder_is_one_line_naming_both(s3, node_temp):
    """Item 5: a bucket with keys x and x/y under the model's folder raised IsADirectoryError (or
    NotADirectoryError, by the order the copies ran in). Now one line names both keys."""
    uri = _put(s3, "clash/llama", {"config.json": b"{}", "x": b"1", "x/y": b"2"})
    with pytest.raises(ConfigError) as e:
        model_copy.local_source(uri, "data.tokenizer")
    assert str(e.value) == (f"data.tokenizer {uri}: the objects 'x' and 'x/y' make 'x' both a file and a folder, "
                            f"which a local copy cannot hold: rename or remove it in the store (nothing was copied)")


def test_check_reads_a_bucket_models_config_and_tokenizer_without_its_weights(s3, node_temp, tmp_path, text_corpus,
                                                                              capsys):
    """Item 6: `check` of model.pretrained in a bucket (its own tokenizer: data.tokenizer left empty) copied the
    whole folder, weights included, where the docs say it reads the listing. Now check's copy holds the folder's
    config and tokenizer files and no weights; the model's builder (a node that trains) still copies the whole
    folder once, and neither copy removes the other."""
    from conftest import lm_job_dict

    folder = _llama_folder(tmp_path / "llama", text_corpus / "tokenizer")
    uri = _put(s3, "check/llama", {p.name: p.read_bytes() for p in folder.iterdir()})
    job = lm_job_dict(text_corpus, tmp_path)
    del job["data"]["tokenizer"]
    job["model"] = {"name": "causal_lm", "pretrained": uri}
    code, out, err = _check(tmp_path, job, capsys)
    assert code == 0, err
    copied = [p for p in node_temp.rglob("*") if p.is_file()]
    assert "model.safetensors" not in {p.name for p in copied}  # the 1 MB of weights never fetched
    assert {"config.json", "tokenizer.json"} <= {p.name for p in copied}
    (light,) = {p.parent for p in copied}
    full = Path(model_copy.local_source(uri, "model.pretrained"))  # a node that trains: every file, once
    assert sorted(p.name for p in full.iterdir() if p.name != model_copy.COMPLETE) == sorted(
        p.name for p in folder.iterdir())
    assert model_copy.local_source(uri, "model.pretrained", weights=False) == str(light) and full.is_dir()


def test_an_object_rewritten_with_the_same_size_within_the_second_is_a_new_copy(s3, node_temp):
    """Item 6: the copy was named by each file's (path, size, modification time) from the listing, and S3's times
    have whole seconds: a config.json rewritten with other bytes of the same size within the second kept the old
    copy on every node that had one. Now the ETag (the store's hash of the object) names the copy too."""
    uri = f"s3://{BUCKET}/rewritten/llama"
    for _ in range(10):  # until the two writes fall within one second of the store's clock (the first, mostly)
        time.sleep(1 - time.time() % 1)
        _put(s3, "rewritten/llama", {"config.json": b'{"a": 1}'})
        before = model_copy.listing(uri, "model.pretrained")
        first = model_copy.local_source(uri, "model.pretrained")
        _put(s3, "rewritten/llama", {"config.json": b'{"a": 2}'})
        if model_copy.listing(uri, "model.pretrained") == before:  # size and time as before: the premise
            break
    else:
        pytest.fail("no two writes within one second of the store's clock in 10 tries")
    second = model_copy.local_source(uri, "model.pretrained")
    assert second != first and json.loads(Path(second, "config.json").read_text()) == {"a": 2}
    assert not Path(first).exists()  # the URI's older copy removed, as for a folder changed otherwise


def _raised(fn) -> Exception | None:
    """What fn() raised (None: nothing), so that a test asserts what was written before what was said."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
    return None


def _fetch(uri: str) -> None:
    with weights.fetched(uri):
        pass


def test_a_hugging_face_folder_in_a_bucket_is_fetched_by_checked_names(s3, tmp_path, node_temp):
    """weights.fetched (train.init_from, eval, export of a folder in a bucket) copied a Hugging Face folder with
    pyarrow's copy_files, which writes a listed 'P/../../../X' as named, outside its temporary folder. Now the
    folder's listing is checked: one CheckpointError naming the key, nothing written."""
    uri = _hostile_folder(s3, "hf/team/llama")
    refused = _raised(lambda: _fetch(uri))
    assert [p for p in tmp_path.rglob("*") if p.name == "X"] == []
    assert isinstance(refused, CheckpointError) and str(refused).startswith(
        f"{uri}: the object '../../../X' is not a plain relative path"), refused


def test_a_checkpoints_weight_file_that_the_bucket_holds_as_a_folder_is_not_copied_as_one(s3, tmp_path, node_temp):
    """weights.fetched copied each weight file its manifest names with pyarrow's copy_files, which copies a name
    the bucket holds only as keys below it (model.pt/../../../../X, no model.pt object) as a folder: X written
    outside the temporary folder. Now each file is read as one file: missing, said in one line."""
    _put(s3, "", {"X": b"EVIL"})
    manifest = {"format_version": 1, "files": {"model.pt": {"size": 4, "sha256": "0" * 64}}}
    ckpt = _put(s3, "ckpt/run/checkpoint_1", {"manifest.json": json.dumps(manifest).encode(),
                                              "model.pt/../../../../X": b"evil"})
    refused = _raised(lambda: weights.read_state_dict(ckpt))
    assert [p for p in tmp_path.rglob("*") if p.name == "X"] == []
    assert isinstance(refused, CheckpointError) and str(refused) == f"checkpoint {ckpt}: model.pt is missing", refused


def test_a_runs_report_folder_copied_for_mlflow_checks_its_listing(s3, tmp_path):
    """Store.local_copy (a run's report folder under a URI, copied for MLflow's client) used pyarrow's
    copy_files: a key 'report/../../X' in the run's bucket was written beside the temporary folder. Now one
    DataError names the key; a plain folder still copies."""
    target = tmp_path / "a" / "tmp"
    target.mkdir(parents=True)
    _put(s3, "runs", {"X": b"EVIL"})  # what the key reads as
    uri = _put(s3, "runs/exp/report", {"report.html": b"<html/>", "../../X": b"evil"})
    refused = _raised(lambda: Store(uri).local_copy(str(target)))
    assert [p for p in tmp_path.rglob("*") if p.name == "X"] == []
    assert isinstance(refused, DataError) and str(refused).startswith(
        f"{uri}: the object '../../X' is not a plain relative path"), refused
    plain = _put(s3, "runs/ok/report", {"report.html": b"<html/>", "plots/loss.png": b"png"})
    copy = Path(Store(plain).local_copy(str(target)))
    assert (copy / "report.html").read_bytes() == b"<html/>" and (copy / "plots" / "loss.png").read_bytes() == b"png"
