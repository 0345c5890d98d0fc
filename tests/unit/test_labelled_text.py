"""Text classification's data, without Ray: the same rows and classes from JSONL, CSV, parquet and a saved
Hugging Face dataset; every bad input one error naming the file, row or key; the job's checks."""

import json

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pytest
from behemoth.data.text.labelled_text import LabelledTextData, load_classification_tokenizer, read_labelled
from behemoth.errors import ConfigError, DataError
from behemoth.job import config_from_dict

ROWS = [{"text": "a happy day", "label": "joy"}, {"text": "a sad day", "label": "sadness"},
        {"text": "so happy", "label": "joy"}]
VAL = [{"text": "sad again", "label": "sadness"}]


def write(folder, name, rows):
    path = folder / name
    table = pa.Table.from_pylist(rows)
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".csv"):
        pyarrow.csv.write_csv(table, path)
    else:
        pyarrow.parquet.write_table(table, path)
    return str(path)


def data(train, val, **kw):
    return LabelledTextData(kind="text_classification", train_files=[train], val_files=[val], tokenizer="t", **kw)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_every_format_gives_the_same_rows_and_classes(tmp_path, suffix):
    rows = read_labelled(data(write(tmp_path, f"train{suffix}", ROWS), write(tmp_path, f"val{suffix}", VAL)))
    assert rows.texts["train"] == [r["text"] for r in ROWS] and rows.labels["val"] == ["sadness"]
    assert rows.classes == ["joy", "sadness"]
    assert rows.origins["train"] == [(str(tmp_path / f"train{suffix}"), 3)]


def test_a_saved_hugging_face_dataset_reads_like_the_files(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "validation": datasets.Dataset.from_list(VAL)}).save_to_disk(tmp_path / "ds")
    cfg = LabelledTextData(kind="text_classification", hf_dataset=str(tmp_path / "ds"), tokenizer="t")
    rows = read_labelled(cfg)
    assert rows.texts["train"] == [r["text"] for r in ROWS] and rows.classes == ["joy", "sadness"]
    with pytest.raises(DataError, match="has no split 'dev'"):
        read_labelled(LabelledTextData(kind="text_classification", hf_dataset=str(tmp_path / "ds"), tokenizer="t",
                                       val_split="dev"))


def test_integer_labels_are_names_sorted_as_numbers(tmp_path):
    train = [{"text": f"t{i}", "label": label} for i, label in enumerate([10, 2, 2, 1])]
    val = write(tmp_path, "b.jsonl", [{"text": "x", "label": 1}])
    rows = read_labelled(data(write(tmp_path, "a.jsonl", train), val))
    assert rows.classes == ["1", "2", "10"] and rows.labels["val"] == ["1"]


def test_bad_rows_are_named_by_file_and_row(tmp_path):
    val = write(tmp_path, "val.jsonl", VAL)
    with pytest.raises(DataError, match=r"train.jsonl has no column 'txt' \(data.text_column\)"):
        read_labelled(data(write(tmp_path, "train.jsonl", ROWS), val, text_column="txt"))
    empty = [*ROWS, {"text": "  ", "label": "joy"}]
    with pytest.raises(DataError, match=r"empty.jsonl row 3: 'text' is empty"):
        read_labelled(data(write(tmp_path, "empty.jsonl", empty), val))
    unknown = write(tmp_path, "unknown.jsonl", [*VAL, {"text": "grr", "label": "anger"}])
    with pytest.raises(DataError, match=r"unknown.jsonl row 1: label 'anger' is not among the training rows' labels"):
        read_labelled(data(write(tmp_path, "train.jsonl", ROWS), unknown))
    one = write(tmp_path, "one.jsonl", [r for r in ROWS if r["label"] == "joy"])
    with pytest.raises(DataError, match=r"1 label\(s\) \(\['joy'\]\): a classifier needs 2 or more"):
        read_labelled(data(one, write(tmp_path, "v.jsonl", [{"text": "x", "label": "joy"}])))
    (tmp_path / "notes.txt").write_text("a happy day\n")
    with pytest.raises(DataError, match=r"notes.txt: a text-classification file is .jsonl, .json, .csv or .parquet"):
        read_labelled(data(str(tmp_path / "notes.txt"), val))


def test_the_job_checks_its_keys_and_model(tmp_path):
    base = {"data": {"kind": "text_classification", "train_files": ["a.jsonl"], "val_files": ["b.jsonl"],
                     "tokenizer": "tok"},
            "model": {"name": "sequence_classifier", "hf_config": {"model_type": "bert"}}}
    cfg = config_from_dict(base)
    assert type(cfg.data) is LabelledTextData and cfg.data.max_length == 128
    with pytest.raises(ConfigError, match="unknown key 'data.seq_len' for data.kind text_classification"):
        config_from_dict({**base, "data": {**base["data"], "seq_len": 8}})
    with pytest.raises(ConfigError, match="data: no validation rows: set data.val_files"):
        config_from_dict({**base, "data": {**base["data"], "val_files": []}})
    with pytest.raises(ConfigError, match="data.kind text_classification cannot train model.name regnet_cifar"):
        config_from_dict({**base, "model": {"name": "regnet_cifar"}})
    with pytest.raises(ConfigError, match=r"model.hf_config.model_type \(e.g. bert\)"):
        config_from_dict({**base, "model": {"name": "sequence_classifier"}})


