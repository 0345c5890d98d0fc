"""The filter on Ray's forwarded worker output: known noise goes, real warnings and tracebacks stay."""

import functools
import itertools

import pytest
from behemoth.driver.ray_cluster.output_scan import filter_lines

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
    '  File "/work/main/platform/behemoth/data/image/images.py", line 155, in transform_batch',
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
    from behemoth.driver.ray_cluster.output_filter import _filtered

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
    from behemoth.driver.ray_cluster.output_filter import _filtered

    printed = []
    return _filtered(printed.append), printed, itertools.count(1000)


def _through(batches):
    """What the console shows of a stream of `batches` of one process (a console of its own: no traceback
    shown in an earlier stream is "above")."""
    handler, printed, pids = _handler()
    handler.shown.clear()
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


def _over_and_traceback(lines):
    """(the lines over its first traceback, that traceback on, without the blank lines after it)."""
    k = lines.index("Traceback (most recent call last):")
    rest = lines[k:]
    while not rest[-1].strip():
        rest = rest[:-1]
    return lines[:k], rest


def _as_repeat(one, other):
    """What shows of `other` after `one` when it is the same traceback again (else None): its lines over it,
    less a header line ("Error in training function:", ...) the same as over the first, then one line."""
    (over_one, traceback_one), (over, traceback) = _over_and_traceback(one), _over_and_traceback(other)
    if traceback != traceback_one:
        return None
    header = over and over_one and over[-1] == over_one[-1] and over[-1].startswith(
        ("Error in training function:", "Exception in thread", "Exception ignored in: "))
    return over[:-1] if header else over


def test_two_real_tracebacks_in_a_row_both_show():
    """Both whole; only the same traceback again may be one line instead (issue 34: see the tests at the end),
    under its own lines (less a header the first had too), the first whole."""
    for first, one in REAL.items():
        for second, other in REAL.items():
            again = _as_repeat(one, other)
            for batches in _cuts([*one, *other], every_cut=True):
                out = _through(batches)
                where = (first, second, batches)
                assert _contains(out, one), where
                if not _contains(out, other):
                    printed = [line for line in out if line.strip()]
                    assert again is not None, where
                    assert printed[:-1] == [line for line in one + again if line.strip()], where
                    assert printed[-1].startswith("[behemoth] the same traceback as pid="), where


def test_a_real_error_followed_by_rays_stop_of_the_process_shows():
    """The order in which they come when a trial or worker fails and is then stopped: a real error, then Ray's
    SIGTERM exit or an intended-exit teardown. The real one stays, the stop goes."""
    for noise in ("sigterm", "teardown"):
        lines = REAL["plain"] + NOISE[noise][0]
        assert [x for x in filter_lines(lines) if x.strip()] == [x for x in REAL["plain"] if x.strip()], noise


class _Time:
    """A console's clock and its scheduled wake-ups, driven by the test (no waits on a real clock)."""

    def __init__(self):
        self.now, self.wake_ups = 100.0, []  # (delay, callback) as the console asked for them

    def console(self, out: list):
        from behemoth.driver.ray_cluster.output_filter import _filtered

        return _filtered(lambda data: out.extend(data["lines"]), clock=lambda: self.now,
                         wake_up_after=lambda delay, callback: self.wake_ups.append((delay, callback)))

    def wake_up(self) -> None:
        """The pending wake-up comes now, as its timer would."""
        _, callback = self.wake_ups.pop()
        callback()


def test_held_lines_are_let_out_when_nothing_completes_them():
    """A traceback cut off by the end of a batch is held for its rest; if that never comes (a process that hangs
    or died mid-write) it is printed after HOLD_S, without waiting for another batch or the driver's exit."""
    from behemoth.driver.ray_cluster.output_filter import HOLD_S

    out, time = [], _Time()
    handler = time.console(out)
    handler({"pid": 7, "is_err": True, "lines": REAL["thread"][:3]})
    assert out == []  # the traceback is held, with its header: its end may still make it noise, or a repeat
    assert [delay for delay, _ in time.wake_ups] == [HOLD_S]
    time.now += HOLD_S
    time.wake_up()
    assert out == REAL["thread"][:3] and time.wake_ups == []  # nothing held: no wake-up left pending


