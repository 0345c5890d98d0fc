"""`behemoth generate` and an export that serves (issue 66, items 5 and 6): a tiny Llama taught one ChatML reply,
checkpointed without Ray, exported; transformers alone loads the export and its generation stops at the chat
template's end-of-turn token; `behemoth generate` gives transformers' own ids from the checkpoint and from the
export, greedy and seeded sampling alike; its errors are one line."""

import json
import logging
import shutil

import pytest
import torch

from behemoth.config import dump_yaml
from behemoth.data.chat.chat import tokenizer_files
from behemoth.driver.commands.cli import main
from behemoth.job import config_from_dict
from behemoth.storage.checkpoint import TrainState
from behemoth.tasks.causal_lm import build_lm
from behemoth.tasks.kept_tokenizer import kept_tokenizer_files
from behemoth.checkpoints import live_state
from behemoth.worker.optim import build_optimizer, lr_schedule
from conftest import lm_job_dict

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def _chat_tokenizer(text_corpus, folder):
    """The corpus's BPE tokenizer with ChatML's two tokens added and its template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_corpus / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def chat_model(text_corpus, tmp_path_factory):
    """(checkpoint folder, export folder, tokenizer): a 2-layer Llama trained (plain torch steps) until it answers
    "hi" with "hello there<|im_end|>", saved as a behemoth checkpoint and exported."""
    from behemoth.driver.commands.export import export

    root = tmp_path_factory.mktemp("chat")
    tok = _chat_tokenizer(text_corpus, root / "tokenizer")
    cfg = config_from_dict(lm_job_dict(text_corpus, root, data={"tokenizer": str(root / "tokenizer")},
                                       train={"lr": 0.02}))
    torch.manual_seed(0)
    model = build_lm(cfg, len(tok), tok.eos_token_id, tok.bos_token_id)
    optimizer = build_optimizer(model, cfg.train)
    ids = torch.tensor([tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]])
    for _ in range(60):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    ckpt = root / "run" / "checkpoint_2026-01-01_00-00-00.000000"
    live_state.save(ckpt, model=model, optimizer=optimizer, scheduler=lr_schedule(optimizer, cfg.train, 20),
                       state=TrainState(step=60), task_files=kept_tokenizer_files(tokenizer_files(tok)),
                       job_yaml=dump_yaml(cfg))  # (the run's tokenizer kept, as CausalLM.kept_files keeps it)
    export(str(ckpt), str(root / "export"))
    return ckpt, root / "export", tok


def _templated(tok, messages=CHAT[:1]) -> list:
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def test_the_export_loads_with_transformers_alone_keeps_the_template_and_stops_at_the_end_of_turn(chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, out, tok = chat_model
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    served = AutoTokenizer.from_pretrained(out)
    assert served.chat_template == CHATML  # the template survives the export
    # the tokenizer's limit is the model's positions (training lifts it to 2**62: no limit for a server)
    assert served.model_max_length == json.loads((out / "config.json").read_text())["max_position_embeddings"]
    stops = GenerationConfig.from_pretrained(out).eos_token_id
    assert set(stops) == {tok.eos_token_id, end_of_turn}
    assert GenerationConfig.from_pretrained(out).pad_token_id == tok.eos_token_id
    card = (out / "README.md").read_text()
    assert "How it was trained: training from scratch of a freshly initialised llama (model.hf_config)" in card

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = _templated(served)
    out_ids = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert out_ids[-1] == end_of_turn and len(out_ids) < 12  # stopped there, not at max_new_tokens
    assert served.decode(out_ids, skip_special_tokens=True) == "hello there"


def test_generate_is_transformers_own_generate_from_the_checkpoint_and_the_export(chat_model):
    """Same ids as transformers' model.generate on the export: greedy, and sampling seeded the same way."""
    from transformers import AutoModelForCausalLM

    from behemoth.driver.commands.generate import Sampling, load_generator

    ckpt, out, tok = chat_model
    reference = AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = ["once upon a time", CHAT[:1]]
    sampled = Sampling(max_new_tokens=10, temperature=1.3, top_k=40, seed=5)
    for source in (ckpt, ckpt.parent, out):
        generator = load_generator(str(source))
        for prompt in prompts:
            ids = generator.encode(prompt, chat=False)
            assert ids == (_templated(tok) if isinstance(prompt, list) else tok(prompt)["input_ids"])
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):]
            assert generator.complete(ids, Sampling(max_new_tokens=10)) == expected.tolist(), (source, prompt)
            torch.manual_seed(5)
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=True, temperature=1.3,
                                          top_k=40, top_p=1.0)[0, len(ids):]
            assert generator.complete(ids, sampled) == expected.tolist(), (source, prompt)
        again = [c.new_ids for c in generator.run(prompts * 2, sampled)]
        assert again[:2] == again[2:]  # seeded per prompt: the same completions, whatever came before


