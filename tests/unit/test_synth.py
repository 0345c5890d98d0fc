from behemoth.driver.cli import main
from behemoth.data.images import index_image_folder


def test_synth_images_deterministic_layout(tmp_path):
    assert main(["data", "synth-images", "--out", str(tmp_path / "a"), "--classes", "3", "--per-class", "4",
                 "--val-per-class", "2", "--size", "12", "--seed", "5"]) == 0
    assert main(["data", "synth-images", "--out", str(tmp_path / "b"), "--classes", "3", "--per-class", "4",
                 "--val-per-class", "2", "--size", "12", "--seed", "5"]) == 0
    index = index_image_folder(tmp_path / "a")
    assert index.train.num_rows == 12 and index.val.num_rows == 6 and len(index.classes) == 3
    for p in index.train.column("path").to_pylist():
        assert open(p, "rb").read() == open(p.replace("/a/", "/b/"), "rb").read()


def _synth_images_stderr(out, stderr_is_terminal: bool) -> str:
    """What `behemoth data synth-images` writes to stderr: to a pseudo-terminal (a person watching) or a pipe."""
    import os
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios

    cmd = [sys.executable, "-m", "behemoth", "data", "synth-images", "--out", str(out), "--classes", "2",
           "--per-class", "30", "--val-per-class", "5", "--size", "8"]
    if not stderr_is_terminal:
        return subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=120, check=True).stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    proc = subprocess.Popen(cmd, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode(errors="replace")


def test_a_progress_bar_shows_only_to_a_person_watching(tmp_path):
    """Long preparation steps show a progress bar on a terminal (behemoth/progress.py), nothing in logs."""
    watched = _synth_images_stderr(tmp_path / "a", stderr_is_terminal=True)
    assert "[behemoth] writing demo images" in watched and "/70" in watched and "img" in watched
    assert "[behemoth] writing demo images" not in _synth_images_stderr(tmp_path / "b", stderr_is_terminal=False)
