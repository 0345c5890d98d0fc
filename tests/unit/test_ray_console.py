"""The filter on Ray's forwarded worker output: known noise goes, real warnings and tracebacks stay."""

import functools
import itertools

import pytest
from behemoth.driver.ray_console import filter_lines

PREEMPTION = ("[2026-11-23 12:48:54,770 E 30855 30961] core_worker.cc:2465: Actor with class name: "
              "'PreemptionWatcher' and ID: '4de217be29b7c9db2091bd7c01000000' has constructor arguments in the "
              "object store and max_restarts > 0. If the arguments in the object store go out of scope or are "
              "lost, the actor restart will fail. See https://github.com/ray-project/ray/issues/53727 for more "
              "details.")
# As a trial actor that Tune stopped printed it (examples/sweep_from_script.py)
SIGTERM_EXIT = [
    "Exception ignored in: <function WeakSet.__init__.<locals>._remove at 0x7f7268ae39c0>",
    "Traceback (most recent call last):",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/_weakrefset.py", line 39, in _remove',
    "    def _remove(item, selfref=ref(self)):",
    "",
    '  File "/work/main/.venv/lib/python3.11/site-packages/ray/_private/worker.py", line 1063, in sigterm_handler',
    "    raise_sys_exit_with_custom_error_message(",
    '  File "python/ray/_raylet.pyx", line 712, in ray._raylet.raise_sys_exit_with_custom_error_message',
    "SystemExit: 1",
]
REAL_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/work/main/platform/behemoth/loop.py", line 80, in train_loop_per_worker',
    "    raise SystemExit(1)",
    "SystemExit: 1",
    "Traceback (most recent call last):",
    '  File "x.py", line 1, in <module>',
    "ValueError: a real failure",
]


def test_noise_lines_and_sigterm_exits_are_dropped():
    lines = ["[behemoth] step 10/20", PREEMPTION, *SIGTERM_EXIT, "[behemoth] step 20/20"]
    assert filter_lines(lines) == ["[behemoth] step 10/20", "[behemoth] step 20/20"]


def test_real_warnings_and_tracebacks_pass_unchanged():
    warning = ("WARNING: 8 PYTHON worker processes have been started on node: f5c1 with address: 192.0.2.2, "
               "which is 4x the maximum expected startup concurrency (2).")
    other_actor = PREEMPTION.replace("PreemptionWatcher", "MyActor")
    lines = [warning, other_actor, *REAL_TRACEBACK]
    assert filter_lines(lines) == lines


# As a stopped trial's training worker printed it (a fresh-clone run of the sweep test), report in flight
TEARDOWN = [
    "Error in training function:",
    "Traceback (most recent call last):",
    '  File "/tmp/full6/platform/behemoth/worker/saver.py", line 73, in save_and_report',
    "    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp()),",
    '  File "/tmp/full6/.venv/lib/python3.11/site-packages/ray/_private/worker.py", line 1055, in get_objects',
    "    raise value",
    "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
    "\tclass_name: SynchronizationActor",
    "\tpid: 18435",
    "The actor is dead because its worker process has died. Worker exit type: INTENDED_SYSTEM_EXIT Worker exit "
    "detail: Destroying worker since its placement group was removed. Placement group id: 54",
]


def test_a_stopped_trials_teardown_traceback_is_dropped_a_real_actor_death_is_not():
    assert filter_lines(["[behemoth] step 18/24", *TEARDOWN, ""]) == ["[behemoth] step 18/24", ""]
    crashed = [*TEARDOWN[:-1], "The actor is dead because its worker process has died. Worker exit type: "
               "SYSTEM_ERROR Worker exit detail: Worker exits unexpectedly."]
    assert filter_lines(crashed) == crashed


# As Ray Train's controller printed it after the sweep test killed a training worker (a fresh-clone run)
CRASHED_SHUTDOWN = [
    "Graceful shutdown of backend failed. This is expected if one of the workers has crashed.",
    "Traceback (most recent call last):",
    '  File "/x/ray/train/v2/_internal/callbacks/backend_setup.py", line 27, in before_execution_group_shutdown',
    "    self._backend.on_shutdown(execution_group, self._backend_config)",
    '  File "/x/ray/train/torch/config.py", line 333, in on_shutdown',
    "    ray.get(futures, timeout=timeout_s)",
    "    raise value",
    "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
    "\tclass_name: RayTrainWorker",
    "\tpid: 23229",
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file.",
]


