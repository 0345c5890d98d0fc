"""An export that serves (issue 66, item 5): a tiny Llama taught one ChatML reply, checkpointed without Ray,
exported; transformers alone loads the export and its generation stops at the chat template's end-of-turn
token."""

import pytest
import torch

from behemoth.config import dump_yaml
from behemoth.job import config_from_dict
from behemoth.storage.checkpoint import TrainState
from behemoth.tasks.causal_lm import build_lm
from behemoth.worker import checkpointing
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
    from behemoth.driver.export import export

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
    checkpointing.save(ckpt, model=model, optimizer=optimizer, scheduler=lr_schedule(optimizer, cfg.train, 20),
                       state=TrainState(step=60), task_files={}, job_yaml=dump_yaml(cfg))
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
