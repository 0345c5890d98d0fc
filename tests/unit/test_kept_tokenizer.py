"""The tokenizer and chat template a checkpoint keeps (issue 72, item 2): `behemoth export` and `generate` read
them from the checkpoint (its tokenizer/ folder, checked against the manifest), never from a path its job.yaml
names. A received checkpoint whose job.yaml (manifest updated, as a sender can) names a file of the exporting
machine's copies nothing of it; a template edited or deleted after the run leaves the export with the run's; a
checkpoint written before they were kept is refused in one line naming the flag that names them; a rerun or
`behemoth eval` whose template renders otherwise is refused naming the kept one. Without Ray: the checkpoints
are written as the worker loop writes them (tests/unit/test_loop_wiring.py checks the loop keeps them)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from behemoth.config import dump_yaml
from behemoth.data.chat.chat import chat_tokenizer, tokenizer_files
from behemoth.data.text.text import load_tokenizer
from behemoth.driver.commands.cli import main
from behemoth.job import config_from_dict
from behemoth.storage import checkpoint
from behemoth.tasks.causal_lm import build_lm
from conftest import lm_job_dict

RUN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
SECRET = "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def _write_checkpoint(folder, cfg, kept: dict[str, bytes]) -> str:
    """A checkpoint as the worker loop writes one (model.pt, job.yaml, train_state.json, the task's kept files),
    manifest last: a tiny Llama of the job's config."""
    torch.manual_seed(0)
    tok = chat_tokenizer(cfg.data) if cfg.data.kind == "chat" else load_tokenizer(cfg.data.tokenizer)
    folder.mkdir(parents=True)
    torch.save(build_lm(cfg, len(tok), tok.eos_token_id, tok.bos_token_id).state_dict(), folder / "model.pt")
    files = {"job.yaml": dump_yaml(cfg).encode(), "train_state.json": b'{"step": 1}', **kept}
    for name, data in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)
    checkpoint.commit(folder, checkpoint.hash_files(folder, ["model.pt", *files]), checkpoint.FORMAT_VERSION)
    return str(folder)


def _kept(tok) -> dict[str, bytes]:
    """What CausalLM and ChatLM keep (kept_files): the run's tokenizer as it saved itself, template included."""
    return {f"tokenizer/{name}": data for name, data in tokenizer_files(tok).items()}


def _as_a_sender_rewrites_it(ckpt: str, **data) -> None:
    """job.yaml's data keys changed and the manifest made over it again: a checkpoint that verifies."""
    job = yaml.safe_load(open(f"{ckpt}/job.yaml"))
    job["data"].update(data)
    with open(f"{ckpt}/job.yaml", "w") as f:
        yaml.safe_dump(job, f)
    names = list(json.load(open(f"{ckpt}/manifest.json"))["files"])
    checkpoint.commit(ckpt, checkpoint.hash_files(ckpt, names), checkpoint.FORMAT_VERSION)


@pytest.fixture
def chat_run(text_corpus, tmp_path):
    """(checkpoint, job config) of a chat run whose template is a .jinja file of the user's."""
    template = tmp_path / "template.jinja"
    template.write_text(RUN_TEMPLATE)
    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, data={"kind": "chat", "chat_template": str(template)}))
    ckpt = _write_checkpoint(tmp_path / "run" / "checkpoint_2026-01-01_00-00-00.000000", cfg,
                             _kept(chat_tokenizer(cfg.data)))
    return ckpt, cfg