def test_the_controllers_shutdown_traceback_after_a_worker_crash_keeps_only_rays_line():
    assert filter_lines(CRASHED_SHUTDOWN + ["next"]) == [CRASHED_SHUTDOWN[0], "next"]
    # the same traceback without Ray's line above it (not the shutdown of a crashed group) passes unchanged
    assert filter_lines(CRASHED_SHUTDOWN[1:]) == CRASHED_SHUTDOWN[1:]
    # and a traceback under that line that is not torch's shutdown call passes too
    other = [CRASHED_SHUTDOWN[0], *REAL_TRACEBACK]
    assert filter_lines(other) == other


def test_a_worker_whose_stopped_controller_took_its_sync_actor_along_is_dropped():
    """As a fresh-clone run of the sweep test printed it: the worker's report in flight found the
    SynchronizationActor dead because its owner (the stopped trial's controller) exited on purpose."""
    owner_gone = [*TEARDOWN[:-1], "The actor is dead because its owner has died. Owner Id: 547e Owner Ip address: "
                  "192.0.2.2 Owner worker exit type: INTENDED_SYSTEM_EXIT Worker exit detail: Owner's worker "
                  "process has crashed."]
    assert filter_lines(["before", *owner_gone, "after"]) == ["before", "after"]
    crashed_owner = [*owner_gone[:-1], owner_gone[-1].replace("INTENDED_SYSTEM_EXIT", "SYSTEM_ERROR")]
    assert filter_lines(crashed_owner) == crashed_owner


# As a training worker printed it when its checkpoint hit a full disk (the upload thread's report, then the
# training function's), shortened
UPLOAD_FAILED = [
    '`ray.train.report(checkpoint_upload_mode=ASYNC)` checkpoint upload failed in the background thread. Raising eagerly to avoid training in a corrupted state with ',
    'Traceback (most recent call last):',
    '  File "/work/main/.venv/lib/python3.11/site-packages/ray/train/v2/_internal/execution/context.py", line 554, in _upload_checkpoint_and_report',
    '    training_report = self._upload_checkpoint(',
    '  File "/work/main/platform/behemoth/worker/saver.py", line 119, in write_checkpoint',
    '    raise StorageFullError(_disk_full_message(snap, where, storage)) from None',
    'behemoth.errors.StorageFullError: the checkpoint of step 62 did not fit: no space left on the device of /tmp/runs/demofull; it needs about 2.0 MB, 3.1 MB is free.',
    "Error in training function:",
    'Traceback (most recent call last):',
    '  File "/work/main/.venv/lib/python3.11/site-packages/ray/train/v2/_internal/execution/context.py", line 554, in _upload_checkpoint_and_report',
    '    training_report = self._upload_checkpoint(',
    '  File "/work/main/platform/behemoth/worker/saver.py", line 119, in write_checkpoint',
    '    raise StorageFullError(_disk_full_message(snap, where, storage)) from None',
    'behemoth.errors.StorageFullError: the checkpoint of step 62 did not fit: no space left on the device of /tmp/runs/demofull; it needs about 2.0 MB, 3.1 MB is free.',
]


def test_a_traceback_ending_in_an_error_that_ends_the_run_is_dropped_others_stay():
    """A StorageFullError (or a bad sample, a config error) ends the run with the failure policy's line and the
    command's error line: the worker's tracebacks of it say nothing more. A traceback ending in another error,
    or one that only passes through a behemoth error before ending in another, stays."""
    lines = ["[behemoth] step 60/62", *UPLOAD_FAILED, "", "[behemoth] after"]
    assert filter_lines(lines) == ["[behemoth] step 60/62", "[behemoth] after"]
    other = [*UPLOAD_FAILED[1:6], "RuntimeError: something else"]
    assert filter_lines(other) == other
    chained = [*UPLOAD_FAILED[1:7], "", "During handling of the above exception, another exception occurred:", "",
               *REAL_TRACEBACK[4:]]
    assert filter_lines(chained) == chained
    assert filter_lines([UPLOAD_FAILED[0], *REAL_TRACEBACK]) == [UPLOAD_FAILED[0], *REAL_TRACEBACK]


