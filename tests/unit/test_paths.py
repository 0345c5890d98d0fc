"""A run's place (paths.RunPlace): every path of a run or sweep is joined there, locally and under a URI."""

import os

import pytest

from behemoth.errors import ConfigError
from behemoth.paths import RunPlace


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
