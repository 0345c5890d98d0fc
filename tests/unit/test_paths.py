"""A run's place (paths.RunPlace): every path of a run or sweep is joined there, locally and under a URI."""

import os

import pytest

from behemoth.errors import ConfigError
from behemoth.storage.paths import RunPlace


@pytest.mark.parametrize("storage", ["s3://bucket/runs", "s3://bucket/runs/", "gs://b/r"])
def test_a_place_under_a_uri_joins_with_slashes_and_names_rays_paths_by_their_uri(storage):
    place = RunPlace.of(storage, "exp1")
    root = storage.rstrip("/")
    assert (place.storage, place.name, place.folder) == (storage, "exp1", f"{root}/exp1")
    assert place.join("checkpoint_1", "manifest.json") == f"{root}/exp1/checkpoint_1/manifest.json"
    trial = place.child("runs", "t_00001")  # a sweep's trial: Ray's storage and name, no path split back
    assert (trial.storage, trial.name, trial.folder) == (f"{root}/exp1/runs", "t_00001", f"{root}/exp1/runs/t_00001")
    # Ray gives a checkpoint's path on the storage's filesystem (bucket/...): the user's URI again
    scheme = storage.split("://")[0]
    assert place.as_uri(f"{root.split('://')[1]}/exp1/checkpoint_1") == f"{scheme}://{root.split('://')[1]}/exp1/checkpoint_1"
    assert place.as_uri(None) is None


def test_a_file_uri_keeps_its_absolute_path():
    """file:// storage: the filesystem's paths are absolute (/tmp/...), and stay so (file:///tmp/...)."""
    place = RunPlace.of("file:///tmp/runs", "e")
    assert place.folder == "file:///tmp/runs/e"
    assert place.as_uri("/tmp/runs/e/checkpoint_1") == "file:///tmp/runs/e/checkpoint_1"


def test_a_local_place_is_absolute_and_its_name_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    place = RunPlace.of("runs", "exp1")
    assert place.storage == str(tmp_path / "runs") and place.folder == str(tmp_path / "runs" / "exp1")
    assert place.join("ledger") == os.path.join(place.folder, "ledger")
    assert place.child("runs", "t1").folder == str(tmp_path / "runs" / "exp1" / "runs" / "t1")
    assert place.as_uri("/x/y") == "/x/y"
    with pytest.raises(ConfigError, match="checkpoint.run_name 'a#b' must be a plain folder name"):
        RunPlace.of("s3://bucket/runs", "a#b")
    with pytest.raises(ConfigError, match="name '../x' must be a plain folder name"):
        RunPlace.of("runs", "../x", key="name")
    with pytest.raises(ConfigError, match="must be a plain folder name"):
        place.child("runs", "t?1")


@pytest.mark.parametrize("root, fs_path, uri", [
    # Azure: the filesystem's path starts with the container; the account is only in the URI
    ("abfs://data@acct.dfs.core.windows.net/runs", "data/runs/e/checkpoint_1",
     "abfs://data@acct.dfs.core.windows.net/runs/e/checkpoint_1"),
    ("abfs://acct.blob.core.windows.net/data/runs", "data/runs/e/checkpoint_1",
     "abfs://acct.blob.core.windows.net/data/runs/e/checkpoint_1"),
    # HDFS: the filesystem's path is absolute; the namenode is only in the URI
    ("hdfs://namenode:8020/runs", "/runs/e/checkpoint_1", "hdfs://namenode:8020/runs/e/checkpoint_1"),
    # what the filesystem decodes or normalises stays as the user wrote it
    ("gs://b/my%20runs", "b/my runs/e/checkpoint_1", "gs://b/my%20runs/e/checkpoint_1"),
    ("s3://bucket", "bucket/e/checkpoint_1/", "s3://bucket/e/checkpoint_1"),
    ("file:///", "/e/checkpoint_1", "file:///e/checkpoint_1"),  # the slashes of :// are not a trailing slash
])
def test_a_filesystem_path_gets_the_roots_authority_back(root, fs_path, uri):
    """Ray and pyarrow give a checkpoint's path on the storage's filesystem; the URI built back keeps what only
    the root's URI holds (an Azure account, an HDFS namenode: a checkpoint path without it names another store)
    and what the filesystem decodes."""
    assert RunPlace.of(root, "e").as_uri(fs_path) == uri


