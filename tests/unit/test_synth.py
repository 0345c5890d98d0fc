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