def test_the_generate_command_prints_completions_of_text_chat_and_jsonl_prompts(chat_model, tmp_path, capsys):
    ckpt, out, _ = chat_model
    assert main(["generate", str(out), "--prompt", "hi", "--chat", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert "greedy, up to 12 new tokens" in printed and printed.endswith("--- prompt 1: hi\nhello there\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": CHAT[:1]}) + "\n\n" + json.dumps({"prompt": "once"}) + "\n")
    assert main(["generate", str(ckpt), "--prompts", str(prompts), "--temperature", "0.8", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "sampling (temperature 0.8" in printed and printed.count("--- prompt ") == 2
    assert '--- prompt 1: [{"role": "user", "content": "hi"}]\nhello there\n' in printed


def test_generate_errors_are_one_line_and_exit_2(chat_model, text_corpus, tmp_path, capsys):
    ckpt, out, _ = chat_model

    def refused(*args) -> str:
        assert main(["generate", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("behemoth: config error: "), err
        return err

    assert "does not exist" in refused(tmp_path / "nowhere", "--prompt", "x")
    (tmp_path / "empty").mkdir()
    assert "is not a behemoth checkpoint, a run folder" in refused(tmp_path / "empty", "--prompt", "x")
    plain = tmp_path / "plain"  # the export, with the corpus's tokenizer: no chat template
    shutil.copytree(out, plain)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (plain / f).unlink(missing_ok=True)
    assert "no tokenizer could be loaded" in refused(plain, "--prompt", "x")
    for f in (text_corpus / "tokenizer").iterdir():
        shutil.copy(f, plain)
    assert "has no chat template (tokenizer.chat_template)" in refused(plain, "--prompt", "x", "--chat")
    assert "name one with --chat-template FILE" in refused(plain, "--prompt", "x", "--chat")
    # a template of the user's (short: ChatML's markers are plain text to this tokenizer, 43 tokens, more than the
    # model's 32 positions, which generate now refuses)
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                         "{% if add_generation_prompt %}assistant: {% endif %}")
    assert main(["generate", str(plain), "--prompt", "x", "--chat", "--chat-template", str(tmp_path / "chat.jinja"),
                 "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    other = tmp_path / "resnet"  # a Hugging Face folder of another kind of model
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    (other / "model.safetensors").write_bytes(b"")
    assert "not a causal language model" in refused(other, "--prompt", "x")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": "hi"}) + "\n")
    assert f"{bad}:2: give a row with" in refused(out, "--prompts", bad)
    assert "prompt 1 is empty (no tokens)" in refused(out, "--prompt", "")
    assert "give --temperature > 0" in refused(ckpt, "--prompt", "x", "--top-p", "0.9")
    assert "--temperature must be a finite number" in refused(ckpt, "--prompt", "x", "--temperature", "nan")


def test_an_export_whose_weights_are_cut_short_or_a_git_lfs_pointer_is_one_line_naming_the_file(chat_model, tmp_path,
                                                                                                 capsys):
    """A model.safetensors copied short, or left a Git LFS pointer by a clone without LFS: one line naming the
    file (and `git lfs pull`), exit 1, not safetensors' "header too large"."""
    _, out, _ = chat_model
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    weights_file = damaged / "model.safetensors"
    whole = weights_file.read_bytes()
    for data, says in ((whole[:len(whole) // 2], f"{weights_file} is damaged"),
                       (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 9\n",
                        f"{weights_file} is a Git LFS pointer, not the weights: run `git lfs pull`")):
        weights_file.write_bytes(data)
        assert main(["generate", str(damaged), "--prompt", "x"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("behemoth: error: ") and err.count("\n") == 1 and says in err, err


def test_generate_runs_no_code_a_model_folder_names(tmp_path, capsys):
    """A Hugging Face folder whose config.json maps its classes to the folder's own Python (auto_map): refused in
    one line, the code never imported (trust_remote_code is never on for generate)."""
    folder = tmp_path / "hostile"
    folder.mkdir()
    marker = tmp_path / "ran.txt"
    (folder / "config.json").write_text(json.dumps({"model_type": "hostile", "auto_map": {
        "AutoConfig": "hostile.Config", "AutoModelForCausalLM": "hostile.Model"}}))
    (folder / "hostile.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "model.safetensors").write_bytes(b"")
    assert main(["generate", str(folder), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "not a causal language model transformers can load without running the folder's code" in err
    assert err.count("\n") == 1 and not marker.exists()


def test_the_stop_ids_hold_the_end_of_turn_token_the_template_writes_where_the_vocabulary_has_it(text_corpus):
    """Llama 3's layout (<|eot_id|> after each turn, BOS in the template) gives [EOS, <|eot_id|>]; ChatML's
    <|im_end|> written by a template whose tokenizer lacks it as a token gives EOS alone."""
    from transformers import AutoTokenizer

    from behemoth.data.chat.chat import render_text
    from behemoth.models.causal_lm import generation_config

    tok = AutoTokenizer.from_pretrained(text_corpus / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                         "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}")
    assert generation_config(tok, render_text).eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
    tok.chat_template = CHATML  # <|im_end|> is text here, not a token of the vocabulary
    assert generation_config(tok, render_text).eos_token_id == tok.eos_token_id
    tok.chat_template = None
    assert generation_config(tok, render_text).eos_token_id == tok.eos_token_id
    assert generation_config(tok, render_text).pad_token_id == tok.eos_token_id


def test_a_prompt_longer_than_the_models_positions_is_refused_and_a_completion_stops_at_them(chat_model, capsys,
                                                                                              caplog):
    """The model has 32 positions: a prompt that fills them is refused before any generation, in one line naming
    it and its length (transformers' own "Token indices sequence length" warning not before it: caplog sees every
    record, wherever transformers' handler writes); a completion stops at the last position, whatever
    --max-new-tokens says (it ran on past them before, through positions the model never learnt)."""
    from behemoth.driver.commands.generate import Sampling, load_generator

    _, out, _ = chat_model
    long = " ".join(["the old red lantern"] * 10)
    assert main(["generate", str(out), "--prompt", long]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompt 1 is " in err and "the model has 32 positions" in err, err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    generator = load_generator(str(out))
    ids = generator.encode("once upon a time the", chat=False)
    new = generator.complete(ids, Sampling(max_new_tokens=100, temperature=1.0, seed=1))
    assert len(ids) + len(new) <= 32 and len(new) > 0


def test_a_chat_template_that_cannot_be_read_or_rendered_is_one_line_naming_it(chat_model, tmp_path, capsys):
    """Issue 72: a template that is not UTF-8 (as --chat-template or data.chat_template), one that calls
    raise_exception, one the sandbox refuses, one that is not Jinja, and a device given as a template file were
    tracebacks (UnicodeDecodeError, TemplateError, SecurityError, TemplateSyntaxError) or a read without end:
    each is one line naming the template, exit 2."""
    from behemoth.data.chat.chat import ChatData
    from behemoth.errors import ConfigError

    _, out, _ = chat_model

    def refused(template) -> str:
        assert main(["generate", str(out), "--prompt", "hi", "--chat", "--chat-template", str(template)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("behemoth: config error: "), err
        return err

    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'café' }}".encode("latin-1"))
    assert f"--chat-template {latin1} is not UTF-8 text (invalid continuation byte at byte 7)" in refused(latin1)
    with pytest.raises(ConfigError, match=rf"data.chat_template '{latin1}' is not UTF-8 text"):
        ChatData(kind="chat", chat_template=str(latin1)).template_text()
    assert "--chat-template /dev/zero is not a file" in refused("/dev/zero")
    for source, reason in (
            ("{{ raise_exception('only user turns, please') }}", "only user turns, please"),
            ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "access to attribute '__class__' of 'str' object "
                                                                "is unsafe"),
            ("{% for %}", "Expected an expression")):
        template = tmp_path / "t.jinja"
        template.write_text(source)
        err = refused(template)
        assert f"prompt 1: --chat-template {template} cannot render it: " in err and reason in err, err


def test_a_prompt_longer_than_the_positions_can_hold_is_refused_before_it_is_tokenised(chat_model, tmp_path, capsys,
                                                                                       monkeypatch):
    """Issue 72: a 50 MB prompt took 38 s and 8 GB to tokenise before its tokens were counted against the model's
    positions. Its characters are now: no token of the tokenizer stands for more than its longest entry, so a
    prompt of more characters than the positions times that is refused before it is tokenised (here 4 MB, at
    once); a prompts file is read up to PROMPTS_FILE_BYTES."""
    from behemoth.driver.commands import generate

    _, out, tok = chat_model
    longest = max(map(len, tok.get_vocab()))
    prompts = tmp_path / "long.txt"
    prompts.write_text("the old red lantern " * 200_000 + "\n")
    assert main(["generate", str(out), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (f"prompt 1 is 4000000 characters: the model's 32 positions hold at most {32 * longest} characters "
            f"with this tokenizer; shorten it") in err
    assert main(["generate", str(out), "--prompt", "x" * (32 * longest + 1), "--chat"]) == 2
    assert "characters: the model's 32 positions hold" in capsys.readouterr().err  # (rendered, then refused)
    monkeypatch.setattr(generate, "PROMPTS_FILE_BYTES", 1 << 20)
    assert main(["generate", str(out), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"--prompts {prompts} is larger than 1 MiB: split it into smaller files" in err and err.count("\n") == 1


def test_a_prompts_file_of_json_nested_past_pythons_recursion_is_one_line(tmp_path):
    """100,000 nested `[` in a --prompts JSONL was a RecursionError traceback (issue 72 item 5)."""
    import pytest

    from behemoth.driver.commands.generate import read_prompts
    from behemoth.errors import ConfigError

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: not a JSON object this reads \(nested too deeply\)"):
        read_prompts(str(path))


def test_a_text_prompt_is_encoded_as_training_encoded_a_document(text_corpus, tmp_path):
    """A tokenizer whose post-processor writes <s> before and </s> after a text (add_eos_token): the prompt
    ended in EOS, which the model reads as a finished document; a special token's spelling in it was that
    token, where training read it as text. Now [BOS] + the text as text, as data/text/text.py encodes a document."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from behemoth.driver.commands.generate import Generator

    core = Tokenizer.from_file(str(text_corpus / "tokenizer" / "tokenizer.json"))
    core.add_special_tokens(["<s>", "</s>"])
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", core.token_to_id("<s>")), ("</s>", core.token_to_id("</s>"))])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    prompt = "once upon a time <|endoftext|> there"
    ids = Generator(model=None, tokenizer=tok, config=None, source="t").encode(prompt, chat=False)
    text = tok(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ids == [tok.bos_token_id, *text] and tok.eos_token_id not in ids
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in ids