def test_the_wake_up_of_held_lines_runs_on_its_own():
    """The console's default wake-up is a timer thread of its own (a daemon: the exit's flush lets all out)."""
    import threading

    from behemoth.driver.ray_cluster.output_filter import _wake_up_after

    woke = threading.Event()
    _wake_up_after(0.0, woke.set)
    assert woke.wait(timeout=60)  # at once; 60 s only so that a stalled machine cannot fail it


def test_a_real_traceback_is_printed_hold_s_after_its_first_line_whatever_follows():
    """A traceback, then plain lines every half second: each goes on its message, so it stays undecided; it was
    held until 2 s passed without a batch (never, while the process printed: lost when the driver was then
    killed). Now it shows HOLD_S after its first line came, at the next batch or the wake-up, whichever first."""
    from behemoth.driver.ray_cluster.output_filter import HOLD_S

    traceback = REAL["thread"]
    for by_wake_up in (False, True):
        out, time = [], _Time()
        handler = time.console(out)
        handler({"pid": 7, "is_err": True, "lines": traceback})
        sent, started = list(traceback), time.now
        while time.now + 0.5 < started + HOLD_S:
            time.now += 0.5
            handler({"pid": 7, "is_err": True, "lines": [f"progress {time.now}"]})
            sent.append(f"progress {time.now}")
            assert out == [], time.now - started  # held for HOLD_S: a chained traceback may still come
        assert time.wake_ups[0][0] == HOLD_S  # the wake-up is due HOLD_S after the traceback's first line
        time.now = started + HOLD_S
        if by_wake_up:
            time.wake_up()
        else:
            handler({"pid": 7, "is_err": True, "lines": ["progress last"]})
            sent.append("progress last")
        assert out == sent, by_wake_up  # the traceback whole, and the lines after it, in order
        handler({"pid": 7, "is_err": True, "lines": ["progress after"]})
        assert out[-1] == "progress after"


def test_a_stream_of_batches_rereads_a_bounded_number_of_held_lines(monkeypatch):
    """Each batch reads the lines held with it again: 1,500 one-line batches after a traceback, all at once
    (within HOLD_S), read 1.1M lines and printed nothing. Now a batch reads at most HOLD_LINES held lines,
    and the traceback shows once that many are held."""
    from behemoth.driver.ray_cluster import output_filter as ray_console
    read = []
    scan = ray_console.scan_lines
    monkeypatch.setattr(ray_console, "scan_lines", lambda lines, *args: read.append(len(lines)) or scan(lines, *args))
    out, time = [], _Time()
    handler = time.console(out)
    handler({"pid": 7, "is_err": True, "lines": REAL["thread"]})
    for k in range(1500):
        handler({"pid": 7, "is_err": True, "lines": [f"progress {k}"]})
    assert out[:len(REAL["thread"])] == REAL["thread"]  # (shown before the exit's flush)
    assert max(read) <= ray_console.HOLD_LINES + 1, max(read)
    handler.flush()
    assert out == [*REAL["thread"], *(f"progress {k}" for k in range(1500))]


# Issue 34: a user's real error (a model whose layers do not fit) is printed by every rank of every attempt
# (the run retries once): the console shows it whole once, then one line per copy.
SHAPE_ERROR = REAL["plain"]
SHAPE_LINE = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x512 and 256x10)"


def _repeat(first):
    return f"[behemoth] the same traceback as {first} printed above ({SHAPE_LINE})"


def _console(streams, cut=None):
    """What a fresh console prints, as (pid, line) in order, of `streams` ({pid: lines} of RayTrainWorker
    actors) when each stream comes cut in two at `cut` (None: each line alone), their batches interleaved."""
    from behemoth.driver.ray_cluster.output_filter import _filtered

    printed = []
    handler = _filtered(lambda data: printed.extend((data["pid"], line) for line in data["lines"]))
    batches = {pid: [lines[:cut], lines[cut:]] if cut else [[line] for line in lines]
               for pid, lines in streams.items()}
    for turn in itertools.zip_longest(*batches.values()):
        for pid, batch in zip(batches, turn):
            if batch:
                handler({"pid": pid, "actor_name": "RayTrainWorker", "is_err": True, "lines": batch})
    handler.flush()
    return printed


