"""`behemoth data bench`: a job's training input pipeline alone, measured as its workers would receive it.

One consumer per training worker, each an actor reserving the worker's CPUs (scaling.cpus_per_worker; no GPU:
what is measured ends in the worker's host memory), runs the worker's own feed (worker/feed.py): the task's
`train_batches` for the rank's samples in the epoch's order, the next epoch opened ahead, the same Ray Data plan
and CPUs per task, the same micro-batch and accumulation. It touches every batch and drops it; no model runs.

What is printed: samples/s over the window in which every consumer was past its first batch (start-up is
reported apart), samples/s per CPU busy on this node over that window (/proc/stat: every process, Ray's own
included, so run it on a machine with nothing else to do), bytes per sample as delivered, and how many
workers at the job's batch it keeps fed at a step rate: `--step-rate` (per worker), or the steady rate a run of
the job measured (its run folder's metrics.jsonl).

The figures are kept for this machine and this data (data.cache_dir/data_bench.json): `behemoth check` then
says whether the job's CPUs can feed its workers by the per-CPU rate measured here (`feed_check`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from pathlib import Path

import numpy as np

from behemoth.config import JobConfig
from behemoth.errors import ConfigError, DataError
from behemoth.hosts import WorkerHost
from behemoth.storage.store import Store


@dataclasses.dataclass
class DataBench:
    samples_per_s: float
    cpus_busy: float
    bytes_per_sample: float
    bytes_by_key: dict
    per_worker_batch: int
    workers: int
    startup_s: float
    window_s: float
    step_rate: float | None = None
    step_rate_from: str = ""

    @property
    def per_cpu(self) -> float:
        return self.samples_per_s / max(self.cpus_busy, 1e-9)

    @property
    def feeds(self) -> float | None:
        """Workers kept fed at the step rate: samples/s over what one worker takes per second."""
        return None if not self.step_rate else self.samples_per_s / (self.step_rate * self.per_worker_batch)

    def lines(self) -> list[str]:
        keys = ", ".join(f"{k} {v:,.0f}" for k, v in self.bytes_by_key.items())
        out = [f"measured {self.window_s:.1f} s with {self.workers} consumer(s) at {self.per_worker_batch} samples "
               f"per worker step, after {self.startup_s:.1f} s to their first batches; bytes per sample: {keys}"]
        feeds = ("feeds ? workers (give --step-rate, or --run RUN_DIR of a run of this job)" if self.feeds is None
                 else f"feeds {self.feeds:.1f} workers at {self.step_rate:.3g} steps/s{self.step_rate_from}")
        out.append(f"data bench: {self.samples_per_s:,.0f} samples/s ({self.per_cpu:,.0f} per CPU, "
                   f"{self.cpus_busy:.1f} CPUs), {self.bytes_per_sample:,.0f} bytes per sample, {feeds}")
        return out


def bench_data(cfg: JobConfig, seconds: float = 20.0, step_rate: float | None = None,
               run_dir: str | None = None, cpus: int | None = None) -> DataBench:
    """Measure the job's training input pipeline for `seconds` after every consumer's first batch (on a local
    Ray instance of `cpus` CPUs where given)."""
    import ray

    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.driver.run import sequence
    rate_from = ""
    if step_rate is None and run_dir:
        step_rate = measured_step_rate(run_dir)
        rate_from = f" (measured by the run in {run_dir})"
    if step_rate is not None and not (_finite(step_rate) and step_rate > 0):
        raise ConfigError(f"--step-rate must be > 0, got {step_rate}")
    if not (_finite(seconds) and seconds > 0):  # (nan measured nothing and recorded 3.6e13 samples/s; 0 divided by 0)
        raise ConfigError(f"--seconds must be a number of seconds > 0, got {seconds}")
    world = cfg.scaling.max_workers
    share = cfg.train.global_batch_size // world
    if share == 0:
        raise ConfigError(f"train.global_batch_size {cfg.train.global_batch_size} is smaller than the "
                          f"{world} workers")
    if cpus is not None:
        if cpus < 1:
            raise ConfigError(f"--cpus must be >= 1, got {cpus}")
        ray_session.ensure_ray(num_cpus=cpus)
    data = sequence.prepare_data(cfg)
    ref = ray.put(data)
    consumer = ray.remote(_Consumer)
    consumers = [consumer.options(num_cpus=cfg.scaling.cpus_per_worker).remote()
                 for _ in range(world)]
    gate = ray.remote(num_cpus=0)(StartGate).remote(world)
    meter = MachineCpu()
    t0 = time.time()
    try:
        results = ray.get([c.run.remote(cfg.to_dict(), ref, rank, world, seconds, gate)
                           for rank, c in enumerate(consumers)])
    finally:
        meter.stop()
        for actor in (*consumers, gate):
            ray.kill(actor)
    start = max(r["times"][0] for r in results)  # every consumer past its first batch
    end = min(r["times"][-1] for r in results)
    if end <= start:
        raise RuntimeError("the consumers' measured windows do not overlap: raise --seconds")
    samples = sum(int(np.sum(np.asarray(r["samples"])[(np.asarray(r["times"]) > start)
                                                      & (np.asarray(r["times"]) <= end)])) for r in results)
    total = sum(sum(r["samples"]) for r in results)
    by_key = {k: sum(r["bytes"].get(k, 0) for r in results) / total for k in results[0]["bytes"]}
    return DataBench(samples_per_s=samples / (end - start), cpus_busy=meter.seconds(start, end) / (end - start),
                     bytes_per_sample=sum(by_key.values()), bytes_by_key=by_key, per_worker_batch=share,
                     workers=world, startup_s=start - t0, window_s=end - start, step_rate=step_rate,
                     step_rate_from=rate_from)


_UNMEASURED_KEYS = ("cpus_per_task", "prefetch_batches", "max_bad_samples")  # the same work per sample


def _record_place(cfg: JobConfig) -> tuple[Path, str] | None:
    """(the records file, this data's key on this machine), or None where the data has no local cache_dir."""
    import hashlib
    import socket

    folder = getattr(cfg.data, "cache_dir", "")
    if not folder or not Store(folder).is_local:
        return None
    section = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _UNMEASURED_KEYS}
    digest = hashlib.sha256(json.dumps(section, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(folder) / "data_bench.json", f"{socket.gethostname()}/{digest}"


def record(cfg: JobConfig, result: DataBench, log=print) -> Path | None:
    """Keep the bench's figures for `behemoth check` on this machine (None where there is nowhere to). The
    records file is read, changed and replaced under its lock (benches of several jobs may share a cache_dir,
    on several hosts where it is shared); one that cannot be read is moved aside, said in a line, and the new
    measurement kept in a new one."""
    from behemoth.data.image.image_cache_build import exclusive

    place = _record_place(cfg)
    if place is None:
        return None
    file, key = place
    file.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(file.with_name(file.name + ".lock")):
        try:
            records = read_records(file)
        except DataError as e:
            aside = file.with_name(f"{file.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{_unique()}")
            os.replace(file, aside)
            log(f"[behemoth] {e}; moved it aside to {aside} and started a new one")
            records = {}
        records[key] = {"per_cpu": result.per_cpu, "samples_per_s": result.samples_per_s,
                        "cpus_busy": result.cpus_busy, "step_rate": result.step_rate, "when": time.time()}
        # a name of this writer's own: a pid alone is shared by processes of other hosts on a shared folder
        tmp = file.with_name(f"{file.name}.tmp-{_unique()}")
        tmp.write_text(json.dumps(records, indent=1))
        os.replace(tmp, file)
    return file


def _unique() -> str:
    import socket
    import uuid

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def read_records(file: Path) -> dict[str, dict]:
    """data_bench.json's records ({} where there is none), or the DataError naming the file and what to do."""
    try:
        text = file.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {file} ({e}): `behemoth data bench` moves it aside") from None
    try:
        records = json.loads(text)
    except ValueError as e:
        raise DataError(f"{file} is not JSON ({e}): `behemoth data bench` moves it aside") from None
    problems = ([f"a {type(records).__name__}, not a mapping of records"] if not isinstance(records, dict) else
                [f"its record {key!r} {p}" for key, entry in records.items() if (p := _record_problem(entry))])
    if problems:
        raise DataError(f"{file} is not what `behemoth data bench` writes ({problems[0]}): `behemoth data bench` "
                        f"moves it aside")
    return records


def _record_problem(entry) -> str:
    """Why a record is not one `record` writes ("" where it is)."""
    if not isinstance(entry, dict):
        return "is not a mapping"
    for name, required in (("per_cpu", True), ("step_rate", False)):
        value = entry.get(name)
        if value is None and not required:
            continue
        if not _finite(value) or value <= 0:
            return f"has {name} {value!r}, not a number > 0"
    return ""


def feed_check(cfg: JobConfig) -> tuple[str, str | None]:
    """(a line saying what was checked, a warning or None): whether this machine's CPUs left to the data
    pipeline (its CPUs less the workers' scaling.cpus_per_worker) times the per-CPU rate `behemoth data bench`
    measured here for this data reach the job's need (global batch x the step rate the bench was given). A
    figure not measured here is not guessed: the line says how to measure it."""
    place = _record_place(cfg)
    how = "behemoth data bench JOB.yaml --step-rate S (S: steps/s one worker takes when fed)"
    try:
        found = read_records(place[0]).get(place[1]) if place else None
    except DataError as e:
        return f"not checked: {e}", f"{e} and keeps its new measurement ({how})"
    if not found:
        return f"not checked: no per-CPU rate measured on this machine for this data ({how})", None
    if not found.get("step_rate"):
        return (f"not checked: {found['per_cpu']:,.0f} samples/s per CPU measured here, but no step rate was "
                f"given ({how})"), None
    workers = cfg.scaling.max_workers
    cpus = (os.cpu_count() or 1) - workers * cfg.scaling.cpus_per_worker
    need = cfg.train.global_batch_size * found["step_rate"]
    can = max(cpus, 0) * found["per_cpu"]
    line = (f"{max(cpus, 0):g} CPUs left to the data ({os.cpu_count()} - {workers} workers x "
            f"{cfg.scaling.cpus_per_worker:g}) x {found['per_cpu']:,.0f} samples/s per CPU (measured here) = "
            f"{can:,.0f} samples/s; the workers need {cfg.train.global_batch_size} x {found['step_rate']:.3g} "
            f"steps/s = {need:,.0f}")
    if can >= need:
        return f"ok: {line}", None
    return line, (f"the CPUs cannot feed the workers: {line}. Give the data more CPUs (fewer "
                  f"scaling.cpus_per_worker, a bigger machine), or expect the steps to wait for data")


def measured_step_rate(run_dir: str) -> float:
    """Optimizer steps per second per worker of a run of the job, from its first training report to its last
    (metrics.jsonl, rank 0's clock): the rate its model steps at when fed."""
    from behemoth.tracking.records import read_jsonl

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no metrics.jsonl there (a run folder of this job holds one)")
    try:
        return steady_step_rate(read_jsonl(str(path)))  # (a line cut short by a kill is skipped, as by the report)
    except ConfigError as e:
        raise ConfigError(f"--run {run_dir}: {e} in {path}; give --step-rate S instead") from None


def steady_step_rate(reports: list[dict]) -> float:
    """Optimizer steps per second from the first training report to the last, by rank 0's clock at each
    (`wall_time`): one span holding every step, report and console line in between; the steps up to the
    first report are warm-up. (The benches time behemoth's runs the same way.) A ConfigError where the
    reports hold no span to time (fewer than two, or no time or no step between the first and the last)."""
    train = [r for r in reports if isinstance(r, dict) and "samples_per_s" in r
             and all(_finite(r.get(k)) for k in ("step", "wall_time"))]
    if len(train) < 2:
        raise ConfigError("fewer than two training reports (with a step and a wall_time) to time steps by")
    first, last = train[0], train[-1]
    steps, span = last["step"] - first["step"], last["wall_time"] - first["wall_time"]
    if steps <= 0 or span <= 0:
        raise ConfigError(f"the first and last training reports (steps {first['step']} and {last['step']}) are "
                          f"{span:g} s apart: no steps in time to time them by")
    return steps / span


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class StartGate:
    """When the measured window starts: once every consumer has had its first batch (a loaded machine starts
    them seconds apart; a window counted from each one's own first batch then left little overlap)."""

    def __init__(self, world: int):
        self.world, self.firsts = world, {}

    def arrived(self, rank: int, at: float) -> float | None:
        """Record `rank`'s first batch; the window's start once all have had theirs, else None."""
        self.firsts.setdefault(rank, at)
        return max(self.firsts.values()) if len(self.firsts) == self.world else None


class _Consumer:
    """One training worker's side of the feed (a Ray actor): the worker's batches, touched and dropped."""

    def run(self, job: dict, data, rank: int, world: int, seconds: float, gate) -> dict:
        import ray
        import torch

        from behemoth import hosts
        from behemoth.storage.checkpoint import TrainState
        from behemoth.data.order import steps_per_epoch
        from behemoth.job import config_from_dict
        from behemoth.tasks import make_task
        from behemoth.worker.feed import EpochFeed

        cfg = config_from_dict(job, where="job config")
        # what reaches the worker's host memory: no GPU here (so no pinning), whatever the job trains on
        cfg = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, use_gpu=False))
        if cfg.scaling.torch_threads:
            torch.set_num_threads(cfg.scaling.torch_threads)
        with hosts.hosted(_BenchContext(rank, world)):
            task = make_task(cfg, data)
            share = cfg.train.global_batch_size // world
            micro = cfg.train.micro_batch_size
            # "auto" searches with the model on the device: the bench has neither, and takes the whole share
            micro = share // cfg.train.grad_accum_steps if micro in (None, "auto") else micro
            epoch_steps = steps_per_epoch(task.num_train_samples, cfg.train.global_batch_size)
            if epoch_steps == 0:
                raise ConfigError(f"train.global_batch_size {cfg.train.global_batch_size} exceeds the "
                                  f"{task.num_train_samples} training samples: lower it")
            feed = EpochFeed(task, cfg, rank, world, micro, share // micro, epoch_steps)
            window_start = lambda at: ray.get(gate.arrived.remote(rank, at))  # noqa: E731
            return _consume(feed, TrainState(world_size=world), seconds, window_start)


def _consume(feed, state, seconds: float, window_start=lambda at: at) -> dict:
    """Pull the feed's steps until `seconds` after the window's start (`window_start(first batch's time)`: the
    gate's, None until every consumer has had a first batch); per step: its time, samples and bytes by key."""
    times, samples, nbytes = [], [], {}
    feed.start(state)
    deadline = None
    while deadline is None or time.time() < deadline:
        steps = feed.steps(state)
        try:
            for micro_batches in steps:
                n = 0
                for batch in micro_batches:
                    n += _touch(batch, nbytes)
                times.append(time.time())
                samples.append(n)
                if deadline is None and (start := window_start(times[0])) is not None:
                    deadline = start + seconds
                state.advance(feed.epoch_steps, feed.cfg.train.global_batch_size)
                feed.ahead(state, total_steps=2**62)
                if deadline is not None and time.time() >= deadline:
                    break
        finally:
            steps.close()
    return {"times": times, "samples": samples, "bytes": nbytes}


def _touch(batch: dict, nbytes: dict) -> int:
    """Read one value per 4 KiB page of every tensor (its pages reach this process); count bytes by key."""
    import torch

    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            flat = value.reshape(-1)
            if flat.numel():
                flat[:: max(4096 // value.element_size(), 1)].sum()
            nbytes[key] = nbytes.get(key, 0) + value.numel() * value.element_size()
    return len(batch["sample_id"])  # every task's batches carry their samples' ids (tasks/parts.py: Batch)


class _BenchContext(WorkerHost):
    """The worker host a consumer hosts: rank, world and the CPU; nothing of a run (no storage, reports)."""

    def __init__(self, rank: int, world: int):
        import torch

        self.rank, self.world, self.run_name, self._device = rank, world, "data-bench", torch.device("cpu")

    @property
    def device(self):
        return self._device


class MachineCpu:
    """The whole machine's busy CPU time (every process: Ray's daemons, workers, tasks, this one), sampled from
    /proc/stat every `every_s` in a thread; `seconds(t0, t1)` is the CPU-seconds spent between two wall-clock
    times (time.time()), interpolated between samples. Linux only."""

    def __init__(self, every_s: float = 0.05):
        self.tick, self.samples, self._stop = os.sysconf("SC_CLK_TCK"), [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _busy(self) -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / self.tick  # user nice system idle iowait irq softirq steal

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._busy()))
            self._stop.wait(every_s)

    def seconds(self, t0: float, t1: float) -> float:
        times, busy = np.array(self.samples).T
        return float(np.interp(t1, times, busy) - np.interp(t0, times, busy))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
