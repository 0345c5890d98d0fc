"""Driver side: the Ray instance a run uses, and what behemoth sets on it. Connect to the cluster RAY_ADDRESS
names (as under `ray job submit`), or start a local instance tuned for a machine whose workers are the workload;
the environment every training worker starts with; Ray Train's settings behemoth chooses; the data processes
started ahead on a local instance; and Ray's shutdown when behemoth started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from behemoth.config import JobConfig
from behemoth.tasks import task_of

_RAY_STARTED_HERE = False  # ensure_ray called ray.init in this process (not the caller)


def ensure_ray(num_cpus: int | None = None) -> None:
    """Connect to the cluster named by RAY_ADDRESS (as under `ray job submit`), or start a local one (with
    `num_cpus` CPUs where given: `behemoth data bench --cpus`; all of the machine's otherwise).

    On an existing cluster the nodes may not have behemoth installed: the package travels with the job as a
    runtime_env `py_modules` entry (uploaded once, cached per node). A local instance shares this process's
    environment and needs nothing.
    """
    import ray

    from behemoth.driver.ray_cluster import output_filter as ray_console
    if os.environ.get("RAY_ADDRESS") and num_cpus is not None:  # (refused whether or not this process is connected)
        from behemoth.errors import ConfigError

        raise ConfigError(f"--cpus {num_cpus} sizes a local Ray instance; RAY_ADDRESS names a running cluster, "
                          f"whose CPUs are its own: unset one of them")
    if ray.is_initialized():
        # A Python caller connected already: the bench would run on the instance's CPUs and say num_cpus.
        if num_cpus is not None and (held := ray.cluster_resources().get("CPU", 0)) != num_cpus:
            from behemoth.errors import ConfigError

            raise ConfigError(f"--cpus {num_cpus} sizes a local Ray instance, but this process is connected to one "
                              f"with {held:g} CPUs already: call it before ray.init, or leave --cpus out")
        ray_console.install()
        return
    if os.environ.get("RAY_ADDRESS"):
        options = {"runtime_env": {"py_modules": [package_folder()]}}
    else:
        # behemoth's worker variables for the whole job, not only Ray Train's workers: see warm_up_data_processes
        options = {"_system_config": LOCAL_RAY_SYSTEM_CONFIG, "runtime_env": {"env_vars": worker_env_vars()},
                   **({"num_cpus": num_cpus} if num_cpus is not None else {})}
        ray_console.quiet_token_auth_notice()
    ray.init(logging_level="warning", log_to_driver=True, **options)
    global _RAY_STARTED_HERE
    _RAY_STARTED_HERE = True
    ray_console.install()
    tighten_token_file()


def package_folder() -> str:
    """The folder of behemoth's package (platform/behemoth), which a job's `py_modules` uploads: read from the
    package itself, not from this file's depth in it, which moves when the package's rooms are rearranged. The
    package is loaded whenever one of its modules is (no import of it here: that would be an arrow up)."""
    import sys

    return str(Path(sys.modules[__name__.partition(".")[0]].__file__).resolve().parent)


# Ray starts its worker processes at niceness 15, below its own daemons (raylet, GCS, dashboard agent) and the
# driver, so that the control plane stays responsive on nodes that tasks saturate. On a local instance the
# training workers (and their decode tasks) are the workload: at niceness 15 they yield the CPU to every
# daemon wake-up, which slows training where they share a few cores with the daemons (BENCHMARKS.md, P2). A
# cluster started with `ray start` keeps Ray's default.
#
# Ray also kills a task worker process after 1 s idle once the node has more worker processes than CPUs, which
# a node running training workers always has. Each epoch's decode tasks finish early in the epoch (training is
# the slow side), so their processes would be killed mid-epoch and new ones started for the next epoch, each
# importing Ray, Ray Data and the decode code again on the cores training uses. Kept idle for a minute, they
# serve the next epoch.
#
# Ray also starts one idle worker process per CPU when the driver connects, for tasks in the driver's runtime
# environment. behemoth's processes all run in another (Ray Train's controller and workers, and every task a
# worker submits, carry Ray Train's environment variables), so those processes would never be used, and each
# would import Ray at the moment Ray Train's own processes start, on the same cores. The processes behemoth
# does use are started ahead on purpose (driver/ray_cluster/warmup.py).
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "idle_worker_killing_time_threshold_ms": 60_000,
                           "prestart_worker_first_driver": False}


# Exact resume needs the same float results for the same values, wherever they sit in memory. Intel MKL (torch's
# BLAS on x86 CPUs) does not promise that by default: it may take another code path for an operand at another
# alignment, and so give different bits (tests/unit/test_determinism.py). It matters where operands are views at
# arbitrary offsets, as PowerSGD's matrices are views into DDP's flat gradient buckets, whose layout differs
# between a restored run (DDP's initial buckets) and the run it continues (buckets rebuilt after step 1).
# MKL's conditional numerical reproducibility in STRICT mode removes the dependence on alignment and keeps the
# best instruction set. A value the user sets wins.
REPRODUCIBLE_BLAS_ENV = {"MKL_CBWR": "AUTO,STRICT"}


# Ray Train replaces print() in its workers with a version that logs the line and, because Ray's worker wraps
# sys.stdout, prints it as well: a user's print() in their own model, loss or task would show twice.
# Off, print() is Python's again (one line, forwarded by Ray like any worker output). A value the user sets wins.
PRINT_PATCH_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def worker_env_vars() -> dict:
    """Environment variables every training worker starts with (read by libraries when they initialise)."""
    return {key: os.environ.get(key, value) for key, value in {**REPRODUCIBLE_BLAS_ENV, **PRINT_PATCH_ENV}.items()}


def tighten_token_file() -> str | None:
    """Ray 2.60 writes the token it generates for a new local cluster as 0644; only its owner may read it."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.path.isfile(path) and os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)
        return path
    return None


# Ray Train's controller collects the workers' reports when it polls them, every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
# (2 s by default), and a worker holds at most one uncollected report: a run that reports (or checkpoints) more
# often than every 2 s waits up to 2 s at each report. Polling every 0.2 s costs the controller a few small
# actor calls per second. The driver's value reaches the controller (Ray propagates RAY_TRAIN_* variables);
# a value the user sets wins.
REPORT_POLL_ENV, REPORT_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2"

# Ray Train starts a preemption watcher per worker group (an actor process that polls Ray for nodes being
# drained: a cloud's spot instances; Ray Train then waits out the drain and restarts the group, charging a
# separate retry budget). The local instance behemoth starts is one machine whose loss ends the run anyway:
# there the watcher would only be one more process importing Ray while the first epoch's pipeline starts, so it
# is off. Anywhere else (`ray job submit`, or a caller's own ray.init, which may reach a cluster that adds spot
# nodes later) it stays on. A value the user sets wins.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

# An elastic run's next worker group is sized from the resources Ray lists, and a node lost a moment ago is still
# listed until Ray's health checks declare it dead: the group sized with it waits for its placement group for
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s) before Ray Train sizes it again (on the nodes left). In the
# preemption storm every restart of the elastic run waited those 60 s. An elastic run waits 10 s instead; a
# fixed-size one keeps Ray's 60 s (sizing again changes nothing for it). A value the user sets wins.
PLACEMENT_WAIT_ENV, ELASTIC_PLACEMENT_WAIT_S = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10"
_placement_wait_set_here = False