def test_a_traceback_from_every_rank_and_the_retry_shows_whole_once_then_one_line_per_copy():
    """Ranks 0 and 1 of the first attempt and rank 0 of the retry print the same traceback among noise; their
    output comes interleaved, each cut anywhere. Whichever copy comes whole first shows whole; each other
    copy is one line, after it, naming the process that showed it; the noise goes, the other lines stay."""
    streams = {101: ["[behemoth] step 3/20", *SHAPE_ERROR, *NOISE["teardown"][0]],
               102: [PREEMPTION, *SHAPE_ERROR, *NOISE["owner gone"][0], "[behemoth] rank 1 stopped"],
               201: ["[behemoth] restored step 0", *NOISE["sigterm"][0], *SHAPE_ERROR]}
    around = {101: (["[behemoth] step 3/20"], []), 102: ([], ["[behemoth] rank 1 stopped"]),
              201: (["[behemoth] restored step 0"], [])}
    shape = [line for line in SHAPE_ERROR if line.strip()]
    for cut in [None, *range(1, max(map(len, streams.values())))]:
        printed = _console(streams, cut)
        out = {pid: [line for p, line in printed if p == pid and line.strip()] for pid in streams}
        whole = [pid for pid in streams if out[pid] == around[pid][0] + shape + around[pid][1]]
        assert len(whole) == 1, (cut, out)
        first = f"RayTrainWorker pid={whole[0]}"
        for pid in set(streams) - set(whole):
            assert out[pid] == around[pid][0] + [_repeat(first)] + around[pid][1], (cut, pid, out)
            assert printed.index((pid, _repeat(first))) > printed.index((whole[0], SHAPE_LINE)), cut


def test_a_copy_under_another_line_keeps_that_line_over_its_one_line():
    """The line over a copy goes with it only when it is the same header as over the first ("Error in training
    function:"); another header, or a line quoting the traceback, stays over the one line."""
    in_a_thread = ["Exception in thread Thread-2 (prefetch):", *SHAPE_ERROR[1:]]
    quoted = ["Error: Training failed due to worker errors:", "[Rank 0,1 Error Snippet]:", *SHAPE_ERROR[1:]]
    printed = _console({101: SHAPE_ERROR, 102: SHAPE_ERROR, 103: in_a_thread, 104: quoted})
    out = {pid: [line for p, line in printed if p == pid and line.strip()] for pid in (101, 102, 103, 104)}
    assert out[101] == [line for line in SHAPE_ERROR if line.strip()]
    assert out[102] == [_repeat("RayTrainWorker pid=101")]
    assert out[103] == [in_a_thread[0], _repeat("RayTrainWorker pid=101")]
    assert out[104] == [*quoted[:2], _repeat("RayTrainWorker pid=101")]


def test_only_a_copy_equal_but_for_pids_and_addresses_is_one_line_any_other_difference_shows_whole():
    """Two tracebacks that differ only in their last line (another shape), or in one frame, are two errors:
    both show whole. One that differs only in a pid or a memory address is the same error again."""
    other_shape = [*SHAPE_ERROR[:-2], SHAPE_LINE.replace("256x10", "512x10"), ""]
    other_frame = [line.replace("loss = task.loss(model, batch)", "loss = task.loss(model, batch, mask)")
                   for line in SHAPE_ERROR]
    ray_task = ["Exception ignored in: <function _finalize at 0x7f7268ae39c0>", *REAL["ray task"][1:]]
    ray_task_again = [line.replace("pid=812", "pid=4410").replace("0x7f7268ae39c0", "0x7f11aa0e3f10")
                      for line in ray_task]
    streams = {101: SHAPE_ERROR, 102: other_shape, 103: other_frame, 104: ray_task, 105: ray_task_again}
    for cut in (None, 3):
        out = {pid: [line for p, line in _console(streams, cut) if p == pid] for pid in streams}
        for pid in (101, 102, 103, 104):
            assert out[pid] == streams[pid], (cut, pid)
        assert out[105] == [("[behemoth] the same traceback as RayTrainWorker pid=104 printed above "
                             "(ValueError: empty shard)")], cut


