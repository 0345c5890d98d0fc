"""Driver side: `behemoth generate` — what a causal LM says to a few prompts, on this machine (CPU, or a GPU where
there is one), no Ray.

The model comes from a behemoth checkpoint or run folder (built as `behemoth export` builds it:
driver/commands/export.load_checkpoint_model, LoRA adapters merged; the run's tokenizer and chat template as the
checkpoint keeps them, never a path its job.yaml names) or from a Hugging Face folder (an export: transformers
alone, never the folder's own code). It stops where an export's
generation_config.json says (models/causal_lm.generation_config: EOS and the chat template's end-of-turn token):
a checkpoint gets the same config the export would write, so both print the same words.

Prompts: one (--prompt), or a file: a prompt per line, or JSONL whose rows hold `prompt` (text) or `messages`
(a conversation, rendered with the tokenizer's chat template and its generation prompt). --chat renders plain
prompts as a user's turn. Greedy unless --temperature > 0 (then sampling, with --top-p / --top-k, seeded per
prompt by --seed: the same command prints the same completions).

A prompt costs no more than the model can take: a prompts file is read up to PROMPTS_FILE_BYTES, and a prompt
longer in characters than the model's positions can hold is refused before it is tokenised.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from behemoth.driver.commands.export import TrustedCode, load_checkpoint_model
from behemoth.errors import CheckpointError, ConfigError
from behemoth.storage import weights
from behemoth.storage.store import Store
from behemoth.storage.checkpoint import complete_checkpoints
from behemoth.driver.commands.args import add_trusted_code_args

Prompt = str | list  # text, or a conversation: [{"role": ..., "content": ...}, ...]
PROMPTS_FILE_BYTES = 64 << 20  # a --prompts file's size at most (read whole, before the model loads)
PROMPT_CHARS = 1 << 22  # a prompt's characters at most where the model does not say how many positions it has


@dataclass(frozen=True)
class Sampling:
    """How to pick each next token: greedy (temperature 0) or sampled from the temperature-scaled
    distribution cut to top_p / top_k, with torch seeded by `seed` before each prompt."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0

    def validate(self) -> None:
        import math

        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k must be at least 1, got {self.top_k}")
        if self.temperature == 0 and (self.top_p is not None or self.top_k is not None):
            raise ConfigError("--top-p and --top-k shape sampling, and --temperature 0 (the default) is greedy: "
                              "give --temperature > 0 (e.g. 0.7) to sample")

    def options(self) -> dict:
        """The generation config's settings (a pretrained model's own sampling defaults are replaced: greedy
        clears them, where transformers would warn that greedy ignores them)."""
        if self.temperature == 0:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False, "temperature": None, "top_p": None,
                    "top_k": None}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": self.top_k or 0}

    def describe(self) -> str:
        if self.temperature == 0:
            return f"greedy, up to {self.max_new_tokens} new tokens"
        return (f"sampling (temperature {self.temperature}, top_p {self.options()['top_p']}, top_k "
                f"{self.top_k or 'off'}, seed {self.seed}), up to {self.max_new_tokens} new tokens")


@dataclass(frozen=True)
class Completion:
    prompt: Prompt
    prompt_ids: list
    new_ids: list
    text: str