def test_a_storage_uri_with_options_is_refused_before_anything_is_joined_onto_it():
    from behemoth.job import config_from_dict

    for storage in ("s3://bucket/runs?endpoint_override=localhost:9000", "gs://b/r#x"):
        with pytest.raises(ConfigError, match=r"query string or fragment .* environment variables"):
            RunPlace.of(storage, "e")
        with pytest.raises(ConfigError, match=r"storage path .*: a query string"):
            config_from_dict({"data": {"root": "x"}, "checkpoint": {"storage_path": storage}})


@pytest.mark.parametrize("uri", [False, True])
def test_a_store_gives_the_same_bytes_through_either_arm(tmp_path, uri):
    """storage/store.py decides local-or-URI once: a local folder and the same folder as a file:// URI (the
    object-store arm, through the pyarrow calls s3:// takes) read, write, list, stamp, copy up and copy down alike; only
    a local file appends in place."""
    from pathlib import Path

    from behemoth.storage.store import Store

    root = f"file://{tmp_path}/place" if uri else str(tmp_path / "place")
    place = Store(root)
    assert place.is_local is not uri and place.expanded() == root and place.absolute() == root
    assert Store("rel/x").absolute() == os.path.abspath("rel/x") and Store("s3://b/rel").absolute() == "s3://b/rel"
    assert Store(f"{root}/a.txt").read_text() is None and not Store(f"{root}/a.txt").exists()
    Store(f"{root}/a.txt").write_bytes(b"one\n")
    assert Store(f"{root}/a.txt").read_bytes() == b"one\n" and Store(f"{root}/a.txt").read_text() == "one\n"
    if not uri:
        Store(f"{root}/a.txt").append_text("two\n")
        assert Path(root, "a.txt").read_text() == "one\ntwo\n"
    with pytest.raises(FileNotFoundError):
        Store(f"{root}/missing.txt").read_bytes()
    built = tmp_path / "built"
    built.mkdir()
    for name in ("meta.json", "b.bin", "c.bin"):
        (built / name).write_bytes(name.encode())
    Store(f"{root}/up").put_folder(built)
    Store(f"{root}/up/d.bin").put_file(built / "b.bin")
    assert Store(f"{root}/up").list_files(".bin") == ["b.bin", "c.bin", "d.bin"] and Store(f"{root}/no").list_files() == []
    stamps = Store(f"{root}/up").file_stamps()  # (name, size, modified ns): what a folder rewritten in place changes
    assert stamps == sorted((n, len(n), os.stat(built.parent / "place" / "up" / n).st_mtime_ns)
                            for n in ("b.bin", "c.bin", "d.bin", "meta.json"))
    assert Store(f"{root}/no").file_stamps() is None and Store(f"{root}/up/b.bin").file_stamps() is None
    (tmp_path / "place" / "cache").mkdir()  # (a file:// URI's folder must be there; a bucket's need not)
    with Store(f"{root}/cache").built_here("behemoth-test-", last="meta.json") as folder:
        assert (folder == Path(root, "cache")) is not uri
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").write_text("{}")
        (folder / "x.bin").write_bytes(b"x")
    assert Store(f"{root}/cache").list_files() == ["meta.json", "x.bin"]
    down = tmp_path / "down"
    down.mkdir()
    copy = Store(f"{root}/up").local_copy(str(down))
    assert (copy == str(down / "up")) is uri and sorted(os.listdir(copy)) == ["b.bin", "c.bin", "d.bin", "meta.json"]
    work = Store(f"{root}/tb").working_folder("behemoth-test-")
    assert (work == f"{root}/tb") is not uri
    if uri:
        os.rmdir(work)
