"""Shared fixtures, the tiers, and the suite's own folder.

Everything the suite makes lives in one folder, bh-test-*, in the system's temp directory: Ray's auth token,
every Ray instance's session (TMPDIR points there before anything starts Ray, and Ray's default temp dir
follows TMPDIR), pytest's tmp_path folders and what behemoth's workers put in TMPDIR. It is removed when the
run passes and kept, named on the last line, when a test failed (the Ray logs of a failure are there).

Tiers: a test under tests/integration/ is marked `integration` (here, whatever its module says) and belongs to
the full tier only, unless it is also marked `quick`: `./run.sh test` runs `-m "quick or not integration"`
(every unit test and one end-to-end check per capability), `./run.sh test-full` everything (docs/testing.md).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from pathlib import Path

import pytest

# Made by pytest_configure, not at import: Ray's workers import this module too (a test module's function, run
# in a worker, imports its module and so this one), and a folder made there would never be removed.
_SESSION_DIR: Path = None  # type: ignore[assignment]
REPO = Path(__file__).resolve().parents[1]
# What Ray's workers of the tests' instances import from: the test modules (a test's own train loop, by name),
# this checkout's behemoth (even where the virtual environment's editable install points at another checkout)
# and the examples by their import paths from the repository root (examples.custom_model:...); then what the
# suite's own PYTHONPATH holds (the GPU kit's packages on the lent GPU machine, Ray among them: the runtime
# environment's PYTHONPATH replaces the workers' inherited one).
WORKER_PYTHONPATH = os.pathsep.join([str(REPO / "tests"), str(REPO / "platform"), str(REPO),
                                     *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def pytest_addoption(parser):
    parser.addoption("--bystander-ray", action="store_true",
                     help="start a Ray instance of its own beside the suite and fail the run if the suite ended it "
                          "(the full tier: tests touch only what they started)")


def pytest_configure(config):
    global _SESSION_DIR
    _SESSION_DIR = Path(tempfile.mkdtemp(prefix="bh-test-"))
    # Before anything imports ray: every temp folder of this process and of the processes it starts (Ray's
    # sessions, `ray start`, Ray workers, behemoth's staging folders) goes into the session's folder. Ray's
    # default temp dir is $TMPDIR/ray: a local instance the tests start can then neither find nor join a
    # cluster a user started with `ray start` (Ray looks for one in its default temp dir).
    os.environ["TMPDIR"] = str(_SESSION_DIR)
    tempfile.tempdir = str(_SESSION_DIR)
    # Token auth on (as in production), with a throwaway token.
    token = _SESSION_DIR / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    os.environ.pop("RAY_ADDRESS", None)  # never a cluster of the user's
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # transformers' log handler writes to the sys.stderr of the moment it is made: made inside a test that captures
    # output (where transformers is first imported), it wrote to that test's closed stream ever after, and a later
    # test's stderr got "--- Logging error ---" (seen once the unit tests ran in two processes, in another order)
    from transformers.utils import logging as transformers_logging

    transformers_logging.get_logger()
    if config.getoption("--bystander-ray"):
        from bystander import Bystander

        config._bystander = Bystander.start(_SESSION_DIR / "bystander")


# The integration modules that use the shared local Ray instance run next to each other (its start-up paid once);
# then those with an instance of their own: test_fault_tolerance.py (a multi-node cluster), test_token_store.py (a
# small object store) and test_s3.py (its workers need the S3 variables); the unit tests last.
_RUNS_LATE = {"test_fault_tolerance.py": 1, "test_token_store.py": 2, "test_s3.py": 3}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the tier's markers must be on the items by then
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name == "integration":
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: _RUNS_LATE.get(item.path.name, 0) if item.path.parent.name == "integration"
               else max(_RUNS_LATE.values()) + 1)
    # (a stable sort: otherwise pytest's order)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def image_root(tmp_path_factory) -> Path:
    """A small synthetic ImageFolder: 4 classes, 24 train + 6 val images each, 16x16 PNGs."""
    from behemoth.data.image.synth import write_synth_images

    root = tmp_path_factory.mktemp("images")
    write_synth_images(root, classes=4, per_class=24, val_per_class=6, size=16, seed=1)
    return root


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MB filesystem (tmpfs), where this machine lets the test mount one (it needs root): a full disk
    as the kernel reports it (test_checkpoint.py, test_image_cache.py). Where it cannot, the test skips; each
    has a twin with ENOSPC injected that runs everywhere."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 1 MB tmpfs here ({done.stderr.strip()}); the tests with ENOSPC injected "
                    f"still cover a full disk")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


# The tests' local Ray instance, kept from one module to the next (starting Ray, and the one-time work of a first
# fit on a new instance — Ray Data's and Ray Train's helper actors, the decode workers — cost ~12 s on 2 cores).
# It is started again when the environment its workers inherit has changed (test_s3.py's AWS variables), and
# stopped before a module starts Ray its own way (stop_local_ray: a multi-node cluster, the dashboard).
_LOCAL_RAY: dict = {"env": None}
_INHERITED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def stop_local_ray() -> None:
    if _LOCAL_RAY["env"] is not None:
        import ray

        ray.shutdown()
        _LOCAL_RAY["env"] = None


@pytest.fixture(autouse=True)
def _signal_handlers_as_found():
    """Each test leaves the process's Ctrl-C handling as it found it: a test that runs Ray Train's or Tune's fit
    itself (not through behemoth, which puts them back) leaves their SIGINT handler installed, and a later test
    whose Ctrl-C must interrupt (the run lock giving up a lease) then interrupted nothing."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def no_ray():
    """No Ray in this process when the test starts (the suite's shared instance stopped if a module before this
    one left it running), so that a test can check that the code it calls did not start one."""
    import ray

    stop_local_ray()
    if ray.is_initialized():  # a connection of this process's own (a module that started Ray its own way)
        ray.shutdown()
    yield


