"""A local tokenizer for machines without the hub: byte-level BPE trained on the corpus with `tokenizers`,
saved in the `AutoTokenizer.from_pretrained` format (tokenizer.json + tokenizer_config.json).

Byte-level means every string is encodable (no unknown token); `<|endoftext|>` is the EOS (and BOS) token
behemoth puts between documents when packing. With `chat`, the files are conversations (data.kind chat's JSONL or
parquet: every turn's content is a document) and the tokenizer gets ChatML's turn markers as tokens and ChatML as
its chat template.
"""

from __future__ import annotations

from pathlib import Path

from behemoth.data.pipeline import expand_files
from behemoth.data.text.text import TextData, Unit, plan_units, planned_files, read_unit_documents
from behemoth.errors import ConfigError, DataError
from behemoth.progress import watching
from behemoth.storage.paths import local_out_folder

EOS = "<|endoftext|>"
MAX_VOCAB_SIZE = 1_000_000  # far past any model's vocabulary; a huge one aborted the Rust allocator
BYTES = 256  # byte-level BPE's alphabet: every vocabulary holds the 256 bytes before any merge
SAVED_FILES = ("tokenizer.json", "tokenizer_config.json")  # what save_pretrained would replace without a word


def iter_documents(files: list[str], text_field: str = "text", document: str = "line"):
    """The documents of txt/jsonl/parquet files, as training reads them (same checks, same errors)."""
    cfg = TextData(kind="text", train_files=list(files), text_field=text_field, document=document)
    for unit in plan_units(cfg):
        yield from read_unit_documents(unit, text_field)


def iter_turns(files: list[str], messages_field: str = "messages"):
    """The content of every turn of conversation files, as data.kind chat reads them (bad records skipped)."""
    from behemoth.data.chat.chat import ChatData, read_unit_records
    from behemoth.data.text.text import UNIT_BYTES, parquet_row_groups, text_format

    cfg = ChatData(kind="chat", train_files=list(files), messages_field=messages_field)
    # planned as the text path plans its files: globs expanded, a missing or empty file named in one line
    for _, path, _ in planned_files(cfg):
        fmt = text_format(cfg, path)
        size = Path(path).stat().st_size
        units = ([Unit("train", path, "parquet", g, g + 1)
                  for g in range(parquet_row_groups(path, messages_field, "--text-field", "the files"))]
                 if fmt == "parquet" else
                 [Unit("train", path, fmt, s, min(s + UNIT_BYTES, size)) for s in range(0, size, UNIT_BYTES)])
        for u in units:
            for record in read_unit_records(u, messages_field)[1]:
                value = record.value
                for message in value if isinstance(value, list) else []:
                    if isinstance(message, dict) and isinstance(message.get("content"), str):
                        yield message["content"]


def train_tokenizer(files: list[str], out: str | Path, vocab_size: int = 4096, text_field: str = "text",
                    document: str = "line", min_frequency: int = 2, chat: bool = False):
    """Train byte-level BPE on `files` and save it to `out`. Returns the transformers tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from behemoth.data.chat.chat import CHATML, CHATML_TOKENS

    special_tokens = [EOS, *(CHATML_TOKENS if chat else ())]
    _check_out(Path(out))
    if not BYTES + len(special_tokens) <= vocab_size <= MAX_VOCAB_SIZE:
        low = BYTES + len(special_tokens)
        specials = f"{len(special_tokens)} special token{'s' if len(special_tokens) > 1 else ''}"
        raise ConfigError(f"--vocab-size {vocab_size}: give at least {low} (the 256 bytes and {specials}) and at "
                          f"most {MAX_VOCAB_SIZE:,}")
    # globs expanded and a missing file named before training, for --chat's files as for text's
    files = expand_files(list(files), "train-tokenizer")
    field = text_field if text_field != "text" else "messages"
    documents = iter_turns(files, field) if chat else iter_documents(files, text_field, document)
    read = [0]  # documents with text: none read trains the bare 256 bytes, a tokenizer useless for the corpus

    def counted(docs):
        for doc in docs:
            read[0] += bool(doc)
            yield doc

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(counted(documents), vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=special_tokens, show_progress=watching())
    if not read[0]:
        named = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"
        raise DataError(f"no conversation turn read from {named} (field {field!r}): give conversation files, their "
                        f"messages field with --text-field, or leave out --chat (nothing written)" if chat else
                        f"no text read from {named}: every document is empty; give files with text (nothing written)")
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, unk_token=None)
    if chat:
        tok.add_special_tokens({"additional_special_tokens": list(CHATML_TOKENS)})
        tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return tok


def _check_out(out: Path) -> None:
    """Refused before training: save_pretrained into a file only warns (nothing written), and into a tokenizer's
    folder replaces it silently."""
    local_out_folder(out)
    held = [name for name in SAVED_FILES if (out / name).exists()]
    if held:
        raise ConfigError(f"--out {out} holds a tokenizer already ({held[0]}): give another --out (nothing is "
                          f"overwritten)")