def set_ray_train_env(elastic: bool = False) -> None:
    """The driver's RAY_TRAIN_* settings (Ray Train propagates them to its controller and workers) for a run,
    `elastic` or not."""
    global _placement_wait_set_here
    os.environ.setdefault(REPORT_POLL_ENV, REPORT_POLL_S)
    if _RAY_STARTED_HERE and not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    if elastic and PLACEMENT_WAIT_ENV not in os.environ:
        os.environ[PLACEMENT_WAIT_ENV], _placement_wait_set_here = ELASTIC_PLACEMENT_WAIT_S, True
    elif not elastic and _placement_wait_set_here:  # (this process's next run is not elastic)
        os.environ.pop(PLACEMENT_WAIT_ENV, None)
        _placement_wait_set_here = False


# An elastic run's worker groups are sized from a view of the cluster that Ray refreshes every 20 s
# (ray_internals/data.refresh_elastic_view): a lost node is counted for up to 20 s after it is gone (the group
# sized with it waits out the placement timeout above) and a replacement goes unused as long. The driver refreshes
# that view every ELASTIC_VIEW_REFRESH_S while an elastic run trains (one actor call reading Ray's node table).
ELASTIC_VIEW_REFRESH_S = 2.0


@contextlib.contextmanager
def elastic_view_refreshed(elastic: bool):
    """While the block runs (an elastic run's fit), keep Ray Train's view of the cluster at most
    ELASTIC_VIEW_REFRESH_S old. A refresh that fails (the actor restarting, Ray going down) is tried again at the
    next period."""
    if not elastic:
        yield
        return
    from behemoth.ray_internals.data import refresh_elastic_view

    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(ELASTIC_VIEW_REFRESH_S):
            try:
                refresh_elastic_view()
            except Exception:  # noqa: BLE001  (a refresh missed costs only this period)
                pass

    thread = threading.Thread(target=refresh, name="behemoth-elastic-view", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=15)