# As a training worker printed a corrupt image over its budget (the integration test's console), shortened:
# Ray Data's two lines, then the training function's traceback, whose RayTaskError line holds the decode task's
# frames and ends in behemoth's error
BAD_SAMPLE = [
    'An exception was raised from a task of operator "MapBatches(transform_batch)". Dataset execution will now '
    'abort. To ignore this exception and continue, set DataContext.max_errored_blocks.',
    "Exception occurred in user code, with the abbreviated stack trace below. The Ray Data internal stack frames "
    "are omitted from stdout.",
    "Error in training function:",
    "Traceback (most recent call last):",
    '  File "/work/main/platform/behemoth/worker/loop.py", line 82, in train_loop_per_worker',
    "    for micro_batches, wait_s in _timed(feed.steps(state)):",
    '  File "/work/main/.venv/lib/python3.11/site-packages/ray/data/exceptions.py", line 113, in handle_trace',
    "    raise e.with_traceback(None)",
    "ray.exceptions.RayTaskError(UserCodeException): \x1b[36mray::MapBatches(transform_batch)()\x1b[39m (pid=576, "
    "ip=192.0.2.2)",
    '  File "/work/main/platform/behemoth/data/images.py", line 155, in transform_batch',
    "    raise BadSampleError(",
    "behemoth.errors.BadSampleError: cannot decode image /data/train/disk_warm/000005.png: Truncated File Read.",
]


def test_a_bad_sample_through_a_ray_task_leaves_only_behemoths_lines():
    lines = ["[behemoth] step 2/12", *BAD_SAMPLE, "[behemoth] not retried ..."]
    assert filter_lines(lines) == ["[behemoth] step 2/12", "[behemoth] not retried ..."]
    # the same Ray task failing on something else: all of it stays
    other = [*BAD_SAMPLE[:-1], "ValueError: something else"]
    assert filter_lines(other) == other


# Ray Data wraps the task's error: what followed BAD_SAMPLE in the real console
RAY_DATA_WRAPPER = [
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "\x1b[36mray::MapBatches(transform_batch)()\x1b[39m (pid=4775, ip=192.0.2.2)",
    "ray.exceptions.UserCodeException: UDF failed to process a data block.",
    "Failed to apply UDF transform after 1/1 attempts (total backoff 0.0s).",
    "To change retry attempts, backoff, or which errors are retried, configure `retry_on_exception`.",
    "",
]


def test_rays_wrapping_of_a_run_ending_error_goes_with_it_another_error_during_handling_stays():
    lines = ["[behemoth] step 2/12", *BAD_SAMPLE, *RAY_DATA_WRAPPER, "[behemoth] not retried ..."]
    assert filter_lines(lines) == ["[behemoth] step 2/12", "[behemoth] not retried ..."]
    during = [*BAD_SAMPLE[2:], "", "During handling of the above exception, another exception occurred:", "",
              *REAL_TRACEBACK[4:]]
    assert filter_lines(during) == during
    not_ray = [*BAD_SAMPLE[2:], *RAY_DATA_WRAPPER[:4], "ValueError: a user's own wrapper", ""]
    assert filter_lines(not_ray) == not_ray


def test_a_traceback_cut_between_two_forwarded_batches_is_filtered_as_one():
    """Ray forwards a process's output in batches: a run-ending error's traceback cut anywhere in two still goes
    (the first part alone matched nothing and printed: the full-disk test saw "Traceback" now and then), and
    a real traceback cut anywhere comes out whole, in order, once its second part (or a flush) arrives."""
    from behemoth.driver.ray_console import _filtered

    def through(batches):
        out = []
        handler = _filtered(lambda data: out.extend(data["lines"]))
        for batch in batches:
            handler({"pid": 7, "is_err": True, "lines": batch})
        handler.flush()
        return out

    ending = ["[behemoth] step 60/62", *UPLOAD_FAILED, "", "[behemoth] after"]
    real = ["[behemoth] step 1", *UPLOAD_FAILED[1:6], "RuntimeError: something else", "[behemoth] step 2"]
    for k in range(1, len(ending)):  # (cut just before Ray's blank line after it, that line stays: harmless)
        printed = [line for line in through([ending[:k], ending[k:]]) if line.strip()]
        assert printed == ["[behemoth] step 60/62", "[behemoth] after"], k
    for k in range(1, len(real)):
        assert through([real[:k], real[k:]]) == real, k
    assert through([real[:3]]) == real[:3]  # never completed: let out as it is


