"""`behemoth check` reads what it cheaply can before Ray (issue 65 items 5 and 9): the Hub probe through
huggingface_hub's own client, the first records of every text file, the model's config against the data, LoRA's
targets, the profiler's window, the tracking packages."""

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

PLATFORM = Path(__file__).resolve().parents[2] / "platform"


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A Hub (or a proxy in front of one) on a loopback port: answers 200 to anything and records the request
    lines it received."""

    seen: list

    def _answer(self):
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = do_CONNECT = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def loopback_server():
    handler = type("Handler", (_Recorder,), {"seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: nothing listens there


def _probe(env: dict, home: Path) -> subprocess.CompletedProcess:
    """check_source of a Hub name the cache does not hold, in a fresh process: huggingface_hub reads HF_ENDPOINT,
    HF_HUB_OFFLINE and the proxies when it is imported, as in `behemoth check`. `home`: an empty HF_HOME (a cache
    that holds nothing)."""
    code = ("from behemoth.models import sources\n"
            "from huggingface_hub import constants\n"
            "try:\n"
            "    sources.check_source('behemoth-tests/no-such-model', 'model.pretrained')\n"
            "    print('REACHABLE')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "print('OFFLINE' if constants.is_offline_mode() else 'ONLINE')\n")
    clean = {k: v for k, v in os.environ.items()
             if "proxy" not in k.lower() and not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "PYTHONPATH": str(PLATFORM), "HF_HOME": str(home), **env})


def test_the_hub_probe_goes_through_huggingface_hubs_client_and_its_proxy(loopback_server, tmp_path):
    """The probe used a raw TCP connection: a cluster whose only way out is HTTPS_PROXY/HTTP_PROXY was judged
    offline. Now it is a request of huggingface_hub's own session: through the proxy of the environment (the
    proxy sees the request for the Hub's address), and straight to an HF_ENDPOINT that answers."""
    address, seen = loopback_server
    through = _probe({"HF_ENDPOINT": "http://hub.behemoth.test", "HTTP_PROXY": address, "NO_PROXY": ""}, tmp_path)
    assert through.stdout.split() == ["REACHABLE", "ONLINE"], through.stdout + through.stderr
    assert seen == ["HEAD http://hub.behemoth.test/"]
    direct = _probe({"HF_ENDPOINT": address}, tmp_path)
    assert direct.stdout.split() == ["REACHABLE", "ONLINE"], direct.stdout + direct.stderr
    assert seen[1:] == ["HEAD /"]
    # The Hub's own https address: HTTPS_PROXY carries it (a tunnel, through which this stand-in speaks no TLS)
    _probe({"HF_ENDPOINT": "https://hub.behemoth.test", "HTTPS_PROXY": address, "NO_PROXY": ""}, tmp_path)
    assert seen[2:] == ["CONNECT hub.behemoth.test:443"]


