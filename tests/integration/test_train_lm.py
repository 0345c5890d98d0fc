"""Causal LM end to end on real Ray: Ray Data tokenisation + packing, 2 DDP workers over gloo, a tiny Llama,
validation perplexity, checkpoint restore. One Ray instance for the module."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from behemoth.storage.checkpoint import complete_checkpoints, read_state
from behemoth.driver.commands.cli import main
from behemoth.job import config_from_dict
from behemoth.data.text import text
from behemoth.data.text.text_packing import prepare_text
from behemoth.data.token_store import TokenShards
from behemoth.driver.run.trainer import train
from behemoth.errors import RunFailedError
from behemoth.storage.weights import read_state_dict
from conftest import lm_job_dict
from unit.test_text import reference_stream

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


def test_ray_data_packs_exactly_and_caches(text_corpus, tmp_path, monkeypatch):
    unit_bytes = text.UNIT_BYTES
    monkeypatch.setattr(text, "UNIT_BYTES", 2000)  # ~20 Ray Data tasks; lines cross unit boundaries
    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path))
    tokens = prepare_text(cfg.data, seed=0)
    for split, store in (("train", tokens.train), ("val", tokens.val)):
        stream, n_docs = reference_stream(text_corpus / f"{split}.jsonl", "text", cfg.data.tokenizer)
        blocks = np.asarray(store)
        assert blocks.shape == store.shape == (len(stream) // 32, 32)
        np.testing.assert_array_equal(blocks.reshape(-1), stream[: blocks.size])  # Ray kept the corpus order
        np.testing.assert_array_equal(store.gather(np.arange(len(store)))["id"], np.arange(len(store)))
        assert tokens.stats[split]["documents"] == n_docs
    assert tokens.train.dtype == np.uint16  # vocab of 400 fits
    again = prepare_text(cfg.data, seed=0)  # the cache: same folder, same blocks
    assert again.stats["cache"] == tokens.stats["cache"]
    np.testing.assert_array_equal(again.train, tokens.train)
    shards = json.loads((Path(tokens.stats["cache"]) / "meta.json").read_text())["train"]["shards"]
    assert [s["file"] for s in shards] == ["train-00000.npy"]  # a small corpus: one shard per split
    files = prepare_text(config_from_dict(lm_job_dict(text_corpus, tmp_path, data={"token_store": "files"})).data,
                         seed=0)  # the same cache, read by the workers from its files
    assert files.stats["cache"] == tokens.stats["cache"] and isinstance(files.train, TokenShards)
    ids = np.random.default_rng(0).permutation(len(tokens.train))
    np.testing.assert_array_equal(files.train[ids], tokens.train[ids])
    monkeypatch.setattr(text, "UNIT_BYTES", unit_bytes)  # another key is all this needs, not ~20 tasks again
    other = prepare_text(config_from_dict(lm_job_dict(text_corpus, tmp_path, data={"seq_len": 16})).data, seed=0)
    assert other.stats["cache"] != tokens.stats["cache"] and other.train.shape[1] == 16


def test_a_saved_hugging_face_dataset_packs_like_the_files(text_corpus, tmp_path):
    """data.hf_dataset: a DatasetDict written by save_to_disk (train + validation) goes through Ray Data's
    from_huggingface and packs to exactly the blocks of the same documents read from JSONL files."""
    import datasets

    folder = tmp_path / "hf"
    datasets.DatasetDict({split: datasets.Dataset.from_json(str(text_corpus / f"{name}.jsonl"))
                          for split, name in (("train", "train"), ("validation", "val"))}).save_to_disk(folder)
    files = prepare_text(config_from_dict(lm_job_dict(text_corpus, tmp_path / "a")).data, seed=0)
    job = lm_job_dict(text_corpus, tmp_path / "b", data={"train_files": [], "val_files": [], "hf_dataset": str(folder)})
    hf = prepare_text(config_from_dict(job).data, seed=0)
    np.testing.assert_array_equal(hf.train, files.train)
    np.testing.assert_array_equal(hf.val, files.val)
    assert hf.stats["train"]["documents"] == 240 and hf.stats["val"]["documents"] == 40


def _initial_val_loss(cfg, tokens) -> float:
    """The loss of the untrained model (same seed as the run) on the whole validation set."""
    from behemoth.tasks.causal_lm import CausalLM

    torch.manual_seed(cfg.train.seed)
    model = CausalLM(cfg, tokens).build_model().eval()
    with torch.no_grad():
        ids = torch.from_numpy(tokens.val[np.arange(len(tokens.val))].astype(np.int64))
        return model(input_ids=ids, labels=ids).loss.item()


@pytest.mark.quick  # quick tier: language-model training
def test_two_worker_lm_run_lowers_loss_then_reruns(text_corpus, tmp_path):
    """A 2-worker run lowers the loss. When none of its registered checkpoints verifies, a rerun refuses to
    start over and keeps them. (Restoring LM runs from checkpoints, exactly, after failures:
    test_fault_tolerance.py; a rerun of a finished run re-evaluating its final weights, whatever the task:
    test_tracking.py.)"""
    from behemoth.storage.checkpoint import complete_checkpoints

    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, run_name="lm"))
    summary = train(cfg)
    m = summary.metrics
    initial = _initial_val_loss(cfg, prepare_text(cfg.data, seed=0))
    assert initial > 0.9 * math.log(400)  # untrained: close to uniform over the vocabulary
    assert m["step"] == 16 and m["val_loss"] < initial - 1.0
    assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 32)
    assert read_state(summary.latest_checkpoint).step == 16

    kept = complete_checkpoints(tmp_path / "lm")
    _export_loads_with_transformers_alone(summary, cfg, tmp_path)

    for _, path in kept:  # every checkpoint damaged: nothing to resume from, and step 0 would lose the run
        weights = f"{path}/model.pt"
        data = open(weights, "rb").read()
        open(weights, "wb").write(data[: len(data) // 2])
    with pytest.raises(Exception, match="no checkpoint of this run passes verification") as refused:
        train(cfg)
    from behemoth.errors import user_facing_error

    shown = user_facing_error(refused.value)  # the one line `behemoth train` prints
    assert shown.startswith("no checkpoint of this run passes verification") and kept[0][1] in shown
    assert complete_checkpoints(tmp_path / "lm") == kept  # nothing deleted


def _export_loads_with_transformers_alone(summary, cfg, tmp_path) -> None:
    """behemoth export of the run's latest checkpoint, loaded with AutoModelForCausalLM + AutoTokenizer in a
    fresh interpreter without behemoth: the validation loss over the run's validation blocks equals the
    run's, the tokenizer encodes as the run's did, and generate produces text."""
    import subprocess
    import sys

    from behemoth.data.text.text import load_tokenizer

    out = tmp_path / "export"
    assert main(["export", summary.run_dir, "--latest", "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in out.iterdir()}
    blocks = tmp_path / "val_blocks.npy"
    np.save(blocks, prepare_text(cfg.data, seed=0).val)
    text = json.loads((Path(cfg.data.val_files[0])).read_text().splitlines()[0])["text"]
    hf_only = Path(__file__).with_name("hf_only.py")
    run = subprocess.run([sys.executable, str(hf_only), "lm", str(out), str(blocks), text], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["val_loss"] == pytest.approx(summary.metrics["val_loss"], rel=1e-5)
    assert got["ids"] == load_tokenizer(cfg.data.tokenizer)(text)["input_ids"]
    assert len(got["generated"].split()) >= 2


def _step_memory_mb(cfg, tokens, micro_batch: int) -> float:
    """What behemoth's micro-batch search measures for this job's model at a micro-batch size (CPU)."""
    from behemoth.worker.autobatch import step_memory_bytes
    from behemoth.worker.precision import autocast
    from behemoth.tasks.causal_lm import CausalLM

    torch.manual_seed(cfg.train.seed)
    model = CausalLM(cfg, tokens).build_model()
    ids = torch.zeros(micro_batch, cfg.data.seq_len, dtype=torch.long)
    with autocast(torch.device("cpu"), cfg.train.precision):
        return step_memory_bytes(model, lambda: model(input_ids=ids, labels=ids).loss, optimizer_slots=2) / 2**20


def test_speed_switches_in_a_real_run(text_corpus, tmp_path):
    """FSDP with full sharding + bf16 autocast + an automatic micro-batch under a memory cap + asynchronous
    checkpoints, through Ray Train on 2 workers; the metrics a user watches; a rerun restores the sharded
    state (model, optimizer, data position) and continues: 8 steps then 4 more end on exactly the weights of
    12 uninterrupted steps. (What each switch does to the numbers: test_speed_switches.py.)"""
    def job_for(run_name, max_steps, cap_mb):
        # a constant LR: a run's length (max_steps) does not change its schedule
        return lm_job_dict(text_corpus, tmp_path, run_name=run_name, scaling={"strategy": "fsdp_full"},
                           train={"max_steps": max_steps, "precision": "bf16", "micro_batch_size": "auto",
                                  "auto_batch_memory_mb": cap_mb, "peak_tflops": 0.5, "warmup_steps": 0,
                                  "min_lr_ratio": 1.0},
                           checkpoint={"every_n_steps": 4}, eval={"every_n_steps": 4})

    cfg = config_from_dict(job_for("fast", 8, 1e6))
    tokens = prepare_text(cfg.data, seed=0)
    cap_mb = 0.6 * _step_memory_mb(cfg, tokens, 8)  # a worker's 8 samples do not fit at once
    first = train(config_from_dict(job_for("fast", 8, cap_mb))).metrics
    micro, accum = first["micro_batch_size"], first["grad_accum_steps"]
    assert micro < 8 and micro * accum == 8 and _step_memory_mb(cfg, tokens, micro) <= cap_mb
    assert first["step"] == 8 and first["val_loss"] < _initial_val_loss(cfg, tokens) - 0.5
    assert first["peak_mem_gb"] > 0.1 and first["model_tflops_per_sample"] > 0
    assert first["mfu"] == pytest.approx(first["tflops_per_worker"] / 0.5) and 0 < first["mfu"] < 1
    assert 0 <= first["checkpoint_block_s"] < 5  # the step-4 checkpoint's wait, reported at step 8
    summary = train(config_from_dict(job_for("fast", 12, cap_mb)))
    assert summary.resumed_from_step == 8 and summary.metrics["step"] == 12
    assert read_state(summary.latest_checkpoint).step == 12
    straight = train(config_from_dict(job_for("straight", 12, cap_mb)))
    a, b = (read_state_dict(s.latest_checkpoint) for s in (summary, straight))  # sharded (FSDP's default)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "fast" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in log] == [4, 8, 12] and all("mfu" in m and m["time"] > 0 for m in log)


def test_sharded_checkpoints_survive_a_kill_and_resume_on_fewer_workers(text_corpus, tmp_path, monkeypatch, capfd):
    """FSDP (fsdp_full) on 2 workers writes sharded checkpoints: each rank its own DCP file, rank 0 the index and
    the manifest over every rank's files, last. Rank 0 is SIGKILLed while committing checkpoint 12 (its shards
    written, its manifest not); the run fails (max_failures 0). A shard of checkpoint 8 is then damaged (same
    size). The rerun on ONE worker removes the partial 12, skips 8 naming the damaged shard, restores 4 (DCP
    reshards 2 -> 1) and trains to 12. Its weights equal the uninterrupted 2-worker run's within 1e-6 (measured
    2.2e-8 on AMD EPYC: one worker sums its 16 samples' gradients in one pass where two workers all-reduce two
    halves, so the float rounding differs; the sample order and the update do not), read whole from the shards;
    `behemoth export` of the sharded checkpoint loads with transformers with those weights."""
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.hosts.faults import FAULT_ENV

    def job(name, workers):
        return lm_job_dict(text_corpus, tmp_path, run_name=name, scaling={"strategy": "fsdp_full",
                           "num_workers": workers}, train={"max_steps": 12, "warmup_steps": 0},
                           checkpoint={"every_n_steps": 4, "keep": 4}, eval={"every_n_steps": 12})

    straight = train(config_from_dict(job("straight", 2)))
    marker = tmp_path / "killed"
    env = ray_session.worker_env_vars
    monkeypatch.setattr(ray_session, "worker_env_vars", lambda: {**env(), FAULT_ENV: f"resharded:12:{marker}"})
    with pytest.raises(RunFailedError):
        train(config_from_dict(job("resharded", 2)))
    assert marker.exists()
    folder = tmp_path / "resharded"
    assert [step for step, _ in complete_checkpoints(folder)] == [8, 4]
    partial = [c for c in folder.glob("checkpoint_*") if c.is_dir() and not (c / "manifest.json").exists()]
    assert len(partial) == 1 and sorted(p.name for p in (partial[0] / "state").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    eight = Path(complete_checkpoints(folder)[0][1])
    manifest = json.loads((eight / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and "model.pt" not in manifest["files"]
    assert {"state/.metadata", "state/__0_0.distcp", "state/__1_0.distcp", "state_values.json",
            "scheduler.pt"} <= set(manifest["files"])
    shard = eight / "state" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    monkeypatch.setattr(ray_session, "worker_env_vars", env)
    capfd.readouterr()
    resumed = train(config_from_dict(job("resharded", 1)))
    out = capfd.readouterr()
    logs = out.out + out.err
    assert "a checkpoint upload that did not finish" in logs
    assert f"skipping checkpoint {eight}" in logs and "state/__1_0.distcp does not match its manifest" in logs
    assert resumed.resumed_from_step == 4 and resumed.metrics["step"] == 12 and resumed.metrics["world_size"] == 1
    a, b = read_state_dict(resumed.latest_checkpoint), read_state_dict(straight.latest_checkpoint)
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"resumed on 1 worker vs 2 straight: max |weight difference| {worst:.2e}")
    assert 0 < worst < 1e-6, worst
    from transformers import AutoModelForCausalLM

    from behemoth.driver.commands.export import export

    out, _ = export(resumed.latest_checkpoint, str(tmp_path / "export"))  # the sharded checkpoint, exported
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(exported[k], a[k]) for k in a)


def test_powersgd_through_ray_train_restores_exactly(text_corpus, tmp_path, monkeypatch):
    """PowerSGD compression with asynchronous checkpoints on the loop's own path inside Ray Train (2 DDP
    workers): the snapshot carries each rank's hook state (error feedback, Q matrices), the upload thread
    writes it, a restore loads it. Rank 0 is SIGKILLed while uploading checkpoint 8 (the fault hook); Ray
    Train restarts the group, which removes the partial upload, restores checkpoint 4 and redoes steps 5-8
    and beyond. Every redone step's loss on every rank equals, bit for bit, what the first group computed:
    from step 6 on that holds only if the PowerSGD state was restored exactly (step 5's update used it)."""
    from behemoth.driver.ray_cluster import session as ray_session
    from behemoth.hosts.faults import FAULT_ENV
    from integration.ledger_audit import read_ledger

    marker = tmp_path / "killed"
    env = ray_session.worker_env_vars
    monkeypatch.setattr(ray_session, "worker_env_vars", lambda: {**env(), FAULT_ENV: f"powersgd:8:{marker}"})
    ledger = tmp_path / "ledger"
    cfg = config_from_dict(lm_job_dict(
        text_corpus, tmp_path, run_name="powersgd",
        train={"max_steps": 12, "grad_compression": "powersgd", "powersgd_warmup_steps": 2, "warmup_steps": 0,
               "sample_ledger": str(ledger)},
        checkpoint={"every_n_steps": 4, "async_save": True}, eval={"every_n_steps": None},
        failure={"max_failures": 1}))
    summary = train(cfg)
    assert marker.is_file()  # the kill happened
    assert summary.metrics["step"] == 12 and summary.resumed_from_step == 4
    assert (Path(summary.latest_checkpoint) / "comm_hook.pt").is_file()
    records = read_ledger(ledger)
    groups = list(dict.fromkeys(r["group"] for r in records if r["rank"] == 0))
    assert len(groups) == 2
    first = {(r["step"], r["rank"]): r for r in records if r["group"] == groups[0]}
    redone = [r for r in records if r["group"] == groups[1] and (r["step"], r["rank"]) in first]
    assert {r["step"] for r in redone} >= {5, 6, 7, 8}
    for r in redone:
        before = first[(r["step"], r["rank"])]
        assert r["ids"] == before["ids"]
        assert r["loss_sum"] == before["loss_sum"], (r["step"], r["rank"], r["loss_sum"], before["loss_sum"])


def test_invalid_utf8_fails_the_run_naming_file_and_line(text_corpus, tmp_path, capsys):
    bad = tmp_path / "train.txt"
    bad.write_bytes(b"a fine line\n" * 5 + "caf\u00e9\n".encode("latin-1"))
    job = lm_job_dict(text_corpus, tmp_path, data={"train_files": [str(bad)]})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["train", str(tmp_path / "job.yaml")]) == 1
    assert f"{bad}: invalid UTF-8 at line 6 (byte 63)" in capsys.readouterr().err
    assert not (tmp_path / "lm").exists()  # no run folder: it failed before training started