@dataclass
class Generator:
    """A causal LM ready to complete prompts: the model (eval, on its device), its tokenizer, the generation
    config it stops by, where it came from, and where its chat template came from (for messages)."""

    model: object
    tokenizer: object
    config: object
    source: str
    template_source: str = "the tokenizer's chat template"
    _longest: int | None = dataclasses.field(default=None, init=False, repr=False)

    def encode(self, prompt: Prompt, chat: bool, which: str = "the prompt") -> list:
        """The prompt's token ids: a conversation (or, with `chat`, a text as a user's turn) through the chat
        template with its generation prompt; a text as training encoded a document. A template that cannot render
        it, or a text longer than the model's positions can hold, is one ConfigError naming `which`."""
        tok = self.tokenizer
        if isinstance(prompt, list) or chat:
            if not tok.chat_template:
                raise ConfigError(f"{self.source}: its tokenizer has no chat template (tokenizer.chat_template), so "
                                  f"a chat prompt cannot be rendered: name one with --chat-template FILE (a Jinja "
                                  f"chat template), or give plain text prompts without --chat")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = self._rendered(messages, which)
            self._check_length(text, which)
            # (the template writes any BOS itself; verbose=False: a prompt past the model's positions is refused
            # by `run` in one line, without transformers' "Token indices sequence length" warning before it)
            return tok(text, add_special_tokens=False, verbose=False)["input_ids"]
        self._check_length(prompt, which)
        # as training encoded a document (data/text/text.py): BOS where the tokenizer starts texts with one, the
        # text as text (a special token's spelling is its characters), and no EOS a post-processor would append
        # (the model would read the prompt as a finished document)
        from behemoth.data.text.text import starts_with_bos

        bos = starts_with_bos(tok)
        ids = tok(prompt, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
        return ([bos] if bos is not None else []) + ids

    def _rendered(self, messages: list, which: str) -> str:
        from behemoth.data.chat.chat import render_prompt

        try:
            return render_prompt(self.tokenizer, messages)
        except Exception as e:  # noqa: BLE001 - a template's errors (raise_exception, the sandbox's refusals,
            # its syntax, undefined names) are of many types; each is the template's, named here
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(f"{which}: {self.template_source} cannot render it: {reason}") from None

    def _check_length(self, text: str, which: str) -> None:
        """Refuse, before tokenising it, a text that would encode to more tokens than the model has positions:
        no token of this tokenizer stands for more characters than its longest entry (a 50 MB prompt took 38 s
        and 8 GB to tokenise before the positions refused it)."""
        positions = self.positions()
        limit = positions * self.longest_token() if positions else PROMPT_CHARS
        if len(text) > limit:
            held = (f"the model's {positions} positions hold at most {limit} characters with this tokenizer"
                    if positions else f"at most {PROMPT_CHARS} characters are taken")
            raise ConfigError(f"{which} is {len(text)} characters: {held}; shorten it")

    def longest_token(self) -> int:
        """The most characters one token of the tokenizer stands for (its longest vocabulary entry; a byte-level
        entry's characters are bytes, at least as many)."""
        if self._longest is None:
            self._longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        return self._longest

    def complete(self, prompt_ids: list, sampling: Sampling) -> list:
        """The new token ids after `prompt_ids` (the stop token included where generation stopped at one)."""
        import torch

        config = copy.deepcopy(self.config)  # the stop ids with this command's settings: one config, as
        config.update(**sampling.options())  # generate() wants (a config plus keywords is deprecated)
        positions = self.positions()
        if positions and len(prompt_ids) + config.max_new_tokens > positions:  # (generation stops at the last one)
            config.max_new_tokens = positions - len(prompt_ids)
        torch.manual_seed(sampling.seed)  # per prompt: a prompt's completion does not depend on the ones before
        ids = torch.tensor([prompt_ids], device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, len(prompt_ids):].tolist()

    def positions(self) -> int | None:
        """The model's positions (max_position_embeddings), where its config says: prompt and completion together
        stay within them."""
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    def run(self, prompts: list, sampling: Sampling, chat: bool = False) -> list:
        sampling.validate()
        # every prompt checked before the first is generated
        encoded = [self.encode(p, chat, f"prompt {n}") for n, p in enumerate(prompts, 1)]
        empty = [n for n, ids in enumerate(encoded, 1) if not ids]
        if empty:  # (generate() would fail on an empty input with a traceback)
            raise ConfigError(f"prompt {empty[0]} is empty (no tokens): give it some text")
        positions = self.positions()
        long = [(n, len(ids)) for n, ids in enumerate(encoded, 1) if positions and len(ids) >= positions]
        if long:  # (past its positions a model runs on with embeddings it never learnt, or fails inside)
            n, length = long[0]
            raise ConfigError(f"prompt {n} is {length} tokens: the model has {positions} positions "
                              f"(max_position_embeddings), none left to generate in: shorten the prompt")
        done = []
        for prompt, ids in zip(prompts, encoded):
            new = self.complete(ids, sampling)
            done.append(Completion(prompt, ids, new, self.tokenizer.decode(new, skip_special_tokens=True)))
        return done


def load_generator(path: str, which: str = "best", trusted: TrustedCode | None = None,
                   chat_template: str | None = None) -> Generator:
    """A Generator for `path`: a Hugging Face folder (an export), a behemoth checkpoint, or a run folder (its
    `which` checkpoint); on the GPU where there is one. `chat_template`: a Jinja file used instead of the
    tokenizer's own (or the checkpoint's kept one). `trusted.tokenizer`: a tokenizer folder, for a checkpoint
    that keeps none."""
    import torch

    local = Store(path).expanded()
    if not Store(local).is_dir():
        raise ConfigError(f"{path} does not exist (or is not a folder): give a behemoth checkpoint or run folder, "
                          f"or a Hugging Face model folder (behemoth export writes one)")
    if not (weights.is_hf_folder(local) or weights.is_checkpoint(local) or complete_checkpoints(local)):
        raise ConfigError(f"{path} is not a behemoth checkpoint, a run folder with a complete checkpoint, or a "
                          f"Hugging Face model folder (config.json and its weights)")
    template = None
    if chat_template is not None:  # (read before the model loads: a bad file costs no wait)
        from behemoth.data.chat.chat import read_template

        template = read_template(Path(chat_template).expanduser(), f"--chat-template {chat_template}")
    if weights.is_hf_folder(local):
        model, tokenizer, source = _from_hf_folder(local)
        template_source = f"{local}'s chat template"
    else:
        trusted = dataclasses.replace(trusted or TrustedCode(), chat_template=chat_template)
        model, tokenizer, source, template_source = _from_checkpoint(path, which, trusted)
    if template is not None:
        tokenizer.chat_template, template_source = template, f"--chat-template {chat_template}"
    from behemoth.data.chat.chat import render_text
    from behemoth.models.causal_lm import generation_config

    config = generation_config(tokenizer, render_text, getattr(model, "generation_config", None))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Generator(model.to(device).eval(), tokenizer, config, source, template_source)


def _from_hf_folder(folder: str):
    """transformers alone, never the folder's code (trust_remote_code False): an architecture transformers does
    not know, or one that is not a causal LM, is refused in one line."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, between our lines: one model
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"{folder}: not a causal language model transformers can load without running the "
                          f"folder's code ({_first_line(e)})") from None
    except SafetensorError as e:  # a weights file cut short, or a Git LFS pointer: its own line names which
        weights.check_hf_weights(folder)
        raise CheckpointError(f"{folder}: its safetensors weights are damaged ({_first_line(e)}): copy them again "
                              f"from where they came from") from None
    return model, _tokenizer(folder, folder), folder


def _from_checkpoint(path: str, which: str, trusted: TrustedCode):
    """The model `behemoth export` would write (LoRA merged), the run's tokenizer and chat template as the
    checkpoint keeps them (Task.exported_job: never a path its job.yaml names), and where the template is."""
    from transformers import GenerationMixin

    from behemoth.models.lora import is_adapted

    with tempfile.TemporaryDirectory(prefix="behemoth-kept-") as kept:
        loaded = load_checkpoint_model(path, which, trusted, Path(kept))
        model = loaded.model.merge_and_unload() if is_adapted(loaded.model) else loaded.model
        if not isinstance(model, GenerationMixin):
            raise ConfigError(f"{loaded.ckpt}: its model ({loaded.cfg.model.name}, data.kind {loaded.cfg.data.kind}) "
                              f"is not a transformers causal language model: there is nothing to generate with")
        data = loaded.built.data
        tokenizer = _tokenizer(data.tokenizer, f"{loaded.ckpt}'s tokenizer")
        template = getattr(data, "template_text", lambda: None)()  # a chat run's kept template
        if template is not None:
            tokenizer.chat_template = template
    return model, tokenizer, f"{loaded.ckpt} ({loaded.how})", f"{loaded.ckpt}'s chat template"


def _tokenizer(name: str, where: str):
    """The tokenizer at `name`, never its own code; its own copy (a --chat-template set on it stays here)."""
    from transformers import AutoTokenizer

    from behemoth.storage.model_copy import local_source

    try:
        tok = AutoTokenizer.from_pretrained(local_source(name, "data.tokenizer", weights=False),
                                            trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: no tokenizer could be loaded from {name} ({_first_line(e)}); an export holds its "
                          f"tokenizer files beside the model") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"{where}: the tokenizer at {name} has no eos_token: generation would not know where to "
                          f"stop; set one in its tokenizer_config.json")
    return tok


def _first_line(e: Exception) -> str:
    """transformers' messages run to several lines (hints, links): the first says what failed."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_prompts(path: str) -> list:
    """The prompts of a file: JSONL (.jsonl/.json: rows with `prompt`, a text, or `messages`, a conversation)
    or plain text (a prompt per non-empty line). Every problem names the file and line."""
    try:
        with open(path, "rb") as f:  # (bounded: a prompt longer than the model's positions is refused anyway)
            data = f.read(PROMPTS_FILE_BYTES + 1)
        if len(data) > PROMPTS_FILE_BYTES:
            raise ConfigError(f"--prompts {path} is larger than {PROMPTS_FILE_BYTES >> 20} MiB: split it into "
                              f"smaller files")
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {path}: cannot read it ({e})") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ConfigError(f"--prompts {path} holds no prompt (one per line, or JSONL rows with prompt or messages)")
    if not path.endswith((".jsonl", ".json")):
        return [line for _, line in numbered]
    return [_prompt_of_row(line, f"{path}:{n}") for n, line in numbered]


def _prompt_of_row(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not a JSON object ({e.msg}): one object per line") from None
    except RecursionError:
        raise ConfigError(f"{where}: not a JSON object this reads (nested too deeply): one object per line") from None
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages") if isinstance(row, dict) else None
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return messages
    raise ConfigError(f"{where}: give a row with \"prompt\" (a text) or \"messages\" (a non-empty list of "
                      f"{{\"role\": ..., \"content\": a text}})")


def add_command(sub) -> None:
    p = sub.add_parser("generate", help="print a causal LM's completions of prompts (greedy, or sampled with "
                       "--temperature > 0), from a checkpoint, a run folder or an exported Hugging Face folder; "
                       "no Ray, the GPU if there is one")
    p.add_argument("model", metavar="CHECKPOINT_OR_EXPORT", help="a behemoth checkpoint folder, a run folder (its "
                   "best checkpoint; --latest: its latest) or a Hugging Face folder (behemoth export's)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="one prompt (text)")
    given.add_argument("--prompts", metavar="FILE", help="a prompt per line, or JSONL (.jsonl) rows with "
                       "\"prompt\" (text) or \"messages\" (a conversation, rendered with the chat template)")
    p.add_argument("--chat", action="store_true", help="render text prompts as a user's turn with the tokenizer's "
                   "chat template and its generation prompt (messages rows always are)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the tokenizer's "
                   "(a checkpoint's: the one it keeps, the run's)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample at this "
                   "temperature")
    p.add_argument("--top-p", type=float, help="sampling: keep the most likely tokens up to this probability mass")
    p.add_argument("--top-k", type=int, help="sampling: keep the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling: torch's seed before each prompt (default 0)")
    p.add_argument("--latest", action="store_true", help="a run folder's latest checkpoint instead of its best")
    add_trusted_code_args(p)
    p.set_defaults(handler=handle)


def handle(args) -> int:
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    sampling.validate()  # (before the model loads)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    generator = load_generator(args.model, "latest" if args.latest else "best",
                               TrustedCode(args.model_code, args.task_code, args.trust_remote_code, args.tokenizer),
                               args.chat_template)
    print(f"[behemoth] generate: {generator.source}; {sampling.describe()}", flush=True)
    for n, done in enumerate(generator.run(prompts, sampling, args.chat), 1):
        shown = done.prompt if isinstance(done.prompt, str) else json.dumps(done.prompt, ensure_ascii=False)
        print(f"--- prompt {n}: {shown}\n{done.text}", flush=True)
    return 0