def test_an_unreachable_hub_is_one_line_and_offline_mode_takes_effect(tmp_path):
    """A Hub that does not answer: one line naming the key, the endpoint and `hf download` (the installed
    huggingface_hub ships `hf`, not huggingface-cli), and offline mode on where huggingface_hub reads it (its
    constant: the environment variable alone, set after the import, changed nothing). A malformed HF_ENDPOINT
    is one line too, not ValueError's traceback."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    out = _probe({"HF_ENDPOINT": endpoint}, tmp_path).stdout
    assert out.splitlines() == [
        f"ConfigError model.pretrained behemoth-tests/no-such-model: not in this machine's Hugging Face cache and "
        f"the Hub is unreachable (no answer from {endpoint}). Download it where there is network (hf download "
        f"behemoth-tests/no-such-model --local-dir DIR), copy DIR to every node, and set model.pretrained to DIR",
        "OFFLINE"]
    told = _probe({"HF_HUB_OFFLINE": "1"}, tmp_path).stdout
    assert "the Hub is unreachable (HF_HUB_OFFLINE=1)" in told
    bad = _probe({"HF_ENDPOINT": "https://hf.invalid:99999"}, tmp_path)
    assert bad.stdout.splitlines() == [
        "ConfigError HF_ENDPOINT 'https://hf.invalid:99999' is not a valid Hub address (Port out of range 0-65535): "
        "fix it (e.g. https://huggingface.co or a mirror's https://HOST) or unset it", "ONLINE"], bad.stderr


def _check(tmp_path, job: dict, capsys, *overrides: str) -> tuple[int, str, str]:
    import yaml
    from behemoth.driver.commands.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    code = main(["check", str(path), *[arg for o in overrides for arg in ("--set", o)]])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_reads_the_first_records_of_every_text_file(text_corpus, tmp_path, capsys):
    """`behemoth check` said "(tokenised at train time)" and exit 0 for a JSONL without the text field, one whose
    text_field holds chat messages, or a file that is not JSON; each failed inside Ray later. Now the first records
    of every file are read: one line naming the file and the line, before Ray. The good corpus still passes."""
    import json

    from conftest import lm_job_dict

    job = lm_job_dict(text_corpus, tmp_path)
    assert _check(tmp_path, job, capsys)[0] == 0
    no_field, chat, not_json = (tmp_path / f"{n}.jsonl" for n in ("no_field", "chat", "not_json"))
    no_field.write_text(json.dumps({"body": "a story"}) + "\n")
    chat.write_text(json.dumps({"text": "a story", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    not_json.write_text("Once upon a time\n")
    for path, overrides, said in [
            (no_field, [], "no field 'text' (data.text_field); the record has ['body']"),
            (chat, ["data.text_field=messages"], "field 'messages' holds list, not text"),
            (not_json, [], "not valid JSON")]:
        files = {"train_files": [str(path)], "val_files": [str(path)]}
        code, out, err = _check(tmp_path, {**job, "data": {**job["data"], **files}}, capsys, *overrides)
        assert (code, out) == (1, "") and err.startswith(f"behemoth: error: {path} line 1: ") and said in err
        assert err.count("\n") == 1, err


def _model_folder(folder: Path, tokenizer: Path | None = None, **sizes) -> Path:
    """A Hugging Face model folder as save_pretrained leaves one (its config; the check reads no weights), with
    the tokenizer's files where given."""
    import shutil

    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, **{"vocab_size": 512, "max_position_embeddings": 64, **sizes}
                ).save_pretrained(folder)
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            shutil.copy(f, folder / f.name)
    return folder


def test_the_tokenizer_defaults_to_the_pretrained_models_own(text_corpus, tmp_path, capsys):
    """With model.pretrained and no data.tokenizer the error told the user to train a new tokenizer; a model folder
    without a tokenizer gave transformers' multi-line sentencepiece message, exit 1. Now data.tokenizer defaults to
    the model's folder where that holds one (the resolved config shows it); otherwise one line, exit 2. A model on
    object storage is refused in one line (not skipped as "its own error")."""
    from conftest import lm_job_dict

    job = lm_job_dict(text_corpus, tmp_path)
    del job["data"]["tokenizer"]
    folder = _model_folder(tmp_path / "llama", text_corpus / "tokenizer")
    job["model"] = {"name": "causal_lm", "pretrained": str(folder)}
    code, out, _ = _check(tmp_path, job, capsys)
    assert code == 0 and f"tokenizer: {tmp_path / 'llama'}\n" in out

    bare = str(_model_folder(tmp_path / "bare"))
    job["model"]["pretrained"] = bare
    assert _check(tmp_path, job, capsys)[::2] == (
        2, f"behemoth: config error: {tmp_path / 'job.yaml'}: data.tokenizer is empty and model.pretrained {bare} "
           f"holds no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model): set data.tokenizer to the model's "
           f"tokenizer (a folder or a Hub name)\n")
    job["data"]["tokenizer"] = bare
    assert _check(tmp_path, job, capsys)[::2] == (
        2, f"behemoth: config error: data.tokenizer {bare}: the folder holds no tokenizer (tokenizer.json, "
           f"tokenizer_config.json, tokenizer.model): point data.tokenizer at a tokenizer's folder (the model's own, "
           f"or `behemoth data train-tokenizer`'s)\n")

    # a bucket this machine cannot reach (no network here): one line naming the key, before Ray (a bucket's
    # model folder that is there: tests/integration/test_s3.py)
    job["model"]["pretrained"] = "s3://bucket/models/llama"
    job["data"]["tokenizer"] = str(text_corpus / "tokenizer")
    status, _, err = _check(tmp_path, job, capsys)
    assert status == 2 and err.startswith("behemoth: config error: model.pretrained s3://bucket/models/llama: the "
                                          "store cannot be listed (") and err.count("\n") == 1, err