def _every_byte(folder) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_an_export_copies_no_file_a_received_job_yaml_names_as_its_chat_template(chat_run, tmp_path, capsys):
    """Tried with a credentials file: its secret was the export's chat_template.jinja. Now the export's template
    is the one the checkpoint keeps, the run's; `generate` renders with it too."""
    from transformers import AutoTokenizer

    from behemoth.driver.commands.generate import load_generator

    ckpt, _ = chat_run
    secret = tmp_path / "credentials"
    secret.write_text(SECRET)
    _as_a_sender_rewrites_it(ckpt, chat_template=str(secret))
    assert checkpoint.verify(ckpt)  # (a checkpoint that verifies: nothing tells it from a real one)
    out = tmp_path / "export"
    assert main(["export", ckpt, "--out", str(out)]) == 0, capsys.readouterr().err
    assert SECRET.encode() not in _every_byte(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == RUN_TEMPLATE
    assert load_generator(ckpt).tokenizer.chat_template == RUN_TEMPLATE


def test_an_export_ships_the_tokenizer_the_checkpoint_keeps_not_the_folder_its_job_yaml_names(text_corpus, tmp_path,
                                                                                             capsys):
    """A text run's tokenizer (and its own chat template) comes from the checkpoint: a job.yaml pointed at a
    tokenizer folder of the exporting machine's (its template holding a secret) ships nothing of it."""
    from transformers import AutoTokenizer

    run_tok, private = tmp_path / "run_tok", tmp_path / "private_tok"
    tok = AutoTokenizer.from_pretrained(text_corpus / "tokenizer")
    tok.chat_template = RUN_TEMPLATE
    tok.save_pretrained(run_tok)
    tok.chat_template = "{{ '" + SECRET + "' }}"
    tok.save_pretrained(private)
    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, data={"tokenizer": str(run_tok)}))
    ckpt = _write_checkpoint(tmp_path / "run" / "checkpoint_2026-01-01_00-00-00.000000", cfg,
                             _kept(AutoTokenizer.from_pretrained(run_tok)))
    shutil.rmtree(run_tok)  # the run's tokenizer folder is gone since: the export needs none
    _as_a_sender_rewrites_it(ckpt, tokenizer=str(private))
    out = tmp_path / "export"
    assert main(["export", ckpt, "--out", str(out)]) == 0, capsys.readouterr().err
    assert SECRET.encode() not in _every_byte(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == RUN_TEMPLATE


def test_a_template_edited_or_deleted_after_the_run_leaves_the_export_with_the_runs(chat_run, tmp_path, capsys):
    """docs/chat.md: the template the run used is the one the export keeps. The export read the file the job
    named when it ran: an edited one was exported in its place without a word, a deleted one failed it."""
    from transformers import AutoTokenizer

    ckpt, cfg = chat_run
    template = cfg.data.chat_template
    with open(template, "w") as f:
        f.write("{% for m in messages %}EDITED {{ m['content'] }}{% endfor %}")
    assert main(["export", ckpt, "--out", str(tmp_path / "edited")]) == 0, capsys.readouterr().err
    assert AutoTokenizer.from_pretrained(tmp_path / "edited").chat_template == RUN_TEMPLATE
    (tmp_path / "template.jinja").unlink()
    assert main(["export", ckpt, "--out", str(tmp_path / "deleted")]) == 0, capsys.readouterr().err
    assert AutoTokenizer.from_pretrained(tmp_path / "deleted").chat_template == RUN_TEMPLATE


def test_a_kept_template_edited_in_the_checkpoint_is_damage(chat_run, tmp_path, capsys):
    """The kept copy is checked against the manifest like every file: edited without it, one line naming it."""
    ckpt, _ = chat_run
    with open(f"{ckpt}/tokenizer/chat_template.jinja", "a") as f:
        f.write("{{ 'changed' }}")
    assert main(["export", ckpt, "--out", str(tmp_path / "export")]) == 1
    err = capsys.readouterr().err
    assert "tokenizer/chat_template.jinja does not match its manifest" in err and err.count("\n") == 1, err


def test_a_checkpoint_that_keeps_no_tokenizer_is_exported_only_with_what_the_user_names(text_corpus, tmp_path,
                                                                                        capsys):
    """Written before behemoth kept them: reading the paths its job.yaml names is what a hostile sender uses
    (a checkpoint can leave its kept files out), so export refuses, naming the flag; with the user's
    --tokenizer and --chat-template it exports those."""
    from transformers import AutoTokenizer

    template = tmp_path / "template.jinja"
    template.write_text(RUN_TEMPLATE)
    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, data={"kind": "chat", "chat_template": str(template)}))
    ckpt = _write_checkpoint(tmp_path / "old" / "checkpoint_2026-01-01_00-00-00.000000", cfg, {})

    def refused(*flags) -> str:
        assert main(["export", ckpt, "--out", str(tmp_path / "export"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not (tmp_path / "export").exists(), err
        return err

    assert "keeps no copy of the run's tokenizer" in refused()
    assert f"it names {str(text_corpus / 'tokenizer')!r}): if that is the run's tokenizer, name it yourself: " \
           f"--tokenizer PATH" in refused()
    err = refused("--tokenizer", str(text_corpus / "tokenizer"))
    assert "keeps no copy of the run's chat template" in err and "--chat-template PATH" in err
    assert main(["export", ckpt, "--out", str(tmp_path / "export"), "--tokenizer", str(text_corpus / "tokenizer"),
                 "--chat-template", str(template)]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "export").chat_template == RUN_TEMPLATE


def test_a_rerun_or_eval_whose_template_renders_otherwise_is_refused_naming_the_kept_one(chat_run):
    """The kept template is one of the chat task's checkpoint files: compared with the job's before a rerun
    resumes and before `behemoth eval` scores (driver/run/resume.task_files_differ)."""
    from behemoth.driver.run.resume import task_files_differ
    from behemoth.tasks.chat import ChatLM

    ckpt, cfg = chat_run

    def prepared():  # what ChatLM.prepare leaves in its index for the checkpoint files
        return SimpleNamespace(stats={"tokenizer_files": tokenizer_files(chat_tokenizer(cfg.data))})

    as_run = prepared()
    assert task_files_differ(cfg, as_run, ckpt) is None
    with open(cfg.data.chat_template, "w") as f:
        f.write("{% for m in messages %}EDITED {{ m['content'] }}{% endfor %}")
    what, _ = task_files_differ(cfg, prepared(), ckpt)
    assert what == (f"its tokenizer/chat_template.jinja differs from this data's (the run's is "
                    f"{ckpt}/tokenizer/chat_template.jinja)")
    # (what this module writes by hand is what the task keeps)
    assert ChatLM.checkpoint_files(cfg, as_run) == {"tokenizer/chat_template.jinja": RUN_TEMPLATE}
    assert ChatLM.kept_files(cfg, as_run) == {f"tokenizer/{p.name}": p.read_bytes()
                                              for p in Path(ckpt, "tokenizer").iterdir()}