def test_a_tokenizer_without_a_pad_token_pads_with_its_eos(tmp_path):
    from behemoth.data.tokenizer import train_tokenizer

    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS * 20))
    train_tokenizer([str(tmp_path / "c.jsonl")], tmp_path / "tok", vocab_size=300)
    tok = load_classification_tokenizer(str(tmp_path / "tok"))
    assert tok.pad_token == tok.eos_token == "<|endoftext|>" and tok.padding_side == "right"
    enc = tok(["a happy day"], truncation=True, max_length=8, padding="max_length")
    assert len(enc["input_ids"][0]) == 8 and enc["attention_mask"][0][-1] == 0


def test_csv_labels_and_texts_stay_text_and_numeric_labels_sort_one_way(tmp_path):
    (tmp_path / "t.csv").write_text("text,label\n007,007\nhello,1\nworld,01\n")
    (tmp_path / "v.csv").write_text("text,label\n123,007\n")
    rows = read_labelled(data(str(tmp_path / "t.csv"), str(tmp_path / "v.csv")))
    assert rows.texts["train"][0] == "007" and rows.labels["val"] == ["007"]
    assert rows.classes == ["01", "1", "007"]  # by value, ties by name: the same in every process


@pytest.fixture
def tokenizer(tmp_path):
    from behemoth.data.tokenizer import train_tokenizer

    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS * 20))
    train_tokenizer([str(tmp_path / "c.jsonl")], tmp_path / "tok", vocab_size=300)
    return str(tmp_path / "tok")


def classifier_job(tmp_path, tokenizer, **model) -> dict:
    return {"data": {"kind": "text_classification", "train_files": [write(tmp_path, "train.jsonl", ROWS)],
                     "val_files": [write(tmp_path, "val.jsonl", VAL)], "tokenizer": tokenizer, "max_length": 16},
            "model": {"name": "sequence_classifier", **model}}