def test_check_reads_the_models_config_and_builds_loras_targets_on_the_meta_device(text_corpus, tmp_path, capsys):
    """`behemoth check` passed data.seq_len beyond the model's positions, a tokenizer larger than its vocabulary,
    LoRA targets the model does not have and a rank of a billion (all found inside Ray, the last after allocating).
    Now the model's config is read (model.pretrained's config.json, or hf_config) and LoRA's adapters are added to
    the model built on the meta device: each one line, exit 2, before Ray."""
    from conftest import lm_job_dict

    job = lm_job_dict(text_corpus, tmp_path)
    config_error = "behemoth: config error: "
    for overrides, said in [
            (["data.seq_len=64"], "model.hf_config (llama): max_position_embeddings 32 < data.seq_len 64: lower "
                                  "data.seq_len or raise model.hf_config.max_position_embeddings"),
            (["model.hf_config.vocab_size=64"], "model.hf_config (llama): vocab_size 64 is smaller than the "
                                                "tokenizer's "),
            (["model.lora.target_modules=[no_such_module]"], "model.lora: Target modules {'no_such_module'} not "
                                                             "found in the base model."),
            (["model.lora.r=1000000000"], "model.lora.r 1000000000 exceeds the smallest side of an adapted layer (16, "
                                          "model.layers.0.self_attn.v_proj): a rank above it adds nothing; use at "
                                          "most 16")]:
        code, out, err = _check(tmp_path, job, capsys, *overrides)
        assert (code, out) == (2, "") and err.startswith(config_error + said) and err.count("\n") == 1, err
    assert _check(tmp_path, job, capsys, "model.lora.r=16")[0] == 0  # the side itself: allowed

    folder = _model_folder(tmp_path / "llama", text_corpus / "tokenizer", max_position_embeddings=64)
    job["model"] = {"name": "causal_lm", "pretrained": str(folder)}
    assert _check(tmp_path, job, capsys, "data.seq_len=64")[0] == 0
    assert _check(tmp_path, job, capsys, "data.seq_len=128")[::2] == (
        2, f"{config_error}{folder}: max_position_embeddings 64 < data.seq_len 128: lower data.seq_len or raise "
           f"model.hf_config.max_position_embeddings\n")