def test_on_rays_own_printer_the_traceback_shows_whole_once_rays_deduplication_is_off(monkeypatch, capsys):
    """Through Ray's real printer (its "(RayTrainWorker pid=N)" prefix, and its log deduplication, on by
    default, which holds back lines equal to another process's, or merges them into "[repeated 2x across
    cluster]" lines: a traceback with the same frames and another message would lose them). install() turns
    Ray's deduplication off for this console, unless the user chose it (RAY_DEDUP_LOGS)."""
    import functools

    from behemoth.driver.ray_cluster import output_filter as ray_console
    from ray._private import ray_logging, worker

    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")  # the user's own choice: left as it is
    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)
    dispatcher = ray_logging.global_worker_stdstream_dispatcher
    rays_printer = functools.partial(worker.print_to_stdstream, ignore_prefix=False)
    dispatcher.add_handler("ray_print_logs", rays_printer)
    try:
        ray_console.install()
        assert ray_logging.RAY_DEDUP_LOGS is True
        monkeypatch.delenv("RAY_DEDUP_LOGS")  # Ray's default
        ray_console.install()
        assert ray_logging.RAY_DEDUP_LOGS is False
        other_shape = [*SHAPE_ERROR[:-2], SHAPE_LINE.replace("256x10", "512x10"), ""]  # the same frames
        for pid, lines in ((101, SHAPE_ERROR), (102, SHAPE_ERROR), (103, other_shape)):
            dispatcher.emit({"pid": pid, "actor_name": "RayTrainWorker", "is_err": True, "ip": "192.0.2.2",
                             "localhost": "192.0.2.2", "lines": lines})
        dict(dispatcher.handlers)["ray_print_logs"].flush()
    finally:
        dispatcher.remove_handler("ray_print_logs")
    printed = [line.rstrip() for line in capsys.readouterr().err.splitlines()]
    assert printed == [*(f"(RayTrainWorker pid=101) {line}".rstrip() for line in SHAPE_ERROR),
                       f"(RayTrainWorker pid=102) {_repeat('RayTrainWorker pid=101')}",
                       *(f"(RayTrainWorker pid=103) {line}".rstrip() for line in other_shape)]


def _logged_by_tune(error: BaseException) -> str:
    """What Ray Tune's controller prints for a failed trial (its logger.error with exc_info), behemoth's console
    filter installed on that logger."""
    import io
    import logging

    from behemoth.driver.ray_cluster.output_filter import TUNE_CONTROLLER_LOG, filter_tune_trial_errors

    filter_tune_trial_errors()  # as install() does
    log = logging.getLogger(TUNE_CONTROLLER_LOG)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log.addHandler(handler)
    try:
        try:
            raise error
        except BaseException as e:  # noqa: BLE001
            log.error("Trial task failed for trial run_trial_9d756_00001", exc_info=e)
    finally:
        log.removeHandler(handler)
    return out.getvalue()


def test_tunes_copy_of_a_trial_that_ended_on_behemoths_error_is_one_line_and_any_other_keeps_its_traceback():
    """A trial that ended on RunFailedError (its workers' tracebacks already on the console) is logged by Tune
    as behemoth's line; a trial whose own driver failed on anything else keeps Tune's whole traceback."""
    import ray.exceptions

    from behemoth.errors import RunFailedError

    failed = RunFailedError("run '9d756_00001' failed and failure.max_failures=1 restarts are used up: rank 0: "
                            "mat1 and mat2 shapes cannot be multiplied (1x3 and 10x10)")
    wrapped = ray.exceptions.RayTaskError("run_trial", "Traceback (most recent call last):\n  ...", failed)
    printed = _logged_by_tune(wrapped.as_instanceof_cause())
    assert printed.splitlines() == [f"Trial task failed for trial run_trial_9d756_00001: {failed} (its workers' "
                                    f"traceback is shown above; the trial's whole error: the error file below)"]
    for other in (ValueError("the trial's driver broke"),
                  ray.exceptions.RayTaskError("run_trial", "Traceback ...", KeyError("x")).as_instanceof_cause()):
        printed = _logged_by_tune(other)
        assert "Traceback (most recent call last):" in printed and printed.count("\n") > 2, printed
    try:  # behemoth's error while handling another is not behemoth's error: the whole shows
        try:
            raise failed
        except RunFailedError:
            raise OSError("disk full while writing results")
    except OSError as e:
        assert "Traceback (most recent call last):" in _logged_by_tune(e)
