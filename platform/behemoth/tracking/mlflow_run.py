"""MLflow tracking (tracking.mlflow.uri): one MLflow run per behemoth run, continued by every resume.

The driver opens the run (or finds it again: its id is kept in RUN_FOLDER/mlflow.json), logs the flattened
job config as params and, at the end, the report, the goodput account and the best checkpoint's manifest as
artifacts. Ray Train's controller logs every report as metrics with its step, from a background thread: a
slow or unreachable server never holds the training up, and a failure is reported once, then tracking stops.
A sweep's trials are nested runs under one parent run per sweep.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading

from behemoth.storage import paths
from behemoth.storage.store import Store
from behemoth.errors import ConfigError
from behemoth.tracking.records import read_text, write_text

RUN_FILE = "mlflow.json"
# The MLflow client retries an unreachable server for minutes by default; a training run should not wait.
_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def tracking_uri(uri: str) -> str:
    """A folder (MLflow's file store), sqlite:///..., http(s)://... as MLflow takes it."""
    if not Store(uri).is_local or uri.startswith("sqlite:"):  # a scheme: a server, a database or a file:// URI
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a folder: the user asked for the file store
    return "file://" + os.path.abspath(os.path.expanduser(uri))


def client(uri: str):
    for key, value in _CLIENT_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import mlflow
    except ImportError:
        raise ConfigError("tracking.mlflow.uri is set but MLflow is not installed: pip install 'behemoth[mlflow]' "
                          "(or unset tracking.mlflow.uri)") from None
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its database set-up lines are not the run's news
    return mlflow.MlflowClient(tracking_uri=tracking_uri(uri))


def flat(mapping: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, values as text (MLflow keeps at most 6000 characters)."""
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:6000]
    return out


def open_run(uri: str, experiment: str, run_dir: str, run_name: str, params: dict,
             parent_run_id: str | None = None) -> str:
    """The MLflow run of this behemoth run: the one recorded in the run folder (a resume), else a new one."""
    c = client(uri)
    record = paths.join(run_dir, RUN_FILE)
    known = _read_record(record)
    if known and known.get("uri") == uri:
        from mlflow.exceptions import MlflowException

        try:
            c.update_run(known["run_id"], status="RUNNING")
        except MlflowException as e:  # (a store that does not answer fails again below, as before)
            # the recorded run is gone (deleted; another store at this URI): a new run, not tracking off for
            # this run folder for good
            print(f"[behemoth] MLflow run {known['run_id']} of {record} is not in {paths.redacted(uri)} "
                  f"({' '.join(str(e).split())[:120]}): this run logs to a new MLflow run", flush=True)
        else:
            try:
                _log_rerun_params(c, known["run_id"], params)
            except MlflowException as e:  # (the run is there: it goes on, without these)
                print(f"[behemoth] warning: MLflow run {known['run_id']}: this rerun's changed params were not "
                      f"recorded ({' '.join(str(e).split())[:120]})", flush=True)
            return known["run_id"]
    experiment_id = experiment_id_of(c, uri, experiment)
    tags = {"behemoth.run_dir": paths.redacted(run_dir)}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run_id = c.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    _log_batches(c, run_id, params=flat(params))
    write_text(record, json.dumps({"uri": uri, "experiment_id": experiment_id, "run_id": run_id}))
    return run_id


def _log_rerun_params(c, run_id: str, params: dict) -> None:
    """A rerun's config against the params its MLflow run holds. MLflow keeps a param's first value (it refuses
    another): a key new to the run is logged as a param; a changed value is the tag `rerun.KEY`, its value now
    (removed again where a later rerun goes back to the param's value), so that the run's page says what it
    trains with since."""
    run, now = c.get_run(run_id), flat(params)
    logged, mark = run.data.params, "rerun."
    _log_batches(c, run_id, params={k: v for k, v in now.items() if k not in logged},
                 tags={mark + k: v for k, v in now.items() if k in logged and logged[k] != v})
    for tag in run.data.tags:
        key = tag[len(mark):]
        if tag.startswith(mark) and now.get(key) == logged.get(key):
            c.delete_tag(run_id, tag)


def _log_batches(c, run_id: str, params: dict | None = None, tags: dict | None = None) -> None:
    from mlflow.entities import Param, RunTag

    for kind, items in (("params", list((params or {}).items())), ("tags", list((tags or {}).items()))):
        make = Param if kind == "params" else RunTag
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params (or tags) per batch
            c.log_batch(run_id, **{kind: [make(k, v) for k, v in items[i:i + 100]]})


def experiment_id_of(c, uri: str, name: str) -> str:
    """The experiment's id, created if needed. With a sqlite store MLflow would put a new experiment's artifacts
    under ./mlruns of whatever folder the driver happens to run in; behemoth keeps them beside the database, in
    DB_FOLDER/mlartifacts/<experiment name> (runs have their own subfolders, by run id)."""
    found = c.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    if not uri.startswith("sqlite:"):
        return c.create_experiment(name)  # a folder or a server: MLflow's own place for artifacts
    from sqlalchemy.engine import make_url

    folder = os.path.dirname(os.path.abspath(make_url(uri).database))
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return c.create_experiment(name, artifact_location=f"file://{folder}/mlartifacts/{safe}")


def finish(uri: str, run_id: str, status: str, metrics: dict[str, float], step: int,
           artifacts: list[str] = (), text: dict[str, str] | None = None) -> None:
    """The end of an invocation: the run's final scalars, its files, its status (FINISHED, FAILED, KILLED)."""
    from mlflow.entities import Metric

    c = client(uri)
    import time

    now = int(time.time() * 1000)
    try:
        if metrics:
            c.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
        for path in artifacts:
            if os.path.isdir(path):
                c.log_artifacts(run_id, path, artifact_path=os.path.basename(path))
            elif os.path.isfile(path):
                c.log_artifact(run_id, path)
        for name, content in (text or {}).items():
            c.log_text(run_id, content, name)
    finally:  # (an upload that failed left the run RUNNING for good)
        c.set_terminated(run_id, status=status)


class MlflowMetrics:
    """Logs reports as metrics from a background thread (in Ray Train's controller)."""

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id
        self.queue: queue.Queue | None = None
        self.failed = False

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        if self.failed:
            return
        if self.queue is None:
            self.queue = queue.Queue()
            threading.Thread(target=self._drain, daemon=True, name="behemoth-mlflow").start()
        self.queue.put((values, step, int(wall_time * 1000)))

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait (a bounded time) for what is queued to be sent."""
        if self.queue is not None and not self.failed:
            done = threading.Event()
            self.queue.put(done)
            done.wait(timeout_s)

    def _drain(self) -> None:
        from mlflow.entities import Metric

        c = None
        while True:
            item = self.queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self.failed:
                continue
            values, step, millis = item
            try:
                c = c or client(self.uri)
                c.log_batch(self.run_id, metrics=[Metric(k, v, millis, step) for k, v in values.items()])
            except Exception as e:  # noqa: BLE001 - tracking must never end the run
                self.failed = True
                first = str(e).splitlines()[0] if str(e) else ""
                print(f"[behemoth] WARNING: MLflow tracking to {paths.redacted(self.uri)} failed and is off for the "
                      f"rest of this run (training goes on): {type(e).__name__}: {first}", flush=True)


def _read_record(path: str) -> dict | None:
    text = read_text(path)
    return json.loads(text) if text else None