# The console never loses a real error. Real tracebacks (each must reach the console whole, in order) and every
# kind of noise block (each with what of it stays), put in every order and cut at every point across batches.
def _frames(*where):
    return [line for name, code in where for line in (f'  File "{name}", in f', f"    {code}")]


SIGTERM_FRAME = SIGTERM_EXIT[5:8]  # Ray's SIGTERM handler raising SystemExit inside whatever ran
CHAIN = ["", "During handling of the above exception, another exception occurred:", ""]
REAL = {
    "plain": ["Error in training function:", "Traceback (most recent call last):",
              *_frames(("/work/main/platform/behemoth/worker/loop.py", "loss = task.loss(model, batch)"),
                       ("/x/torch/nn/modules/linear.py", "return F.linear(input, self.weight, self.bias)")),
              "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
              "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x512 and 256x10)", ""],
    "chained": ["Error in training function:", "Traceback (most recent call last):",
                *_frames(("/home/u/my_task.py", "return self.classes[name]")), "KeyError: 'cat'", *CHAIN,
                "Traceback (most recent call last):", *_frames(("/home/u/my_task.py", "raise ValueError(name)")),
                "ValueError: unknown class cat", ""],
    # a real error being handled when Ray stopped the process: its last link alone reads as a SIGTERM exit
    "chained into a stop": ["Traceback (most recent call last):", *_frames(("/home/u/up.py", "client.put(p)")),
                            "OSError: [Errno 28] No space left on device", *CHAIN,
                            "Traceback (most recent call last):", *_frames(("/home/u/up.py", "time.sleep(9)")),
                            *SIGTERM_FRAME, "SystemExit: 1"],
    "a stop chained into an error": [*SIGTERM_EXIT[1:], *CHAIN, "Traceback (most recent call last):",
                                     *_frames(("/home/u/up.py", "os.remove(lock)")),
                                     "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/u.lock'"],
    "thread": ["Exception in thread Thread-3 (prefetch):", "Traceback (most recent call last):",
               *_frames(("/usr/lib/python3.11/threading.py", "self.run()"), ("/home/u/prefetch.py", "next(it)")),
               "OSError: [Errno 5] Input/output error"],
    "ray task": ["Error in training function:", "Traceback (most recent call last):",
                 *_frames(("/work/main/platform/behemoth/worker/loop.py", "stats = ray.get(ref)")),
                 "ray.exceptions.RayTaskError(ValueError): \x1b[36mray::stats()\x1b[39m (pid=812, ip=192.0.2.2)",
                 *_frames(("/home/u/stats.py", "raise ValueError('empty shard')")), "ValueError: empty shard", ""],
    "a user's SystemExit": REAL_TRACEBACK[:4],
    "an actor that crashed": [*TEARDOWN[:-1], ("The actor is dead because its worker process has died. Worker "
                                               "exit type: SYSTEM_ERROR Worker exit detail: Worker exits "
                                               "unexpectedly.")],
    # behemoth's run-ending errors where they did not end the run (or not alone): they show
    "behemoth error in a thread": ["Exception in thread Thread-5 (write):", *UPLOAD_FAILED[1:7]],
    "behemoth error logged": ["[behemoth] WARNING: the report could not be written", *UPLOAD_FAILED[1:7]],
    "behemoth error Ray Data let pass": [
        ('An exception was raised from a task of operator "MapBatches(transform_batch)". Ignoring this exception '
         'with remaining max_errored_blocks=3.'), *BAD_SAMPLE[3:]],
    "behemoth error, then another": [*BAD_SAMPLE[2:], *CHAIN, *REAL_TRACEBACK[4:]],
    "behemoth error raised handling another": [
        "Error in training function:", "Traceback (most recent call last):",
        *_frames(("/work/main/platform/behemoth/data/token_store.py", "f = open(path, 'rb')")),
        "FileNotFoundError: [Errno 2] No such file or directory: '/cache/shard-3.bin'", *CHAIN,
        *BAD_SAMPLE[3:7], "behemoth.errors.DataError: token shard /cache/shard-3.bin does not exist on this node"],
    "behemoth error in a user's wrapper": [*BAD_SAMPLE[2:], *RAY_DATA_WRAPPER[:4], "ValueError: user wrap", ""],
}
NOISE = {  # name: (its lines, those of them that stay)
    "preemption": ([PREEMPTION], []),
    "controller gone": (["Detected that the Ray Train controller actor (ab12) is dead. Cleaning up placement group"],
                        []),
    "sigterm": (SIGTERM_EXIT, []),
    "teardown": ([*TEARDOWN, ""], []),
    "owner gone": ([*TEARDOWN[:-1], ("The actor is dead because its owner has died. Owner Id: 547e Owner worker "
                                     "exit type: INTENDED_SYSTEM_EXIT Worker exit detail: Owner's worker process "
                                     "has crashed.")], []),
    "crashed shutdown": (CRASHED_SHUTDOWN, CRASHED_SHUTDOWN[:1]),
    "disk full": ([*UPLOAD_FAILED, ""], []),
    "bad sample": ([*BAD_SAMPLE, *RAY_DATA_WRAPPER], []),
}