def test_the_model_is_checked_before_ray_and_pads_as_its_data(tmp_path, tokenizer):
    """A model_type without a sequence-classification head fails in check (before Ray starts), naming the config;
    labels and the pad id in hf_config are refused; a pretrained model whose config names another pad id gets
    the tokenizer's, the id its batches are padded with (else a decoder-only classifier pools padding)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from behemoth.tasks.text_classification import TextClassification, build_classifier

    small = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "max_position_embeddings": 16}
    cfg = config_from_dict(classifier_job(tmp_path, tokenizer, hf_config=small))
    assert TextClassification.check(cfg).classes == ["joy", "sadness"]
    with pytest.raises(ConfigError, match=r"model.hf_config \(vit\): no sequence classifier from it"):
        TextClassification.check(config_from_dict(classifier_job(tmp_path, tokenizer, hf_config={"model_type": "vit"})))
    for key in ("num_labels", "pad_token_id"):
        with pytest.raises(ConfigError, match=f"model.hf_config.{key}: the labels and the pad id come from the data"):
            config_from_dict(classifier_job(tmp_path, tokenizer, hf_config={**small, key: 3}))

    pad = load_classification_tokenizer(tokenizer).pad_token_id
    folder = tmp_path / "pretrained"
    other = AutoConfig.for_model(vocab_size=300, num_labels=2, pad_token_id=pad + 1, **small)
    AutoModelForSequenceClassification.from_config(other).save_pretrained(folder)
    cfg = config_from_dict(classifier_job(tmp_path, tokenizer, pretrained=str(folder)))
    assert build_classifier(cfg, ["joy", "sadness"], 300, pad).config.pad_token_id == pad


def test_an_edited_or_damaged_labels_json_counts_as_a_damaged_checkpoint(tmp_path, tokenizer, capsys):
    """labels.json names the classes an export writes as id2label: read unchecked, an edited one exported the
    wrong names without a word, garbage was a raw JSONDecodeError, and the driver refused to resume ("trained
    on other data"). Now it is checked against the manifest like every other file: export and eval refuse
    with one CheckpointError naming it; resume compares the data with the previous good checkpoint, the one
    restore falls back to."""
    from pathlib import Path

    from behemoth.storage import checkpoint
    from behemoth.config import dump_yaml
    from behemoth.driver.run import resume
    from behemoth.driver.commands.cli import main
    from behemoth.errors import CheckpointError
    from behemoth.data.chat.chat import tokenizer_files
    from behemoth.tasks.kept_tokenizer import kept_tokenizer_files
    from behemoth.tasks.text_classification import TextClassification, build_classifier

    small = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "max_position_embeddings": 16}
    job = {**classifier_job(tmp_path, tokenizer, hf_config=small),
           "checkpoint": {"storage_path": str(tmp_path / "runs"), "run_name": "r"}}
    cfg = config_from_dict(job)
    rows = TextClassification.check(cfg)
    tok = load_classification_tokenizer(tokenizer)
    model = build_classifier(cfg, rows.classes, len(tok), tok.pad_token_id)
    saved = []
    for step in (3, 6):
        folder = tmp_path / "runs" / "r" / f"checkpoint_2026-01-01_00-00-0{step}.000000"
        checkpoint.write(folder, checkpoint.Snapshot(state_dicts={"model.pt": model.state_dict()}, step=step, texts={
            "job.yaml": dump_yaml(cfg), "train_state.json": json.dumps({"step": step}),
            **TextClassification.checkpoint_files(cfg, rows), **kept_tokenizer_files(tokenizer_files(tok))}))
        saved.append(str(folder))
    older, newest = saved
    assert TextClassification.model_from_checkpoint(cfg, newest).config.id2label == {0: "joy", 1: "sadness"}

    labels = Path(newest, "labels.json")
    for damage in ('["sadness", "joy"]', '\x00{"not json'):  # edited (the names swapped), then garbage
        labels.write_text(damage)
        refused = rf"checkpoint {newest}: labels.json does not match its manifest \(size or sha256\)"
        with pytest.raises(CheckpointError, match=refused):
            TextClassification.model_from_checkpoint(cfg, newest)  # export's
        with pytest.raises(CheckpointError, match=refused):
            resume.task_files_differ(cfg, rows, newest)  # eval's check of the data against it
        with pytest.raises(CheckpointError, match=refused):
            checkpoint.verify(newest)  # restore's: it skips the checkpoint
        resume.check_resume_data(cfg, rows)  # the older one, which restore uses, has this data's labels
        assert main(["export", newest, "--out", str(tmp_path / "export")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "labels.json does not match its manifest" in err, err
    Path(older, "labels.json").write_text('["sadness", "joy"]')  # no good checkpoint: nothing to compare with
    resume.check_resume_data(cfg, rows)


def test_a_hugging_face_class_label_gives_its_names_in_its_order(tmp_path):
    """A saved dataset whose label column is a ClassLabel (as most of the Hub's classification sets: sst2, imdb,
    emotion) was read as its integers: the classes were "0", "2" and the export's pipeline answered "2", not
    "positive". Now its names, in the ClassLabel's order (not sorted: its index is the order its own models
    were trained with); an index outside its names (-1, unlabelled) is a label the training rows lack."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["positive", "neutral", "negative"])})
    train = [{"text": "great", "label": 0}, {"text": "awful", "label": 2}, {"text": "fine", "label": 0}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train, features=features),
                          "validation": datasets.Dataset.from_list([{"text": "bad", "label": 2}], features=features),
                          "test": datasets.Dataset.from_list([{"text": "?", "label": -1}], features=features),
                          }).save_to_disk(tmp_path / "ds")
    rows = read_labelled(LabelledTextData(kind="text_classification", hf_dataset=str(tmp_path / "ds"), tokenizer="t"))
    assert rows.classes == ["positive", "negative"] and rows.labels["train"] == ["positive", "negative", "positive"]
    assert rows.labels["val"] == ["negative"]
    with pytest.raises(DataError, match=r"label '-1' is not among the training rows' labels \(positive, negative\)"):
        read_labelled(LabelledTextData(kind="text_classification", hf_dataset=str(tmp_path / "ds"), tokenizer="t",
                                       val_split="test"))


def test_a_label_of_other_digits_than_ascii_is_a_name(tmp_path):
    """"²" passed str.isdigit and then int() raised a raw ValueError: labels are numbers only in ASCII digits."""
    train = [{"text": "a", "label": "²"}, {"text": "b", "label": "1"}]
    rows = read_labelled(data(write(tmp_path, "a.jsonl", train), write(tmp_path, "b.jsonl", train[:1])))
    assert rows.classes == ["1", "²"]


def test_a_classifier_from_a_config_takes_the_tokenizers_ends_and_an_eos_pooling_one_needs_its_eos(tmp_path,
                                                                                                  tokenizer):
    """model.hf_config's GPT-2 kept its architecture's BOS/EOS 50256 in a 300-token vocabulary (transformers warns
    at the export's load): the tokenizer's now. BART's classifier reads the hidden state at each text's EOS, which
    this tokenizer never appends: every worker failed its first step; refused in check, naming the fix."""
    from behemoth.tasks.text_classification import TextClassification, build_classifier

    tok = load_classification_tokenizer(tokenizer)
    gpt2 = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 16}
    cfg = config_from_dict(classifier_job(tmp_path, tokenizer, hf_config=gpt2))
    TextClassification.check(cfg)
    model = build_classifier(cfg, ["joy", "sadness"], len(tok), tok.pad_token_id, (tok.bos_token_id, tok.eos_token_id))
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id) != (50256,) * 2
    bart = {"model_type": "bart", "d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 16}
    with pytest.raises(ConfigError, match=r"model type bart classifies from the hidden state at the EOS token that "
                                          r"ends each text, and data.tokenizer .* appends none"):
        TextClassification.check(config_from_dict(classifier_job(tmp_path, tokenizer, hf_config=bart)))