@pytest.fixture(scope="module")
def ray_local():
    """The shared local Ray instance (see _LOCAL_RAY), started if this module needs a new one."""
    import ray
    from behemoth.driver.ray_cluster.session import LOCAL_RAY_SYSTEM_CONFIG, PREEMPTION_WATCHER_ENV

    env = {k: os.environ.get(k) for k in _INHERITED}
    # As on the local instance behemoth starts (ray_session.set_ray_train_env): no preemption watcher, one process
    # fewer to start with every worker group; set in the driver while this module runs only (the modules that
    # start Ray another way, `ray start` or a cluster of their own, keep Ray's default; the shared instance's
    # processes keep what they inherited when it started).
    ours = PREEMPTION_WATCHER_ENV not in os.environ
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    if _LOCAL_RAY["env"] != env or not ray.is_initialized():
        stop_local_ray()
        # as behemoth starts a local instance (workers at niceness 0)
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", _system_config=LOCAL_RAY_SYSTEM_CONFIG,
                 _temp_dir=tempfile.mkdtemp(prefix="ray-", dir=_SESSION_DIR),
                 runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
        _LOCAL_RAY["env"] = env
    try:
        yield
    finally:
        if ours:
            os.environ.pop(PREEMPTION_WATCHER_ENV, None)


@pytest.fixture(scope="session", autouse=True)
def _local_ray_stops_at_the_end():
    yield
    stop_local_ray()


def job_dict(image_root: Path, storage: Path, run_name: str = "t", **sections) -> dict:
    """A tiny image job: 2 workers, 16x16 images, a tiny ResNet. `sections` update the defaults per section."""
    job = {
        "data": {"kind": "image_folder", "root": str(image_root), "image_size": 16, "crop_padding": 2,
                 "cpus_per_task": 0.25, "prefetch_batches": 1},
        "model": {"name": "regnet_tiny_cifar"},
        "train": {"epochs": 2, "global_batch_size": 16, "lr": 0.05, "warmup_steps": 2, "log_every": 2},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1},
        "checkpoint": {"every_n_steps": 3, "keep": 2, "storage_path": str(storage), "run_name": run_name},
        "eval": {"per_epoch": True},
        "failure": {"max_failures": 0},
        "tracking": {"report": False},  # ~2 s of plotting per run; tests/integration/test_tracking.py draws it
    }
    for section, values in sections.items():
        job[section].update(values)
    return job


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    """A small generated story corpus (train.jsonl 240 documents, val.jsonl 40) and a BPE tokenizer for it."""
    from behemoth.data.text.synth_text import write_synth_text
    from behemoth.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("text")
    write_synth_text(root, train_documents=240, val_documents=40, seed=3)
    train_tokenizer([str(root / "train.jsonl")], root / "tokenizer", vocab_size=400)
    return root


