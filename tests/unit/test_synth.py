from behemoth.driver.commands.cli import main
from behemoth.data.image.images import index_image_folder


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


def test_imagenet_shaped_jpegs_have_imagenets_shapes_and_file_sizes(tmp_path):
    """`behemoth data synth-images --format jpeg`: JPEGs in the ImageFolder layout, landscape, portrait and
    twice-as-large ones, photograph-like enough to weigh what ImageNet's weigh (~110 KB at 500x375; a flat
    picture would be a few KB), the same files for the same seed."""
    import io

    from PIL import Image

    from behemoth.driver.commands.cli import main

    assert main(["data", "synth-images", "--out", str(tmp_path / "a"), "--format", "jpeg", "--classes", "2",
                 "--per-class", "15", "--val-per-class", "1", "--size", "200x150"]) == 0
    files = sorted((tmp_path / "a").rglob("*.jpg"))
    assert len(files) == 32 and not list((tmp_path / "a").rglob("*.png"))
    sizes = {Image.open(f).size for f in files}
    assert sizes <= {(200, 150), (150, 200), (400, 300)} and (200, 150) in sizes and (150, 200) in sizes
    assert all(Image.open(f).format == "JPEG" and Image.open(f).mode == "RGB" for f in files)
    landscape = [f.stat().st_size for f in files if Image.open(f).size == (200, 150)]
    # bytes per pixel of ImageNet's JPEGs: ~110 KB / (500 x 375) = 0.59; a flat picture's is ~0.05
    assert 0.3 < sum(landscape) / len(landscape) / (200 * 150) < 1.2
    main(["data", "synth-images", "--out", str(tmp_path / "b"), "--format", "jpeg", "--classes", "2",
          "--per-class", "15", "--val-per-class", "1", "--size", "200x150"])
    assert all(f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes() for f in files)
    Image.open(io.BytesIO(files[0].read_bytes())).load()


def test_synth_size_arguments_are_checked():
    import pytest

    from behemoth.driver.commands.cli import main

    with pytest.raises(SystemExit):
        main(["data", "synth-images", "--out", "x", "--size", "500by375"])
    assert main(["data", "synth-images", "--out", "x", "--size", "500x375"]) == 2  # PNGs are square: a config error