def test_check_counts_a_small_corpus_blocks_and_fits_the_profilers_window_in_the_run(text_corpus, image_root, tmp_path,
                                                                                     capsys):
    """A text epoch with no step (fewer blocks than the global batch) and a profiler window beyond the run's last
    step (never exited: no trace written) passed `behemoth check`. Now a small corpus is tokenised and counted
    before Ray (the count: as the tokenizer makes it, one EOS per document, cut into seq_len blocks), and the
    window must end by the run's last step (train.max_steps, or the epochs' steps where the samples are known)."""
    import json

    from conftest import job_dict, lm_job_dict
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(text_corpus / "tokenizer"))
    docs = [json.loads(line)["text"] for line in (text_corpus / "train.jsonl").read_text().splitlines()]
    blocks = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs) // 32
    job = lm_job_dict(text_corpus, tmp_path)
    code, out, _ = _check(tmp_path, job, capsys)
    assert code == 0 and f"; tokenizer {len(tok)} tokens ({blocks} training blocks of 32 tokens)\n" in out
    workers = job["scaling"]["num_workers"]
    too_many = (blocks // workers + 1) * workers
    assert _check(tmp_path, job, capsys, f"train.global_batch_size={too_many}")[::2] == (
        2, f"behemoth: config error: train.global_batch_size {too_many} exceeds the {blocks} training samples: an "
           f"epoch would have no step. Lower it to at most {blocks} (a divisor of the workers' split: "
           f"scaling.num_workers x micro-batch), or add data\n")

    assert _check(tmp_path, job, capsys, "train.profile.start_step=13")[0] == 0  # steps 14..16 of 16: fits
    assert _check(tmp_path, job, capsys, "train.profile.start_step=1000000000")[::2] == (
        2, "behemoth: config error: train.profile records steps 1000000001..1000000003, beyond the run's 16 steps "
           "(train.max_steps): no trace would be written. Lower train.profile.start_step to at most 13\n")
    images = job_dict(image_root, tmp_path / "runs", train={"epochs": 2, "global_batch_size": 16,
                                                             "profile": {"start_step": 10, "steps": 3}})
    assert _check(tmp_path, images, capsys)[::2] == (
        2, "behemoth: config error: train.profile records steps 11..13, beyond the run's 12 steps (2 epoch(s) of 6 "
           "steps): no trace would be written. Lower train.profile.start_step to at most 9\n")


@pytest.mark.parametrize("key,module,name", [("tracking.wandb.project=p", "wandb", "wandb"),
                                             ("tracking.mlflow.uri=mlruns", "mlflow", "MLflow")])
def test_a_tracking_package_that_is_not_installed_is_found_before_ray(image_root, tmp_path, capsys, monkeypatch, key,
                                                                      module, name):
    """W&B (or MLflow) configured where the package is not installed passed `behemoth check`, and `train` found it
    only after Ray started and the data was prepared. (None in sys.modules: what `import wandb` then raises.)"""
    from conftest import job_dict

    monkeypatch.setitem(sys.modules, module, None)
    code, out, err = _check(tmp_path, job_dict(image_root, tmp_path / "runs"), capsys, key)
    setting = key.split("=")[0]
    assert (code, out, err) == (2, "", f"behemoth: config error: {setting} is set but {name} is not installed: pip "
                                       f"install 'behemoth[{module}]' (or unset {setting})\n")


def test_a_hugging_face_datasets_text_column_must_hold_text(text_corpus, tmp_path, capsys):
    """A saved dataset whose data.text_field is a chat's `messages` (a list of turns) passed `behemoth check`: only
    the column's name was checked, and tokenising failed inside a Ray Data task. Now its type is read too."""
    import datasets
    from conftest import lm_job_dict

    turns = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]] * 4
    datasets.Dataset.from_dict({"text": ["a story"] * 4, "messages": turns}).save_to_disk(str(tmp_path / "chat"))
    job = lm_job_dict(text_corpus, tmp_path)
    data = {k: v for k, v in job["data"].items() if k not in ("train_files", "val_files")}
    job["data"] = {**data, "hf_dataset": str(tmp_path / "chat"), "val_fraction": 0.25}
    assert _check(tmp_path, job, capsys)[0] == 0
    code, out, err = _check(tmp_path, job, capsys, "data.text_field=messages")
    assert (code, out) == (1, "") and err.startswith(
        f"behemoth: error: data.hf_dataset '{tmp_path / 'chat'}' split 'train': column 'messages' (data.text_field) "
        f"holds List(") and err.endswith(", not text: a conversation column is data.kind chat's "
                                         "(data.messages_field)\n") and err.count("\n") == 1, err


def test_a_malformed_hf_endpoint_is_one_line_for_a_job_that_names_no_hub_model(image_root, tmp_path, capsys,
                                                                               monkeypatch):
    """huggingface_hub parses HF_ENDPOINT when transformers imports its downloads: a port out of range was a
    ValueError traceback from `behemoth check` of a job with local files only. Now it is checked first, one line.
    (Set where huggingface_hub keeps what it read from HF_ENDPOINT at import; the probe tests set the variable.)"""
    from conftest import job_dict
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://hf.invalid:99999")
    assert _check(tmp_path, job_dict(image_root, tmp_path / "runs"), capsys)[::2] == (
        2, "behemoth: config error: HF_ENDPOINT 'https://hf.invalid:99999' is not a valid Hub address (Port out of "
           "range 0-65535): fix it (e.g. https://huggingface.co or a mirror's https://HOST) or unset it\n")


