"""Bad input fails on the driver, before Ray starts, with one line that names the culprit."""

import os
from pathlib import Path

import yaml

from behemoth.driver.commands.cli import main
from conftest import job_dict


def test_missing_data_folder_fails_before_ray(tmp_path, capsys, no_ray):
    import ray

    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(tmp_path / "no_such_images", tmp_path / "runs")))
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"data folder {tmp_path / 'no_such_images'} does not exist" in err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()


def test_config_error_exit_code_and_message(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(tmp_path, tmp_path / "runs")))
    assert main(["train", str(cfg), "--set", "train.epoch=3"]) == 2
    assert "unknown key 'train.epoch'; did you mean 'train.epochs'" in capsys.readouterr().err


def test_check_prints_config_and_data_summary(image_root, tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs", data={"cache_dir": str(tmp_path / "c")})))
    assert main(["check", str(cfg), "--set", "train.lr=0.2"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.2" in out and "96 train / 24 val samples, 4 classes" in out
    # the nodes line names the cache folder itself (it named its parent, as if that were the cache)
    assert f"data.cache_dir {tmp_path / 'c'} (or the folder it is made in)" in out


def test_a_node_sees_a_cache_dir_not_made_yet_where_its_folder_is(tmp_path):
    from behemoth.driver.commands.node_check import _sees

    assert _sees("data.cache_dir", str(tmp_path / "cache")) and not _sees("data.root", str(tmp_path / "cache"))
    assert not _sees("data.cache_dir", str(tmp_path / "no" / "cache"))


def test_check_of_bad_data_answers_in_one_line_without_the_config(tmp_path, capsys):
    """A data error is the one line `behemoth check` prints: not after the whole resolved config on stdout."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(tmp_path / "no_such_folder", tmp_path / "runs")))
    assert main(["check", str(cfg)]) != 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no_such_folder" in err


def test_auth_token_file_is_made_owner_only(tmp_path, monkeypatch):
    import stat

    from behemoth.driver.ray_cluster.session import tighten_token_file

    token = tmp_path / "auth_token"
    token.write_text("x" * 64)
    token.chmod(0o644)  # as Ray 2.60 writes a generated token
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert tighten_token_file() == str(token)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert tighten_token_file() is None  # already private: untouched


def test_resume_with_a_changed_model_or_data_config_is_refused(tmp_path):
    import pytest

    from behemoth.storage import checkpoint
    from behemoth.config import ConfigError, dump_yaml
    from behemoth.job import config_from_dict
    from behemoth.driver.run.resume import check_resume_compatible

    job = job_dict(tmp_path / "images", tmp_path / "runs", "r1")
    saved = tmp_path / "runs" / "r1" / "checkpoint_2026-01-01_00-00-00.000000"
    # a complete checkpoint (its manifest written last), as the saver leaves one; its weights do not matter here
    checkpoint.write(saved, checkpoint.Snapshot(state_dicts={}, step=3, texts={
        "job.yaml": dump_yaml(config_from_dict(job)), "train_state.json": '{"step": 3}'}))
    (saved.parent / "checkpoint_2026-01-01_00-00-01.000000").mkdir()  # an upload cut short: never compared

    same = config_from_dict({**job, "train": {**job["train"], "epochs": 5},
                             "data": {**job["data"], "prefetch_batches": 4}})
    check_resume_compatible(same)  # longer training, more prefetch: fine

    other_model = config_from_dict({**job, "model": {"name": "regnet_cifar"}})
    with pytest.raises(ConfigError, match=r"model.name: 'regnet_tiny_cifar' -> 'regnet_cifar'.*resume_changed_config"):
        check_resume_compatible(other_model)
    other_data = config_from_dict({**job, "data": {**job["data"], "image_size": 32}})
    with pytest.raises(ConfigError, match=r"data.image_size: 16 -> 32"):
        check_resume_compatible(other_data)
    other_data.checkpoint.resume_changed_config = True
    check_resume_compatible(other_data)
    check_resume_compatible(config_from_dict({**job, "model": {"name": "regnet_cifar"},
                                              "checkpoint": {**job["checkpoint"], "run_name": "fresh"}}))

    # Another scaling.strategy resumes: both checkpoint layouts load under DDP and FSDP (the conversions:
    # test_speed_switches.py::test_checkpoint_layouts_restore_under_either_strategy).
    check_resume_compatible(config_from_dict({**job, "scaling": {**job["scaling"], "strategy": "fsdp_full"}}))


def _actions(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser.prog, action


def test_every_argument_has_help():
    from behemoth.driver.commands.cli import build_parser

    missing = [f"{prog} {action.dest}" for prog, action in _actions(build_parser()) if not action.help]
    assert missing == []


def test_user_errors_are_one_line_with_their_exit_code(tmp_path, capsys):
    """Three that ended in tracebacks: a class count the demo data cannot have, a malformed sweep YAML, a
    missing cluster file."""
    import pytest

    with pytest.raises(SystemExit) as e:  # argparse: usage, then the one error line
        main(["data", "synth-images", "--out", str(tmp_path / "x"), "--classes", "11"])
    assert e.value.code == 2 and "argument --classes: 11 is not between 1 and 10" in capsys.readouterr().err
    bad = tmp_path / "sweep.yaml"
    bad.write_text("name: [oops\n")
    assert main(["tune", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"behemoth: config error: {bad} is not valid YAML") and err.count("\n") == 1
    assert main(["check-cluster", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"behemoth: config error: cluster file {tmp_path / 'nope.yaml'} does not exist\n"


def test_data_bench_measures_a_number_of_seconds_more_than_zero(tmp_path, capsys):
    """`data bench --seconds nan` measured nothing and recorded 3.6e13 samples/s (`check` then said "feed: ok");
    0 and -5 were tracebacks."""
    import pytest

    from behemoth.driver.commands.data_bench import bench_data
    from behemoth.errors import ConfigError

    for seconds in ("nan", "0", "-5", "inf"):
        with pytest.raises(SystemExit) as e:
            main(["data", "bench", str(tmp_path / "job.yaml"), "--seconds", seconds])
        assert e.value.code == 2 and f"argument --seconds: '{seconds}': give seconds to measure, more than 0" in \
            capsys.readouterr().err
    with pytest.raises(ConfigError, match="--seconds must be a number of seconds > 0, got nan"):
        bench_data(None, seconds=float("nan"))


def test_version_and_python_dash_m():
    import subprocess
    import sys

    import behemoth

    out = subprocess.run([sys.executable, "-m", "behemoth", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"behemoth {behemoth.__version__}"


# A module whose import leaves a marker file: code a checkpoint names runs only if the user names it too.
HOSTILE = """
import pathlib

import torch

from behemoth.tasks.image import ImageClassification

pathlib.Path({marker!r}).write_text("imported")


def build(num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, num_classes))


class Task(ImageClassification):
    pass
"""


def _hostile_module(tmp_path, monkeypatch) -> tuple[str, Path]:
    """(module name, its marker file): the module importable here, one per test (an import stays in sys.modules)."""
    module, marker = f"hostile_{tmp_path.name}", tmp_path / "imported.txt"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{module}.py").write_text(HOSTILE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    return module, marker


def _run_of(tmp_path, job: dict) -> Path:
    """A run folder with one complete checkpoint of a 4-class linear model, whose job.yaml is `job`, written
    as data (building a config from it would import the code it names, here)."""
    import json

    import torch

    from behemoth.storage import checkpoint

    weights = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4)).state_dict()
    saved = tmp_path / "runs" / "given" / "checkpoint_2026-01-01_00-00-00.000000"
    checkpoint.write(saved, checkpoint.Snapshot(state_dicts={"model.pt": weights}, step=3, texts={
        "job.yaml": yaml.safe_dump(job), "train_state.json": '{"step": 3}', "classes.json": json.dumps(list("abcd"))}))
    return saved.parent


def test_export_imports_no_model_builder_that_only_the_checkpoint_names(tmp_path, monkeypatch, capsys):
    module, marker = _hostile_module(tmp_path, monkeypatch)
    run = _run_of(tmp_path, job_dict(tmp_path / "images", tmp_path / "runs", model={"name": f"{module}:build"}))
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"model.name {module}:build is a model builder by import path" in err
    assert f"If you trust it, pass --model-code {module}:build" in err and err.count("\n") == 1
    assert not marker.exists() and not out.exists()

    assert main(["export", str(run), "--out", str(out), "--model-code", f"{module}:build"]) == 0
    assert marker.exists() and (out / "model.safetensors").is_file()
    assert '"builder": "' + module + ':build"' in (out / "behemoth_model.json").read_text()
    (out / "config.json").write_text("{}")  # now a Hugging Face folder: nothing to export from
    assert main(["export", str(out), "--out", str(tmp_path / "again")]) == 2
    assert f"{out} is already a Hugging Face folder, not a behemoth checkpoint" in capsys.readouterr().err


def test_export_writes_a_local_folder_refusing_a_uri_and_expanding_home(tmp_path, monkeypatch, capsys):
    """--out is a local folder: a URI is refused in one line before any checkpoint is read (no code imported,
    nothing written; Path made a folder ./s3:/bucket/x of it), and ~ is the home folder, not a folder named ~."""
    module, marker = _hostile_module(tmp_path, monkeypatch)
    run = _run_of(tmp_path, job_dict(tmp_path / "images", tmp_path / "runs", model={"name": f"{module}:build"}))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for uri in ("s3://bucket/x", "gs://bucket/x"):
        assert main(["export", str(run), "--out", uri, "--model-code", f"{module}:build"]) == 2
        err = capsys.readouterr().err
        assert f"--out {uri} is a URI: export writes a local folder" in err and err.count("\n") == 1
    assert not marker.exists() and os.listdir(tmp_path / "cwd") == []
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert main(["export", str(run), "--out", "~/exported", "--model-code", f"{module}:build"]) == 0
    assert (tmp_path / "home" / "exported" / "model.safetensors").is_file()
    assert os.listdir(tmp_path / "cwd") == []


def test_export_imports_no_task_that_only_the_checkpoint_names(tmp_path, monkeypatch, capsys):
    module, marker = _hostile_module(tmp_path, monkeypatch)
    run = _run_of(tmp_path, job_dict(tmp_path / "images", tmp_path / "runs", data={"kind": f"{module}:Task"},
                                     model={"name": f"{module}:build"}))
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 2
    assert f"data.kind {module}:Task is a task by import path" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(out), "--task-code", f"{module}:Task"]) == 2
    assert f"pass --model-code {module}:build" in capsys.readouterr().err
    assert not marker.exists() and not out.exists()
    assert main(["export", str(run), "--out", str(out), "--task-code", f"{module}:Task", "--model-code",
                 f"{module}:build"]) == 0
    assert marker.exists() and (out / "model.safetensors").is_file()


def test_export_never_honours_trust_remote_code_from_a_checkpoint(tmp_path, capsys):
    """A checkpoint's model.trust_remote_code would run its model.pretrained repository's code: refused
    unless the user passes --trust-remote-code (then the warning names the repository)."""
    from behemoth.driver.commands.export import TrustedCode, _job_of

    repo = tmp_path / "someone" / "model"
    run = _run_of(tmp_path, {
        "data": {"kind": "text", "train_files": ["a.jsonl"], "val_fraction": 0.1, "tokenizer": "tok"},
        "model": {"name": "causal_lm", "pretrained": str(repo), "trust_remote_code": True}})
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert f"model.trust_remote_code is true, which would run the code of repository {repo}" in err
    assert "does not honour it from a checkpoint. If you trust that repository, pass --trust-remote-code" in err
    assert _job_of(str(run), TrustedCode(trust_remote_code=True)).model.trust_remote_code is True


def test_the_command_ends_at_once_with_its_status_its_output_and_exit_handlers_done(tmp_path):
    """exit_at_once (the `behemoth` command's end) skips only the interpreter's teardown: the status is kept,
    buffered output is out, atexit handlers ran."""
    import subprocess
    import sys
    from pathlib import Path

    script = (f"import atexit, sys\n"
              f"atexit.register(lambda: open({str(tmp_path / 'handler_ran')!r}, 'w').write('yes'))\n"
              f"from behemoth.driver.commands.cli import exit_at_once\n"
              f"sys.stdout.write('buffered, no newline')\n"
              f"exit_at_once(3)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2] / "platform")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 3 and done.stdout == "buffered, no newline"
    assert (tmp_path / "handler_ran").read_text() == "yes"
    bad = subprocess.run([sys.executable, "-m", "behemoth", "check", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "behemoth: config error:" in bad.stderr


def test_resume_or_eval_on_data_whose_classes_changed_is_refused(tmp_path, monkeypatch, capsys):
    """The data config unchanged but its class folders changed: `train` refuses to resume, saying what moved
    (counts, the first index naming another class, names new and gone), before any worker starts; a class
    added cannot be forced (the head has another shape), nor a folder replaced (same count: issue 65 item 7,
    checkpoint.resume_changed_config let the labels be renamed; it is about changed config keys); a checkpoint
    without classes.json (written before it was kept) and another run name go on. `eval` of the checkpoint on
    such data is refused too (its accuracy would score indices against other names)."""
    import shutil

    import pytest
    import torch

    from behemoth.storage import checkpoint
    from behemoth.config import ConfigError, dump_yaml
    from behemoth.data.image.synth import write_synth_images
    from behemoth.driver.run import evaluation as evaluate
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import resume
    from behemoth.driver.run import trainer
    from behemoth.job import config_from_dict
    from behemoth.tasks.image import ImageClassification

    root = tmp_path / "images"
    write_synth_images(root, classes=3, per_class=2, val_per_class=1, size=16, seed=0)
    # (a global batch the 6 training images fill: an epoch of no step is refused before anything else)
    job = job_dict(root, tmp_path / "runs", "r1", data={"cache_dir": str(tmp_path / "cache")},
                   train={"global_batch_size": 4})
    cfg = config_from_dict(job)
    index = ImageClassification.check(cfg)
    saved = tmp_path / "runs" / "r1" / "checkpoint_2026-01-01_00-00-00.000000"
    checkpoint.write(saved, checkpoint.Snapshot(state_dicts={"model.pt": {"w": torch.zeros(1)}}, step=3, texts={
        "job.yaml": dump_yaml(cfg), "train_state.json": '{"step": 3}',
        **ImageClassification.checkpoint_files(cfg, index)}))
    assert index.classes == ["disk_warm", "ring_warm", "square_warm"]
    resume.check_resume_data(cfg, index)  # the same classes: resumes
    forced = config_from_dict({**job, "checkpoint": {**job["checkpoint"], "resume_changed_config": True}})

    for split in ("train", "val"):  # a class added, sorting first: every index shifts
        shutil.copytree(root / split / "disk_warm", root / split / "aardvark")
    grown = ImageClassification.check(cfg)
    with pytest.raises(ConfigError, match=r"trained on other data \(checkpoint_2026.*\): its classes.json lists 3, "
                                          r"this data 4; index 0 was 'disk_warm', is 'aardvark'; new: 'aardvark'\. "
                                          r"Start a new run .* \(its weights cannot resume with another number"):
        resume.check_resume_data(cfg, grown)
    resume.check_resume_data(config_from_dict({**job, "checkpoint": {**job["checkpoint"], "run_name": "r2"}}),
                              grown)

    for split in ("train", "val"):  # ... and one removed: the same count, names on other indices
        shutil.rmtree(root / split / "ring_warm")
    replaced = ImageClassification.check(cfg)
    with pytest.raises(ConfigError, match=r"lists 3, this data 3; index 0 was 'disk_warm', is 'aardvark'; new: "
                                          r"'aardvark'; gone: 'ring_warm'\. Start a new run .* \(its weights "
                                          r"would train on with their labels renamed\)$"):
        resume.check_resume_data(cfg, replaced)
    with pytest.raises(ConfigError, match=r"lists 3, this data 3; index 0 was 'disk_warm', is 'aardvark'"):
        resume.check_resume_data(forced, replaced)
    with pytest.raises(ConfigError, match=r"this data 4; index 0 was 'disk_warm', is 'aardvark'"):
        resume.check_resume_data(forced, grown)

    # Wired into `train` (refused after the data is prepared, before Ray Train is asked for anything) and `eval`.
    monkeypatch.setattr(ray_session, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "build_trainer", lambda *a, **k: pytest.fail("a trainer was built"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["train", str(tmp_path / "job.yaml")]) == 2  # a config error
    assert "classes.json lists 3, this data 3" in capsys.readouterr().err
    monkeypatch.setattr("ray.put", lambda *a: pytest.fail("an evaluation was started"))
    with pytest.raises(ConfigError, match=r"checkpoint .*checkpoint_2026.* was trained on other data than this "
                                          r"job's: its classes.json lists 3, this data 3; index 0"):
        evaluate.evaluate_checkpoint(cfg, str(saved))

    # written before classes.json was kept: neither the folder nor its manifest has it
    (saved / "classes.json").unlink()
    kept = [p.name for p in sorted(saved.iterdir()) if p.name != checkpoint.MANIFEST]
    checkpoint.commit(saved, checkpoint.hash_files(saved, kept), checkpoint.FORMAT_VERSION)
    resume.check_resume_data(cfg, replaced)


def test_export_refuses_a_checkpoint_whose_classes_json_was_edited(tmp_path, capsys):
    """classes.json names the classes of an image export (id2label): checked against the manifest as
    labels.json is (tests/unit/test_labelled_text.py), an edited one is one error naming it."""
    import pytest
    from behemoth.errors import CheckpointError
    from behemoth.job import config_from_dict
    from behemoth.tasks.image import ImageClassification

    job = job_dict(tmp_path / "images", tmp_path / "runs")
    saved = next(_run_of(tmp_path, job).iterdir())
    (saved / "classes.json").write_text('["d", "c", "b", "a"]')
    with pytest.raises(CheckpointError, match=rf"checkpoint {saved}: classes.json does not match its manifest"):
        ImageClassification.model_from_checkpoint(config_from_dict(job), str(saved))


def _check(tmp_path, job: dict, capsys) -> tuple[int, str]:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job))
    code = main(["check", str(cfg)])
    return code, capsys.readouterr().err


def test_check_refuses_what_cannot_work_before_ray(image_root, tmp_path, capsys, monkeypatch):
    """Issue 59 item 3: a model.pretrained folder that does not exist, or is no model folder; a malformed Hub
    name; train.init_from that does not exist; a global batch larger than the training split: each one line,
    exit 2, before Ray (nothing of the rest of the check printed). Offline, a Hub name this machine's cache does
    not hold is one line in seconds, not transformers' half minute of retries."""
    import time

    from behemoth.models import sources
    from conftest import lm_job_dict
    from pathlib import Path as _Path

    corpus = _Path(__file__).parent  # (any folder: the checks below stop before the text is read)
    lm = lm_job_dict(corpus, tmp_path)
    lm["model"] = {"name": "causal_lm", "pretrained": "/models/llama-1b"}
    assert _check(tmp_path, lm, capsys) == (2, "behemoth: config error: model.pretrained /models/llama-1b: no such "
                                               "folder on this machine. A local model is a folder that from_pretrained "
                                               "reads (config.json, weights, tokenizer files), on every node that "
                                               "trains; or give a Hugging Face Hub name (org/name)\n")
    (tmp_path / "not-a-model").mkdir()
    lm["model"]["pretrained"] = str(tmp_path / "not-a-model")
    assert "the folder has no config.json" in _check(tmp_path, lm, capsys)[1]
    lm["model"]["pretrained"] = "meta llama/Llama 3"
    assert "is neither a folder on this machine nor a Hugging Face Hub name" in _check(tmp_path, lm, capsys)[1]

    from huggingface_hub import constants

    # (restored after the test: the probe sets them for the process; huggingface_hub read HF_ENDPOINT when imported)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a Hub that does not answer
    sources.hub_reachable.cache_clear()
    lm["model"]["pretrained"] = "behemoth-tests/no-such-model"
    started = time.time()
    code, err = _check(tmp_path, lm, capsys)
    assert code == 2 and "not in this machine's Hugging Face cache and the Hub is unreachable" in err
    assert "hf download behemoth-tests/no-such-model --local-dir DIR" in err
    assert time.time() - started < 10 and os.environ["HF_HUB_OFFLINE"] == "1"  # found once; nothing retries
    assert constants.is_offline_mode()  # where huggingface_hub and transformers read it
    sources.hub_reachable.cache_clear()

    job = job_dict(image_root, tmp_path / "runs", train={"init_from": str(tmp_path / "no-run")})
    assert "train.init_from: " in _check(tmp_path, job, capsys)[1]
    (tmp_path / "empty-run").mkdir()  # under a URI too (file://: the object-store arm): read before Ray, refused
    job = job_dict(image_root, tmp_path / "runs", train={"init_from": f"file://{tmp_path}/empty-run"})
    code, err = _check(tmp_path, job, capsys)
    assert code == 2 and err.startswith("behemoth: config error: train.init_from: ") and "is not a behemoth checkpoint" in err
    job = job_dict(image_root, tmp_path / "runs", train={"global_batch_size": 4096})
    assert _check(tmp_path, job, capsys) == (2, "behemoth: config error: train.global_batch_size 4096 exceeds the 96 "
                                                "training samples: an epoch would have no step. Lower it to at most "
                                                "96 (a divisor of the workers' split: scaling.num_workers x "
                                                "micro-batch), or add data\n")


def test_a_missing_data_folder_suggests_demo_data_somewhere_else(tmp_path, capsys):
    """The suggestion for a missing image folder never writes into the user's data path (issue 59)."""
    job = job_dict(tmp_path / "imagenet", tmp_path / "runs")
    code, err = _check(tmp_path, job, capsys)
    assert code != 0 and f"--out {tmp_path / 'imagenet'}" not in err and "synth-images --out /tmp/" in err


def test_check_takes_a_sweep_yaml_and_checks_every_trials_job_offline(image_root, tmp_path, capsys):
    """`behemoth check SWEEP.yaml` (issue 59): the sweep, every trial's job and the data, without Ray: a batch
    size in the space that the data cannot fill is refused; a sweep on object storage is refused with the fix;
    a good one prints the data and a summary."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs")))
    sweep = {"job": "job.yaml", "space": {"train.lr": {"grid": [0.01, 0.1]}, "train.global_batch_size": {"grid": [16, 32]}},
             "metric": "val_accuracy", "name": "s", "storage_path": str(tmp_path / "sweeps")}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# data: 96 train / 24 val samples, 4 classes" in out
    assert "# sweep s: 4 trial jobs checked (" in out and "metric val_accuracy (max)" in out
    path.write_text(yaml.safe_dump({**sweep, "space": {"train.global_batch_size": {"grid": [16, 4096]}}}))
    assert main(["check", str(path)]) == 2
    assert "train.global_batch_size 4096 exceeds the 96 training samples" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**sweep, "storage_path": "s3://bucket/sweeps"}))
    assert main(["check", str(path)]) == 2
    assert "an object store is not supported for sweeps yet" in capsys.readouterr().err


def test_a_rerun_says_which_changed_keys_apply_and_which_are_ignored(image_root, tmp_path):
    """Issue 59 item 4, without Ray: against the latest checkpoint's job.yaml, a changed train.epochs applies,
    a changed train.lr is ignored (the optimizer's comes back) and says why, a changed global batch is refused
    unless resume_changed_config; a complete run rerun with an ignored change fails, one with none passes."""
    from types import SimpleNamespace

    import pytest
    import torch

    from behemoth.config import ConfigError, dump_yaml
    from behemoth.driver.run.resume import check_something_trained, describe_rerun
    from behemoth.job import config_from_dict
    from behemoth.storage import checkpoint

    job = job_dict(image_root, tmp_path / "runs", "r", train={"epochs": 2, "lr": 0.05})
    checkpoint.write(tmp_path / "runs" / "r" / "checkpoint_2026-01-01_00-00-00.000000", checkpoint.Snapshot(
        state_dicts={"model.pt": {"w": torch.zeros(1)}}, step=12,
        texts={"job.yaml": dump_yaml(config_from_dict(job)), "train_state.json": '{"step": 12}'}))
    assert describe_rerun(config_from_dict(job)) is None  # the same config: nothing to say
    changed = config_from_dict({**job, "train": {**job["train"], "epochs": 4, "lr": 0.01}})
    rerun = describe_rerun(changed)
    assert rerun.step == 12 and rerun.applied == ["train.epochs 2 -> 4"]
    assert rerun.ignored == ["train.lr 0.05 -> 0.01 (the optimizer's settings come back with its state from the "
                             "checkpoint)"]
    assert "To start a new run with these settings instead: --set checkpoint.run_name=NEW_NAME" in rerun.line(changed)
    with pytest.raises(ConfigError, match=r"cannot resume with train.global_batch_size 16 -> 32 \(the position in "
                                          r"the data is counted in steps of the global batch\)"):
        describe_rerun(config_from_dict({**job, "train": {**job["train"], "global_batch_size": 32}}))
    forced = config_from_dict({**job, "train": {**job["train"], "global_batch_size": 32},
                               "checkpoint": {**job["checkpoint"], "resume_changed_config": True}})
    assert describe_rerun(forced).applied == ["train.global_batch_size 16 -> 32 (the position in the data is counted "
                                              "in steps of the global batch), applied anyway "
                                              "(checkpoint.resume_changed_config)"]
    complete = SimpleNamespace(metrics={"step": 12}, resumed_from_step=12)
    with pytest.raises(ConfigError, match=r"was already complete at step 12: nothing was trained, and train.lr "
                                          r"0.05 -> 0.01"):
        check_something_trained(changed, rerun, complete)
    check_something_trained(changed, rerun, SimpleNamespace(metrics={"step": 24}, resumed_from_step=12))
    only_applied = config_from_dict({**job, "train": {**job["train"], "log_every": 5}})
    check_something_trained(only_applied, describe_rerun(only_applied), complete)


def test_a_lane_trials_rerun_is_checked_like_a_runs(image_root, tmp_path, monkeypatch, capsys):
    """Issue 68 item 1: one run sequence for every way a run starts. A sweep's lane skipped describe_rerun, so a
    trial's rerun with a key that would skip or repeat samples (train.global_batch_size) resumed anyway; now a
    lane trial and a run refuse it alike, in the same words, before any data is prepared; a safe change is said
    in the same line by both."""
    import pytest
    import torch

    from behemoth.config import ConfigError, dump_yaml
    from behemoth.driver.run import sequence, trainer
    from behemoth.driver.sweep import lane
    from behemoth.job import config_from_dict
    from behemoth.storage import checkpoint

    job = job_dict(image_root, tmp_path / "runs", "r", train={"epochs": 2, "lr": 0.05})
    checkpoint.write(tmp_path / "runs" / "r" / "checkpoint_2026-01-01_00-00-00.000000", checkpoint.Snapshot(
        state_dicts={"model.pt": {"w": torch.zeros(1)}}, step=12,
        texts={"job.yaml": dump_yaml(config_from_dict(job)), "train_state.json": '{"step": 12}'}))
    unsafe = config_from_dict({**job, "train": {**job["train"], "global_batch_size": 32}})
    for where in (trainer, sequence):
        monkeypatch.setattr(where, "prepare_data", lambda *a, **k: pytest.fail("the data was prepared"))
    refusals = []
    for start in (lambda cfg: trainer.train(cfg), lambda cfg: lane.train_in_lane(cfg)):
        with pytest.raises(ConfigError, match=r"cannot resume with train.global_batch_size 16 -> 32") as refused:
            start(unsafe)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1]

    class Prepared(Exception):
        pass

    for where in (trainer, sequence):
        monkeypatch.setattr(where, "prepare_data", lambda *a, **k: (_ for _ in ()).throw(Prepared()))
    safe = config_from_dict({**job, "train": {**job["train"], "epochs": 4}})
    said = []
    for start in (lambda cfg: trainer.train(cfg), lambda cfg: lane.train_in_lane(cfg)):
        with pytest.raises(Prepared):  # (checked, said, then on to preparing the data)
            start(safe)
        said.append([line for line in capsys.readouterr().out.splitlines() if "rerun of run 'r'" in line])
    assert said[0] == said[1] and len(said[0]) == 1 and "changed keys that apply from step 12: train.epochs 2 -> 4" \
        in said[0][0]


def test_check_refuses_a_number_that_is_not_one_and_a_section_turned_on_by_false_in_one_line(image_root, tmp_path,
                                                                                              capsys, no_ray):
    """Issue 65 items 2 and 3: `behemoth check` passed train.lr=.nan, grad_clip -1 (gradient ascent) and
    grad_clip .nan (NaN updates that the guard, reading the pre-clip norm, let through), and printed
    train.early_stopping=false as early stopping with patience 3. Each is one line naming the key, before Ray."""
    import ray

    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs")))
    for override, line in (("train.lr=.nan", "train.lr must be a finite number, got nan"),
                           ("train.grad_clip=.nan", "train.grad_clip must be a finite number, got nan"),
                           ("train.grad_clip=-1", "train.grad_clip must be > 0, got -1.0"),
                           ("train.early_stopping=0", "train.early_stopping is a section: give a mapping")):
        assert main(["check", str(cfg), "--set", override]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and line in err and str(cfg) in err, (override, err)
    assert main(["check", str(cfg), "--set", "train.early_stopping=false"]) == 0
    assert "early_stopping: null" in capsys.readouterr().out
    assert not ray.is_initialized()


def test_resume_changed_config_lets_through_only_changed_keys_and_the_checkpoints_job_yaml_is_verified(
        image_root, tmp_path, capsys, monkeypatch, no_ray):
    """Issue 65 item 7: checkpoint.resume_changed_config said "applied anyway" to sgd -> adamw (AdamW then failed
    to load SGD's state with KeyError 'step' in every worker, retried as a run failure): another optimizer is
    refused whatever the config, in one line from `train` before Ray. describe_rerun read the checkpoint's
    job.yaml without its manifest (`train: [1]`: an AttributeError): it is read as export reads one; a verified
    one that is not a job config is one line, an edited one is damage (skipped for the older checkpoint, as
    restore skips it)."""
    import json

    import pytest
    import torch

    from behemoth.config import ConfigError, dump_yaml
    from behemoth.driver.run import trainer
    from behemoth.driver.run.resume import check_resume_compatible, describe_rerun
    from behemoth.errors import CheckpointError
    from behemoth.job import config_from_dict
    from behemoth.storage import checkpoint

    job = job_dict(image_root, tmp_path / "runs", "r", train={"epochs": 2, "lr": 0.05})
    run = tmp_path / "runs" / "r"

    def saved(name, step, job_yaml):
        return checkpoint.write(run / f"checkpoint_2026-01-01_00-00-{name}.000000", checkpoint.Snapshot(
            state_dicts={"model.pt": {"w": torch.zeros(1)}}, step=step,
            texts={"job.yaml": job_yaml, "train_state.json": json.dumps({"step": step})}))

    saved("00", 6, dump_yaml(config_from_dict(job)))
    adamw = {**job, "train": {**job["train"], "optimizer": "adamw"}}
    for forced in (False, True):
        other = config_from_dict({**adamw, "checkpoint": {**job["checkpoint"], "resume_changed_config": forced}})
        with pytest.raises(ConfigError, match=r"cannot resume with train.optimizer 'sgd' -> 'adamw' \(the checkpoint "
                                              r"holds the other optimizer's state, which this one cannot load; "
                                              r"checkpoint.resume_changed_config does not change that\)\. To start a "
                                              r"new run .*train.init_from="):
            describe_rerun(other)
    monkeypatch.setattr(trainer, "prepare_data", lambda *a, **k: pytest.fail("the data was prepared"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(adamw))
    assert main(["train", str(tmp_path / "job.yaml"), "--set", "checkpoint.resume_changed_config=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot resume with train.optimizer 'sgd' -> 'adamw'" in err

    # a newer checkpoint whose job.yaml was written so (its manifest made over it): one line naming it
    newer = saved("01", 12, "data: {kind: image_folder}\ntrain: [1]\n")
    for check in (describe_rerun, check_resume_compatible):
        with pytest.raises(CheckpointError, match=rf"checkpoint {newer}: its job.yaml's train is a list, not a "
                                                  rf"section \(a mapping of keys\)$"):
            check(config_from_dict(job))
    # ... edited after its manifest: damage; restore resumes from the older one, and so does the comparison
    (newer / "job.yaml").write_text(dump_yaml(config_from_dict({**job, "train": {**job["train"], "epochs": 9}})))
    changed = config_from_dict({**job, "train": {**job["train"], "epochs": 4}})
    rerun = describe_rerun(changed)
    assert rerun.step == 6 and rerun.applied == ["train.epochs 2 -> 4"]
    check_resume_compatible(changed)
    # its train_state.json (the rerun's step) is read the same way: one that is not a train state is ranked
    # unreadable, as restore ranks it; one edited after its manifest is damage (it said step 30 before)
    import shutil

    def _recommit(ckpt):  # its manifest made over what is there now: written so, not damaged
        manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
        checkpoint.commit(ckpt, checkpoint.hash_files(ckpt, list(manifest["files"])), manifest["format_version"])

    shutil.rmtree(newer)
    newest = saved("02", 18, dump_yaml(config_from_dict(job)))
    (newest / "train_state.json").write_text(json.dumps({"step": 18}))
    _recommit(newest)
    assert describe_rerun(changed).step == 18
    (newest / "train_state.json").write_text(json.dumps({"stpe": 18, "epoch": 3}))
    _recommit(newest)
    assert describe_rerun(changed).step == 6  # ranked unreadable (step -1) by restore too: the older one
    (newest / "train_state.json").write_text(json.dumps({"step": 30}))  # after its manifest: damage
    assert describe_rerun(changed).step == 6