def test_a_local_ray_runs_its_workers_at_normal_priority():
    """behemoth's own local Ray instance starts workers at niceness 0, not Ray's 15 (which made them yield the
    CPU to every Ray daemon: ~25% slower training on 2 cores, BENCHMARKS.md P2); it prestarts no worker
    processes (none of behemoth's could use them), turns Ray Train's preemption watcher off, and gives the job
    behemoth's worker variables (driver/ray_cluster/warmup.py needs them). A fresh process, no RAY_ADDRESS: ensure_ray
    starts the instance as `behemoth train` does."""
    import os
    import subprocess
    import sys

    code = """if True:
        import os, time, ray
        from behemoth.driver.ray_cluster import session as ray_session
        def processes():  # (pid, parent, title) of every process
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f, open(f"/proc/{pid}/cmdline", "rb") as g:
                        yield int(pid), int(f.read().rpartition(")")[2].split()[1]), g.read().decode(errors="replace")
                except OSError:  # gone meanwhile
                    pass

        ray_session.ensure_ray()
        time.sleep(3)  # Ray prestarts its workers once the driver has connected
        ours = {pid for pid, parent, _ in processes() if parent == os.getpid()}  # this instance's raylet, GCS...
        print("idle", sum("ray::IDLE" in title for _, parent, title in processes() if parent in ours))
        print("job env", sorted(ray.get_runtime_context().runtime_env["env_vars"]))
        ray_session.set_ray_train_env()
        print("watcher", os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"])
        print("niceness", ray.get(ray.remote(lambda: os.nice(0)).remote()))
    """
    # As a user's shell has it: no RAY_ADDRESS, no RAY_AUTH_MODE (Ray turns token auth on by default); the
    # token stays the tests' (RAY_AUTH_TOKEN_PATH), not ~/.ray's.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}  # (conftest's)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "niceness 0" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "idle 0\n" in out.stdout and "watcher 0\n" in out.stdout, out.stdout
    assert "job env ['MKL_CBWR', 'RAY_TRAIN_ENABLE_PRINT_PATCH']" in out.stdout, out.stdout
    assert "Token authentication is enabled" not in out.stderr  # the notice about the default, filtered