def training_worker_runtime_env() -> dict:
    """The runtime environment Ray Train gives the training workers, and so every task they submit (Ray Data's
    decode tasks): the RAY_TRAIN_* variables it propagates from the driver, the one its controller adds (a
    child inherits its parent's variables) and behemoth's (worker_env_vars). Mirrors Ray Train 2.60
    (DataParallelTrainer._initialize_and_run_controller, WorkerGroup._get_worker_runtime_env), called after
    build_trainer has set the driver's variables; a test compares it with a real worker's."""
    from behemoth.ray_internals.train_v2 import worker_environment

    return {"env_vars": {**worker_environment(), **worker_env_vars()}}


def warm_up_data_processes(cfg: JobConfig, data) -> list:
    """On a local instance, start the processes the task's data pipeline will run in (driver/ray_cluster/warmup.py) while
    Ray Train starts; nothing on a cluster (RAY_ADDRESS, or more than one node), where they may land on any
    node, or for a task whose `data_modules` for this data are none. Returns the warm-up tasks' refs.

    Ray gives a task an idle process whose runtime environment has the same serialized form, not only the same
    content. A child's environment is merged with its parent's and written out anew, except where the parent's
    is empty: a training worker's (merged through the controller's) and a task's from a driver with an empty
    job environment have the same variables and different texts, so they would share no process. behemoth's
    local instance therefore gives the job its worker variables (ensure_ray), so that both go through the
    merge; where the job's environment is empty (a caller's own ray.init) nothing is started."""
    import ray

    modules = task_of(cfg).data_modules(cfg, data)
    if (os.environ.get("RAY_ADDRESS") or not modules or not ray.get_runtime_context().runtime_env
            or sum(node["Alive"] for node in ray.nodes()) > 1):
        return []
    from behemoth.driver.ray_cluster import warmup
    return warmup.start(tuple(modules), cfg.scaling.max_workers, training_worker_runtime_env())


def end_ray(end: bool) -> None:
    """Shut Ray down, if asked and if behemoth started (or connected) it: never a caller's own instance."""
    global _RAY_STARTED_HERE
    if end and _RAY_STARTED_HERE:
        import ray

        ray.shutdown()
        _RAY_STARTED_HERE = False


def torch_trainer(*args, **kwargs):
    """Ray Train's TorchTrainer, less the processes behemoth's runs do not use, with the process's signal
    handlers put back after its fit (see LeanTorchTrainer) and a torch backend config that does not make Ray
    Train's controller import torch (ray_internals/torch_backend.py)."""
    from ray.train.torch import TorchTrainer

    from behemoth.ray_internals.torch_backend import LazyTorchConfig
    from behemoth.ray_internals.train_v2 import DatasetsCallback, PlacementGroupCleanerCallback

    kwargs.setdefault("torch_config", LazyTorchConfig())

    class LeanTorchTrainer(TorchTrainer):
        """Ray Train 2.60 starts a DatasetManager actor for every run (its DatasetsCallback, whatever the
        trainer's `datasets`): a process importing Ray and Ray Data, kept until the run's controller ends, that
        serves `ray.train.get_dataset_shard`. behemoth passes the trainer no dataset (each rank builds its own
        epoch's dataset, worker/feed.py) and never asks for a shard, so the callback is left out; the rest of
        Ray Train's (placement-group cleaner, synchronisation actor, metrics) is kept. BENCHMARKS.md, "Ray
        Train's processes per run", says what each costs."""

        def _create_default_callbacks(self):
            callbacks = [ThisClusterCleanerCallback() if type(c) is PlacementGroupCleanerCallback else c
                         for c in super()._create_default_callbacks()]
            return callbacks if self.datasets else [c for c in callbacks if not isinstance(c, DatasetsCallback)]

        def fit(self):
            with signal_handlers_kept():  # Ray Train's Ctrl-C handler ends with the run, not after the next one
                return super().fit()

    from behemoth.driver.ray_cluster.placement_cleaner import ThisClusterCleanerCallback

    return LeanTorchTrainer(*args, **kwargs)


@contextlib.contextmanager
def signal_handlers_kept():
    """Ray Train's fit and Ray Tune's install their own SIGINT handlers for their run (and Tune a SIGUSR1 one)
    and leave them installed when it ends: a Ctrl-C later in the same process (a script that trains twice, the
    run lock giving up a lease it cannot renew, storage/runlock.py) would go to a run that is over and interrupt
    nothing. The process's handlers are put back when the block ends (in the main thread: elsewhere neither
    library installs any)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kinds = [signal.SIGINT, *([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])]
    before = {kind: signal.getsignal(kind) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in before.items():
            signal.signal(kind, handler)
