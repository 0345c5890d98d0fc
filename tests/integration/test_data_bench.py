"""`behemoth data bench`: a job's input pipeline alone, one consumer per worker, as the workers receive it; its
figures and its last line, for image folders of JPEGs, tar shards and text blocks."""

import json
import re

import pytest

from behemoth.driver.commands.data_bench import bench_data, measured_step_rate
from behemoth.errors import ConfigError
from behemoth.job import config_from_dict
from conftest import job_dict, lm_job_dict

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]

LINE = re.compile(r"^data bench: ([\d,]+) samples/s \(([\d,]+) per CPU, ([\d.]+) CPUs\), ([\d,]+) bytes per sample, "
                  r"feeds ([\d.]+) workers at ([\d.]+) steps/s")


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    from behemoth.data.image.synth import write_synth_images

    root = tmp_path_factory.mktemp("jpegs")
    write_synth_images(root, classes=2, per_class=24, val_per_class=2, size=(64, 48), seed=0, image_format="jpeg")
    return root


def image_job(image_root, storage, **data):
    job = job_dict(image_root, storage, data={"image_size": 32, "augment": "random_resized_crop", "cache": "none",
                                        "cache_dir": str(storage / "cache"), **data})
    return config_from_dict(job)


@pytest.mark.quick  # quick tier: the input pipeline alone (`behemoth data bench`)
def test_an_image_jobs_pipeline_is_measured_as_its_two_workers_receive_it(jpeg_root, tmp_path):
    """Two consumers (the job's two workers) take 8 samples a step each, 32-px uint8 images: the bytes per
    sample are exactly 3 x 32 x 32 for the image, plus label, sample id and valid flag; the rate, the CPUs
    busy and 'feeds N workers' agree with each other and with the last line a script reads."""
    result = bench_data(image_job(jpeg_root, tmp_path), seconds=3.0, step_rate=4.0)
    assert result.workers == 2 and result.per_worker_batch == 8
    assert result.bytes_by_key == {"image": 32 * 32 * 3, "label": 8, "sample_id": 8, "valid": 1}
    assert result.samples_per_s > 0 and 0 < result.cpus_busy <= 2.05 and result.window_s > 1
    assert result.feeds == pytest.approx(result.samples_per_s / (4.0 * 8))
    m = LINE.match(result.lines()[-1])
    assert m, result.lines()
    assert int(m.group(4).replace(",", "")) == 3 * 32 * 32 + 17
    assert float(m.group(1).replace(",", "")) == pytest.approx(result.samples_per_s, abs=1)


def test_tar_shards_and_text_blocks_are_measured_too(jpeg_root, tmp_path, text_corpus):
    from behemoth.data.image.image_shards import write_shards
    from behemoth.data.image.images import index_image_folder

    shards = tmp_path / "shards"
    write_shards(index_image_folder(jpeg_root), shards, 16)
    tar = bench_data(image_job(jpeg_root, tmp_path, kind="image_webdataset", root="",
                               train_files=[str(shards / "train-*.tar")], val_files=[str(shards / "val-*.tar")]),
                     seconds=2.0)
    assert tar.bytes_by_key["image"] == 32 * 32 * 3 and tar.samples_per_s > 0 and tar.feeds is None
    assert "feeds ? workers" in tar.lines()[-1]

    lm = bench_data(config_from_dict(lm_job_dict(text_corpus, tmp_path)), seconds=2.0, step_rate=2.0)
    assert lm.samples_per_s > 0 and lm.per_worker_batch == 8
    assert lm.bytes_by_key["input_ids"] == 32 * 8  # one block of seq_len int64 tokens a sample


def test_the_step_rate_of_a_run_folder_and_bad_rates_are_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 10, "wall_time": 100.0, "samples_per_s": 1.0}, {"step": 20, "wall_time": 102.0, "val_loss": 1.0},
        {"step": 50, "wall_time": 110.0, "samples_per_s": 1.0}]))
    assert measured_step_rate(str(tmp_path)) == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        measured_step_rate(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="--step-rate must be > 0"):
        bench_data(config_from_dict(job_dict(tmp_path, tmp_path)), step_rate=0)