@functools.cache
def _handler():
    """One filter for all the streams of these tests, each on its own pid (a filter's start costs a thread)."""
    from behemoth.driver.ray_console import _filtered

    printed = []
    return _filtered(printed.append), printed, itertools.count(1000)


def _through(batches):
    """What the console shows of a stream of `batches` of one process."""
    handler, printed, pids = _handler()
    pid = next(pids)
    for batch in batches:
        handler({"pid": pid, "is_err": True, "lines": batch})
    handler.flush()
    out = [line for data in printed if data["pid"] == pid for line in data["lines"]]
    printed.clear()
    return out


def _cuts(lines, every_cut):
    """The ways a stream of lines can arrive: each line alone, and (every_cut) in two batches cut anywhere."""
    yield [[line] for line in lines]
    for k in range(1, len(lines) if every_cut else 0):
        yield [lines[:k], lines[k:]]


def _contains(out, block):
    return any(out[k:k + len(block)] == block for k in range(len(out) - len(block) + 1))


@pytest.mark.parametrize("real", sorted(REAL))
def test_every_real_traceback_reaches_the_console_whole_whatever_noise_is_around_it_and_however_it_is_cut(real):
    """Each real traceback between any two noise blocks (or none), as Ray forwards them: each line alone and,
    with one noise block or none, cut in two at every point. Its lines come out whole and in order, and all
    the noise goes (the demo's and the sweep's console stay free of tracebacks)."""
    kinds = [None, *sorted(NOISE)]
    for before in kinds:
        for after in kinds:
            noise_before, stays_before = NOISE[before] if before else ([], [])
            noise_after, stays_after = NOISE[after] if after else ([], [])
            lines = ["[behemoth] step 1", *noise_before, *REAL[real], *noise_after, "[behemoth] step 2"]
            expected = ["[behemoth] step 1", *stays_before, *REAL[real], *stays_after, "[behemoth] step 2"]
            for batches in _cuts(lines, every_cut=not (before and after)):
                out = _through(batches)
                where = (before, real, after, [len(b) for b in batches])
                assert _contains(out, REAL[real]), where
                assert [x for x in out if x.strip()] == [x for x in expected if x.strip()], where


def test_two_real_tracebacks_in_a_row_both_show():
    for first, one in REAL.items():
        for second, other in REAL.items():
            for batches in _cuts([*one, *other], every_cut=True):
                out = _through(batches)
                assert _contains(out, one) and _contains(out, other), (first, second, batches)


def test_a_real_error_followed_by_rays_stop_of_the_process_shows():
    """The order in which they come when a trial or worker fails and is then stopped: a real error, then Ray's
    SIGTERM exit or an intended-exit teardown. The real one stays, the stop goes."""
    for noise in ("sigterm", "teardown"):
        lines = REAL["plain"] + NOISE[noise][0]
        assert [x for x in filter_lines(lines) if x.strip()] == [x for x in REAL["plain"] if x.strip()], noise


def test_held_lines_are_let_out_when_nothing_completes_them(monkeypatch):
    """A traceback cut off by the end of a batch is held for its rest; if that never comes (a process that hangs
    or died mid-write) it is printed after HOLD_S, without waiting for another batch or the driver's exit."""
    import time

    from behemoth.driver import ray_console

    monkeypatch.setattr(ray_console, "HOLD_S", 0.2)
    out = []
    handler = ray_console._filtered(lambda data: out.extend(data["lines"]))
    handler({"pid": 7, "is_err": True, "lines": REAL["thread"][:3]})
    assert out == REAL["thread"][:1]  # the traceback is held: its end may still make it noise
    deadline = time.monotonic() + 5
    while len(out) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out == REAL["thread"][:3]
