"""A local tokenizer for machines without the hub: byte-level BPE trained on the corpus with `tokenizers`,
saved in the `AutoTokenizer.from_pretrained` format (tokenizer.json + tokenizer_config.json).

Byte-level means every string is encodable (no unknown token); `<|endoftext|>` is the EOS (and BOS) token
behemoth puts between documents when packing. With `chat`, the files are conversations (data.kind chat's JSONL or
parquet: every turn's content is a document) and the tokenizer gets ChatML's turn markers as tokens and ChatML as
its chat template.
"""

from __future__ import annotations

from pathlib import Path

from behemoth.data.text.text import TextData, Unit, plan_units, read_unit_documents
from behemoth.progress import watching

EOS = "<|endoftext|>"


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
    for path in files:
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

    bpe = ByteLevelBPETokenizer()
    documents = iter_turns(files, text_field if text_field != "text" else "messages") if chat else \
        iter_documents(files, text_field, document)
    bpe.train_from_iterator(documents, vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=[EOS, *(CHATML_TOKENS if chat else ())], show_progress=watching())
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, unk_token=None)
    if chat:
        tok.add_special_tokens({"additional_special_tokens": list(CHATML_TOKENS)})
        tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return tok
