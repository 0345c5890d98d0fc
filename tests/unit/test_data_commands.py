"""`behemoth data synth-images | synth-text | train-tokenizer | shards | split-val`: a user's files are never
overwritten, bad arguments are one line (argparse's, or behemoth's with its exit code), never a traceback."""

import json

import pytest
from behemoth.driver.commands.cli import main
from behemoth.errors import ConfigError


def _run(capsys, *argv) -> tuple[int, str]:
    """The exit code and stderr of `behemoth data ARGV`, argparse's refusals included."""
    try:
        code = main(["data", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _last_line(err: str) -> str:
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("name", ["train.jsonl", "val.jsonl"])
def test_synth_text_never_overwrites_a_corpus_in_out(tmp_path, capsys, name):
    """An existing train.jsonl or val.jsonl in --out was replaced and "wrote ..." printed."""
    (tmp_path / name).write_text('{"text": "my own corpus"}\n')
    code, err = _run(capsys, "synth-text", "--out", str(tmp_path), "--train-documents", "3", "--val-documents", "2")
    assert code == 2 and err.count("\n") == 1
    assert f"{tmp_path / name} exists: give another --out (nothing is overwritten)" in err
    assert (tmp_path / name).read_text() == '{"text": "my own corpus"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # the other split not written either


def test_synth_images_refuses_a_folder_that_holds_images(tmp_path, capsys):
    """A png run then a `--format jpeg` run into the same --out left both datasets side by side."""
    out = tmp_path / "images"
    out.mkdir()  # an empty folder is fine
    small = ["--classes", "2", "--per-class", "2", "--val-per-class", "1"]
    assert _run(capsys, "synth-images", "--out", str(out), *small, "--size", "8")[0] == 0
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    code, err = _run(capsys, "synth-images", "--out", str(out), *small, "--format", "jpeg", "--size", "40x30")
    assert code == 2 and err == (f"behemoth: config error: --out {out} is not empty: write the images into a new "
                                 f"folder (nothing is overwritten)\n")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before and not list(out.rglob("*.jpg"))


@pytest.mark.parametrize("argv, message", [
    (["synth-images", "--per-class", "-5"], "argument --per-class: -5 is not between 1 and"),
    (["synth-images", "--val-per-class", "0"], "argument --val-per-class: 0 is not between 1 and"),
    (["synth-images", "--seed", "-1"], "argument --seed: -1 is not between 0 and"),
    (["synth-text", "--train-documents", "-3"], "argument --train-documents: -3 is not between 1 and"),
    (["synth-text", "--val-documents", "0"], "argument --val-documents: 0 is not between 1 and"),
    (["synth-text", "--seed", "-1"], "argument --seed: -1 is not between 0 and"),
    (["synth-images", "--classes", "abc"], "argument --classes: 'abc' is not an integer: give one between 1 and 10"),
    (["shards", "root", "--samples-per-shard", "1e3"], "argument --samples-per-shard: '1e3' is not an integer"),
])
def test_counts_and_seeds_out_of_range_are_one_argparse_line(tmp_path, capsys, argv, message):
    """`--per-class -5` printed "wrote -50 train", `--seed -1` was numpy's raw ValueError, and a count that is
    not an integer said "invalid parse value: 'abc'"."""
    code, err = _run(capsys, *argv, "--out", str(tmp_path / "out"))
    assert code == 2 and message in _last_line(err) and not (tmp_path / "out").exists()


def test_an_integer_arguments_type_is_named_in_argparses_own_messages():
    from behemoth.driver.commands.args import int_between

    assert int_between(1, 10).__name__ == "integer between 1 and 10"


@pytest.mark.parametrize("command", [["synth-images"], ["synth-text"], ["shards", "ROOT"], ["train-tokenizer", "F"]])
@pytest.mark.parametrize("below", [False, True])
def test_an_out_that_is_a_file_is_one_line_naming_it(tmp_path, capsys, command, below):
    """NotADirectoryError / FileExistsError tracebacks for `--out afile` (or a folder below a file)."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello world"}\n')
    command = [{"ROOT": str(tmp_path), "F": str(tmp_path / "corpus.jsonl")}.get(a, a) for a in command]
    out = afile / "sub" if below else afile
    code, err = _run(capsys, *command, "--out", str(out))
    assert code == 2 and err == f"behemoth: config error: --out {out}: {afile} is a file, not a folder: give a folder\n"
    assert afile.read_text() == "mine"


def _corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"story {i} of the old red lantern"}) + "\n" for i in range(50)))
    return path


@pytest.mark.parametrize("extra", [["--chat"], ["--chat", "--text-field", "conversation"]])
def test_train_tokenizer_on_no_text_is_one_line_and_writes_nothing(tmp_path, capsys, extra):
    """`--chat` on a file of texts (or a wrong --text-field) trained on nothing and wrote a 259-token
    tokenizer, saying so."""
    code, err = _run(capsys, "train-tokenizer", str(_corpus(tmp_path)), "--out", str(tmp_path / "tok"), *extra)
    assert code == 1 and err.count("\n") == 1 and "no conversation turn read from" in err
    assert str(tmp_path / "corpus.jsonl") in err and "(nothing written)" in err and not (tmp_path / "tok").exists()


def test_train_tokenizer_never_replaces_a_tokenizer(tmp_path, capsys):
    """An existing tokenizer.json in --out was silently replaced."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    code, err = _run(capsys, "train-tokenizer", str(_corpus(tmp_path)), "--out", str(tmp_path / "tok"),
                     "--vocab-size", "300")
    assert code == 2 and err == (f"behemoth: config error: --out {tmp_path / 'tok'} holds a tokenizer already "
                                 f"(tokenizer.json): give another --out (nothing is overwritten)\n")
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == "{}"


def test_train_tokenizer_chat_files_are_expanded_and_checked_as_text_files_are(tmp_path, capsys):
    """`--chat missing.jsonl` was a raw FileNotFoundError and a --chat glob was read as a file name."""
    from behemoth.data.text.synth_text import write_synth_chat

    code, err = _run(capsys, "train-tokenizer", str(tmp_path / "missing.jsonl"), "--chat", "--out",
                     str(tmp_path / "tok"))
    assert code == 1 and err == f"behemoth: error: train-tokenizer: {tmp_path / 'missing.jsonl'} matches no file\n"
    write_synth_chat(tmp_path / "chat", train_documents=30, val_documents=5, seed=1)
    code, err = _run(capsys, "train-tokenizer", str(tmp_path / "chat" / "*.jsonl"), "--chat", "--vocab-size", "300",
                     "--out", str(tmp_path / "tok"))
    assert code == 0 and (tmp_path / "tok" / "tokenizer.json").is_file()


@pytest.mark.parametrize("vocab, chat, low", [("-5", False, 257), ("0", False, 257), ("10000000000000", False, 257),
                                              ("258", True, 259)])
def test_train_tokenizer_vocab_size_out_of_range_is_one_line(tmp_path, capsys, vocab, chat, low):
    """-5 was an OverflowError, 0 silently 257 tokens, a huge one aborted Rust's allocator."""
    code, err = _run(capsys, "train-tokenizer", str(_corpus(tmp_path)), "--out", str(tmp_path / "tok"),
                     "--vocab-size", vocab, *(["--chat"] if chat else []))
    assert code == 2 and err.count("\n") == 1
    assert f"--vocab-size {vocab}: give at least {low} (the 256 bytes and" in err and "at most 1,000,000" in err
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("kaggle", [True, False])
def test_split_val_reads_a_labels_file_saved_with_a_bom(tmp_path, capsys, kaggle):
    """Excel's CSV starts with a UTF-8 BOM; read as text, its header was not 'ImageId,' and every row was
    refused as "expected 'FILENAME CLASS'"."""
    val = tmp_path / "val"
    val.mkdir()
    (val / "a.JPEG").write_bytes(b"a")
    labels = tmp_path / "labels.csv"
    text = "ImageId,PredictionString\r\na,n01 1 2 3 4\r\n" if kaggle else "a.JPEG n01\n"
    labels.write_bytes(b"\xef\xbb\xbf" + text.encode())
    code, err = _run(capsys, "split-val", str(val), "--labels", str(labels))
    assert code == 0, err
    assert (val / "n01" / "a.JPEG").read_bytes() == b"a"


def test_a_path_the_system_refuses_is_one_line_where_no_check_caught_it(capsys):
    """An OSError naming a file, past every check before it (here mkdir under /proc, which makes no folders), is
    one line with the system's reason and the path, exit 1; before, the CLI re-raised it as a traceback."""
    from behemoth.driver.commands.cli import main

    assert main(["data", "synth-images", "--out", "/proc/behemoth-test/x"]) == 1
    err = capsys.readouterr().err
    assert err == "behemoth: error: No such file or directory: /proc/behemoth-test\n"


def test_the_cli_from_python_takes_a_list():
    """behemoth.cli("train job.yaml") ran `behemoth t r a i n ...`: argparse's usage error, naming no cause."""
    import behemoth

    with pytest.raises(ConfigError, match=r"^behemoth.cli takes the arguments as a list, e.g. \['check', 'x.yaml'\]"):
        behemoth.cli("check x.yaml")


def test_split_val_moves_every_format_an_image_folder_reads(tmp_path, capsys):
    """split-val moved only .png/.jpg/.jpeg: a flat val folder of .webp (or .bmp, .tif...) was refused as
    "images without a label" never listed, and an image folder reads all of these formats."""
    from behemoth.data.image.images import IMAGE_SUFFIXES

    val = tmp_path / "val"
    val.mkdir()
    names = [f"img{i}{suffix}" for i, suffix in enumerate(sorted(IMAGE_SUFFIXES))]
    for name in names:
        (val / name).write_bytes(name.encode())
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"{name} n{i % 2}\n" for i, name in enumerate(names)))
    code, err = _run(capsys, "split-val", str(val), "--labels", str(labels))
    assert code == 0, err
    assert sorted(p.relative_to(val).as_posix() for p in val.rglob("*") if p.is_file()) == sorted(
        f"n{i % 2}/{name}" for i, name in enumerate(names))