def lm_job_dict(corpus: Path, storage: Path, run_name: str = "lm", **sections) -> dict:
    """A tiny causal-LM job: 2 workers, blocks of 32 tokens, a 2-layer Llama of width 32."""
    job = {
        "data": {"kind": "text", "train_files": [str(corpus / "train.jsonl")],
                 "val_files": [str(corpus / "val.jsonl")], "tokenizer": str(corpus / "tokenizer"), "seq_len": 32,
                 "cache_dir": str(storage / "cache"), "cpus_per_task": 0.25},
        "model": {"name": "causal_lm", "hf_config": {
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}},
        "train": {"epochs": 1, "max_steps": 16, "global_batch_size": 16, "optimizer": "adamw", "lr": 0.01,
                  "weight_decay": 0.0, "warmup_steps": 2, "log_every": 4},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1},
        "checkpoint": {"every_n_steps": 8, "keep": 3, "storage_path": str(storage), "run_name": run_name},
        "eval": {"every_n_steps": 8, "per_epoch": False},
        "failure": {"max_failures": 0},
        "tracking": {"report": False},  # as job_dict
    }
    for section, values in sections.items():
        job[section].update(values)
    return job


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """Run fn() in a thread; its return value (or exception) lands in the dict as "value" (or "error")."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def closable(closed: list):
    """An iterator class whose close() is recorded in `closed` (a Ray Data iterator, a task's pipeline)."""

    class Closable:
        def __init__(self, items):
            self.items = iter(items)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

        def close(self):
            closed.append(True)

    return Closable


def stand_in_venv(root: Path, pip: str = "exit 0") -> Path:
    """A virtual environment for run.sh (BEHEMOTH_VENV) whose python runs this one and whose pip runs `pip` (a
    shell line): run.sh's install step, without an install."""
    import sys

    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "pip").write_text(f"#!/bin/sh\n{pip}\n")
    for tool in ("python", "pip"):
        (venv / "bin" / tool).chmod(0o755)
    return venv


def train_worker_pids() -> list[int]:
    """Ray Train's worker processes (`ray::RayTrainWorker...`) of the Ray instances this test process started:
    its descendants only (a local instance's raylet and a test cluster's nodes are children of this process),
    never a worker of a user's cluster or of another suite on the machine."""
    return [pid for pid, cmdline in descendants(os.getpid()).items() if cmdline.startswith(b"ray::RayTrainWorker")]


def descendants(root: int) -> dict[int, bytes]:
    """{pid: command line} of every living descendant of process `root`, from /proc."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = cmdlines[child]
            todo.append(child)
    return found


# Once in a fresh-clone run of the whole suite (98 passed, results reported) the interpreter then died with a
# segmentation fault while finalising — native threads of Ray / torch / tokenizers torn down at exit — and
# the run's exit status became 139. Root cause not found (not reproducible with the unit tests alone). So
# that the status reflects the tests, the process ends with pytest's own exit status right after pytest has
# finished everything it does, skipping interpreter finalisation.
_EXIT_STATUS = None


def pytest_sessionfinish(session, exitstatus):
    global _EXIT_STATUS
    bystander = getattr(session.config, "_bystander", None)
    if bystander is not None:
        problem = bystander.check_and_stop()
        if problem:
            session.config.get_terminal_writer().line(f"FAILED bystander Ray instance: {problem}", red=True)
            exitstatus = int(pytest.ExitCode.TESTS_FAILED) if int(exitstatus) == 0 else exitstatus
        else:
            session.config.get_terminal_writer().line(
                "bystander Ray instance (started beside the suite, its own temp dir): alive at the end", green=True)
    _EXIT_STATUS = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # The session's folder goes with a passing run; a failed run's is kept for its logs and tmp_path folders.
    import shutil
    import sys

    if _SESSION_DIR is not None:
        if _EXIT_STATUS in (None, 0, int(pytest.ExitCode.NO_TESTS_COLLECTED)):
            shutil.rmtree(_SESSION_DIR, ignore_errors=True)
        else:
            sys.stdout.write(f"\nthe suite's folder is kept for inspection (Ray logs, tmp_path folders): "
                             f"{_SESSION_DIR}\n")
    if _EXIT_STATUS is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS)
