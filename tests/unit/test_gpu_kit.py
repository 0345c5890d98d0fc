"""The GPU kit and the GPU tier's plan, without a GPU: the kit's wheel surgery, the lending's sizing (budget,
files that come back, Unix socket paths), the benches' options and the checkpoint bench's figure.

The kit's real build and its install into a fresh Python 3.12 (Ray started there) run in the full tier
(tests/integration/test_gpu_kit.py); the device script's dry run too."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import gpu_kit  # noqa: E402
import gpu_tier  # noqa: E402


def _wheel(path: Path, files: dict[str, bytes], requires: list[str]) -> Path:
    meta = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {**files, "demo-1.0.dist-info/METADATA": meta.encode(),
             "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "demo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("demo-1.0.dist-info/RECORD", record)
    return path


def test_a_trimmed_wheel_holds_what_is_kept_and_its_record_matches_it_and_pip_installs_it(tmp_path):
    wheel = _wheel(tmp_path / "demo-1.0-py3-none-any.whl",
                   {"demo/__init__.py": b"X = 1\n", "demo/jars/big.jar": b"0" * 5000, "demo/keep/a.py": b"Y = 2\n"},
                   [])
    before, after = gpu_kit.trim_wheel(wheel, ("demo/jars/",))
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "demo/jars/big.jar" not in names and {"demo/__init__.py", "demo/keep/a.py"} <= names
        rows = [line.split(",") for line in z.read("demo-1.0.dist-info/RECORD").decode().splitlines()]
        listed = {row[0] for row in rows}
        assert listed == names  # every file listed once, nothing listed that is gone
        for name, digest, size in rows:
            if digest:
                data = z.read(name)
                assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
                    b"=").decode() and int(size) == len(data)
    # installed as the lent machine installs the kit
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True)
    assert (tmp_path / "site" / "demo" / "keep" / "a.py").is_file()
    assert not (tmp_path / "site" / "demo" / "jars").exists()


def test_requirements_are_read_for_the_lent_machines_python_and_the_extras_asked_for(tmp_path):
    wheel = _wheel(tmp_path / "demo-1.0-py3-none-any.whl", {}, [
        "click>=7.0", "pydantic<3; extra == 'train'", "rich; extra == 'serve'",
        "async-timeout<6.0,>=4.0; python_version < '3.11'", "pywin32; sys_platform == 'win32'"])
    assert gpu_kit.requirements_of(wheel, set()) == ["click>=7.0"]
    assert gpu_kit.requirements_of(wheel, {"train"}) == ["click>=7.0", "pydantic<3"]


def test_the_kit_carries_what_the_image_lacks_and_nothing_it_has():
    # behemoth's own requirements that the image lacks are the kit's roots; torch & co. are the image's
    roots = {gpu_kit.canonical(r.split("[")[0].split("=")[0].split(">")[0]) for r in gpu_kit.ROOTS}
    assert {"ray", "simplejpeg", "datasets"} <= roots
    assert not roots & gpu_kit.IMAGE_HAS
    assert {"torch", "transformers", "peft", "pyarrow", "pillow", "pytest"} <= gpu_kit.IMAGE_HAS


def test_the_first_part_fits_a_lending_with_room_for_a_rerun():
    first = gpu_tier.steps("/s", "first")
    assert [name for name, _, _ in first] == ["llama_1b", "resnet50", "checkpoint_1b"]  # the priority order
    # measured on the first lending (one H200, 2026-11-28): the machine's start ~30 s (the lease's held time less
    # the call's), the kit's install 2 s and its import check ~10 s; a rerun of one step took 197 s
    start_s, install_s, rerun_s = 30, 20, 200
    assert 900 - start_s - (gpu_tier.FIRST_BUDGET_S + install_s) >= rerun_s
    assert sum(limit for _, _, limit in first) <= gpu_tier.FIRST_BUDGET_S
    # every part's step finishes within one device command (10 minutes)
    assert all(limit < 600 for _, _, limit in gpu_tier.steps("/s", "all"))


def test_the_tier_returns_two_files_whatever_the_part_and_stops_at_its_budget(tmp_path):
    py = sys.executable
    chosen = [("quick", [py, "-c", "print('MFU 41.5%')"], 30),
              ("slow", [py, "-c", "import time; print('half way', flush=True); time.sleep(30)"], 5),
              ("never", [py, "-c", "print('x')"], 30)]
    out = tmp_path / "out" / "gpu-figures.json"
    # (the quick step may take up to 4 s on a loaded machine: the slow one still starts, and after its 5 s
    # under 20 s of the 24 are left)
    status = gpu_tier.run_steps(chosen, out, str(tmp_path), budget=24)
    assert status == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu-figures.json", "gpu-tier.log"]  # <= 8 come back
    figures = json.loads(out.read_text())
    assert figures["steps"]["quick"]["status"] == 0 and figures["steps"]["quick"]["mfu"] == "41.5"
    assert figures["steps"]["slow"]["status"] == "timeout"  # its own limit
    assert figures["steps"]["never"]["status"].startswith("not run")  # the budget left is under 20 s
    assert {"gpu", "cpus", "torch", "cuda", "mfu_convention"} <= set(figures)
    assert "===== quick" in (out.parent / "gpu-tier.log").read_text()
    assert "half way" in figures["steps"]["slow"]["tail"]


def test_a_steps_output_reaches_the_log_while_it_runs(tmp_path):
    """The device's kill of the whole call would erase output kept in memory until a step ends: each line is
    in gpu-tier.log (which comes back) as soon as the step prints it."""
    import threading
    import time

    log = tmp_path / "gpu-tier.log"
    seen = []

    def watch():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not seen:
            if log.exists() and "figure 42" in log.read_text():
                seen.append(time.monotonic())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    done = gpu_tier.run_group([sys.executable, "-c", "import time; print('figure 42', flush=True); time.sleep(3)"],
                              30, log=log)
    ended = time.monotonic()
    watcher.join()
    assert done.returncode == 0 and "figure 42" in done.stdout
    assert seen and seen[0] < ended - 1  # in the log while the step still ran


def test_rays_socket_paths_under_the_tiers_folder_fit_a_unix_socket(tmp_path):
    root = gpu_tier.socket_root()
    try:
        # the deepest: the GPU tests' suite folder under the step's TMPDIR, Ray's session with a 7-digit pid,
        # the longest socket name Ray 2.60 makes there
        deepest = (f"{root}/t/bh-test-abcdefgh/ray/session_2026-11-27_20-03-32_745571_4194304/sockets/"
                   f"dash_MetricsHead")
        assert len(deepest.encode()) <= 107, (len(deepest), deepest)
    finally:
        Path(root).rmdir()


def test_step_overhead_keeps_the_steps_and_log_every_it_is_given():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "step_overhead.py"), "--help"], capture_output=True,
                          text=True, check=True)
    assert "--steps" in done.stdout
    import step_overhead

    given = step_overhead.options(["--tinyllama", "--steps", "7", "--log-every", "3"])
    assert (given.steps, given.log_every, given.batch, given.gpu) == (7, 3, 8, True)  # the GPU kit's sizing wins
    assert (lambda a: (a.steps, a.log_every, a.gpu))(step_overhead.options(["--tinyllama", "--tiny"])) == (40, 10, False)
    assert (lambda a: (a.steps, a.log_every))(step_overhead.options(["--tinyllama"])) == (160, 20)
    assert (lambda a: (a.steps, a.log_every, a.hidden))(step_overhead.options(["--fast"])) == (300, 10, 64)
    assert (lambda a: (a.steps, a.log_every))(step_overhead.options([])) == (60, 10)


def test_the_gpu_time_a_checkpoint_costs_is_read_from_the_report_windows():
    import checkpoint_blocking

    # reports every 10 steps at 1 s a window; checkpoints every 50 steps; the second checkpoint's interval holds
    # 2.5 s more than its steps take, the first's 0.4 s
    extra = {60: 0.4, 110: 2.0, 120: 0.5}
    reports, t = [], 100.0
    for step in range(10, 161, 10):
        t += 1.0 + extra.get(step, 0.0)
        reports.append({"step": step, "wall_time": t, "loss": 1.0})
    lost = checkpoint_blocking.lost_per_checkpoint(reports, 50)
    assert lost == pytest.approx([0.4, 2.5, 0.0])


def test_the_tier_reads_each_figure_as_the_benches_print_it_a_negative_loss_included():
    """Lines as the dry run printed them (the full tier's gpu-tier.log): the GPU time lost per checkpoint is
    measured against the median step, so a CPU's noise makes it negative, and the tier read no figure at all."""
    out = ("repeat 4: behemoth 3.876 steps/s, plain loop 4.475 steps/s, ratio 0.866\n"
           "  GPU time lost per checkpoint: median -0.099 s after the first (each: 0.416, -0.099 s; the steps' own\n"
           "  synchronous torch.save:     blocked median 0.0080 s per checkpoint\n")
    found = gpu_tier.figures("x", out)
    assert found["ratio_so_far"] == "0.866" and found["gpu_lost_per_checkpoint_s"] == "-0.099"
    assert found["torch_save_s"] == "0.0080"
    assert gpu_tier.figures("x", out.replace("-0.099 s after", "0.250 s after"))["gpu_lost_per_checkpoint_s"] == "0.250"
    doc = gpu_tier.figures("x", "  against the unmasked step: dense time 1.40x, memory 3.00x, flex time 1.10x, "
                                "memory 1.05x\n")  # (bench/document_attention.py's last line)
    assert doc["flex_vs_unmasked"] == "1.10" and doc["dense_vs_unmasked"] == "1.40"


def test_a_step_over_its_limit_ends_at_the_sigint_even_where_the_tier_was_started_with_sigint_ignored(tmp_path):
    """A shell without job control (CI's, a background call) starts commands with SIGINT ignored, which a child
    inherits: the step over its limit then ignored the tier's SIGINT and waited 30 s for the SIGKILL (its Ray,
    on the GPU machine, left behind). The step's process gets SIGINT at its default, and exits on it."""
    import signal
    import subprocess
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (conftest puts the suite's handler back after the test)
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_tier.run_group([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], 2,
                           log=tmp_path / "log")
    assert time.monotonic() - began < 20  # (30 s and more: the SIGKILL after the ignored SIGINT)


def test_the_dry_run_runs_each_bench_as_the_device_call_does_at_its_toy_size():
    """The dry run (the integration test's, minutes of the full tier) keeps a step's options where they hold at a
    toy size: llama_1b's one repeat (without it the bench's five were two thirds of the dry run)."""
    dry = {name: command[1:] for name, command, _ in gpu_tier.steps("/tmp/s", "first", dry_run=True)}
    real = {name: command[1:] for name, command, _ in gpu_tier.steps("/tmp/s", "first")}
    assert list(dry) == ["llama_1b", "resnet50", "checkpoint_1b"]
    assert dry["llama_1b"] == [*real["llama_1b"], "--tiny"] and "--repeats" in dry["llama_1b"]
    assert dry["resnet50"] == ["bench/resnet50_feed.py", "--tiny"]
    assert dry["checkpoint_1b"] == ["bench/checkpoint_blocking.py", "--tinyllama", "--tiny"]


def test_a_checkpoints_size_is_read_from_a_complete_folder_never_from_ray_trains_snapshot_file(tmp_path):
    """The checkpoint bench read `next(run.glob("checkpoint_*"))`: where the listing gave Ray Train's
    checkpoint_manager_snapshot.json first (the order differs between machines) it failed (CI, 2026-11-29)."""
    from _common import checkpoint_bytes

    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")
    partial = tmp_path / "checkpoint_2026-11-29_10-00-00.000000"  # (an upload cut short: no manifest)
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"x" * 5)
    complete = tmp_path / "checkpoint_2026-11-29_10-00-01.000000"
    complete.mkdir()
    (complete / "model.safetensors").write_bytes(b"x" * 100)
    (complete / "manifest.json").write_text("{}" + " " * 8)
    assert checkpoint_bytes(tmp_path) == 110
    (complete / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint_bytes(tmp_path)