BROKEN_PIPELINES = {  # faulty_pipeline's loop -> the audit's message for its first BROKEN_AT + 2 steps
    "loop_with_a_repeated_batch": "step 4 trained step 3's batch again (a repeated batch); step 4's batch was "
                                  "never trained (a skipped batch)",
    "loop_with_a_skipped_batch": "step 4 trained step 5's batch, ahead of its place; step 5 trained step 6's "
                                 "batch, ahead of its place; step 4's batch was never trained (a skipped batch)"}


@pytest.mark.parametrize("loop", BROKEN_PIPELINES)
def test_the_ledger_audit_names_a_repeated_and_a_skipped_batch(text_corpus, tmp_path, loop):
    """The ledger holds what the pipeline delivered, so the audit the failure tests rely on (and pass with
    the real pipeline) fails when the data layer repeats a batch in place of the next, or drops one, though
    the planned order is right; its message says which step trained what (a ledger that stopped recording
    would say a step is missing instead)."""
    from behemoth.driver.run.sequence import prepare_data
    from behemoth.driver.run.trainer import build_trainer
    from integration import faulty_pipeline, ledger_audit

    broken_at = faulty_pipeline.BROKEN_AT
    job = lm_job_dict(text_corpus, tmp_path, run_name="faulty",
                      train={"max_steps": broken_at + 2, "sample_ledger": str(tmp_path / "ledger")},
                      checkpoint={"every_n_steps": 100}, eval={"every_n_steps": None})
    cfg = config_from_dict(job)
    data = prepare_data(cfg)
    trainer = build_trainer(cfg, data)
    trainer.train_loop_per_worker = getattr(faulty_pipeline, loop)
    trainer.fit()
    with pytest.raises(AssertionError) as e:
        ledger_audit.audit(tmp_path / "ledger", len(data.train), steps=broken_at + 2, batch=16)
    assert str(e.value) == f"the ledger differs from the planned order: {BROKEN_PIPELINES[loop]}"
    ledger_audit.audit(tmp_path / "ledger", len(data.train), steps=broken_at, batch=16)  # the steps before


def test_a_bf16_pretrained_model_trains_with_fp32_master_weights(text_corpus, tmp_path):
    """A pretrained model stored in bf16 (transformers loads it as bf16) fine-tuned under precision bf16: the
    checkpoint's weights and AdamW state are fp32 (model.dtype float32, the default): the workers train fp32
    master weights, autocast doing the bf16 compute."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "bf16_llama"
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                  vocab_size=400)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, run_name="bf16", scaling={"num_workers": 1},
                                       model={"pretrained": str(folder), "hf_config": {}},
                                       train={"max_steps": 2, "precision": "bf16"},
                                       checkpoint={"every_n_steps": 2}, eval={"every_n_steps": None}))
    summary = train(cfg)
    assert {v.dtype for v in read_state_dict(summary.latest_checkpoint).values() if v.is_floating_point()} == {
        torch.float32}
    optim = torch.load(f"{summary.latest_checkpoint}/optimizer.pt", map_location="cpu", weights_only=True)
    assert {s.dtype for state in optim["state"].values() for k, s in state.items() if k != "step"} == {torch.float32}