def test_a_relative_path_to_write_to_is_refused_in_a_submitted_jobs_uploaded_folder(image_root, tmp_path, capsys,
                                                                                      monkeypatch):
    """`ray job submit --working-dir .` runs the driver in Ray's unpacked copy of the upload: a relative
    checkpoint.storage_path (the default `runs`), MLflow folder or sqlite database, or sweep folder was written
    inside it, deleted with Ray's session or its package cache, and a resubmission of a changed folder ran in
    another copy, found no checkpoint and trained from step 0. Refused there in one line naming the fix; absolute
    paths and URIs pass; a relative data.cache_dir (made again by every submission) is a warning; outside a
    submitted job (and for a `local://` working dir, the node's own) nothing changes. (Ray's job supervisor hands the driver its runtime env in RAY_JOB_CONFIG_JSON_ENV_VAR.)"""
    import json

    import yaml

    from behemoth.driver.run.preflight import check_outlives_the_job
    from behemoth.driver.sweep.config import check_sweep, load_sweep
    from behemoth.errors import ConfigError
    from conftest import job_dict

    job = job_dict(image_root, tmp_path / "runs")
    assert _check(tmp_path, job, capsys, "checkpoint.storage_path=runs")[0] == 0  # (not in a submitted job)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {
        "working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}, "metadata": {}}))
    monkeypatch.chdir(tmp_path)  # an entrypoint that went elsewhere first (`cd /shared && python ...`): not refused
    assert _check(tmp_path, job, capsys, "checkpoint.storage_path=runs")[0] == 0
    upload = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123456789abcdef"
    upload.mkdir(parents=True)
    monkeypatch.chdir(upload)  # where Ray runs a submitted job's entrypoint
    assert _check(tmp_path, job, capsys, f"data.cache_dir={tmp_path}/cache")[2] == ""
    code, out, err = _check(tmp_path, job, capsys, "checkpoint.storage_path=runs")
    assert (code, out) == (2, "") and err == (
        f"behemoth: config error: checkpoint.storage_path 'runs' is a relative path, and this job runs in the working "
        f"dir `ray job submit` uploaded ({upload}), a copy Ray deletes: what is written there is lost to the next "
        f"submission. Give an absolute path on the cluster's nodes or shared storage (e.g. --set "
        f"checkpoint.storage_path=$PWD/runs from the folder you submit from), or a URI\n")
    for uri, refused in (("mlruns", True), ("sqlite:///mlruns.db", True), (f"sqlite:///{tmp_path}/m.db", False),
                         (str(tmp_path / "mlruns"), False), ("http://127.0.0.1:5000", False)):
        code, _, err = _check(tmp_path, job, capsys, f"tracking.mlflow.uri={uri}")
        assert code == (2 if refused else 0), (uri, err)
        assert not refused or f"tracking.mlflow.uri '{uri}' is a relative path" in err
    assert "--set tracking.mlflow.uri=sqlite:///$PWD/mlruns.db" in _check(
        tmp_path, job, capsys, "tracking.mlflow.uri=sqlite:///mlruns.db")[2]
    check_outlives_the_job("checkpoint.storage_path", "s3://bucket/runs")  # a URI: not refused
    code, _, err = _check(tmp_path, job, capsys, "data.cache_dir=data_cache")  # a cache: made again, said
    assert code == 0 and "data.cache_dir 'data_cache' is a relative path" in err and "$PWD/data_cache" in err

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"job": "job.yaml", "space": {"train.lr": {"grid": [0.1]}},
                                     "storage_path": "runs/sweeps"}))
    with pytest.raises(ConfigError, match=r"^storage_path 'runs/sweeps' is a relative path"):
        check_sweep(load_sweep(sweep))
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "local:///srv/app"}}))
    assert _check(tmp_path, job, capsys, "checkpoint.storage_path=runs")[0] == 0
