"""A local tokenizer for machines without the hub: byte-level BPE trained on the corpus with `tokenizers`,
saved in the `AutoTokenizer.from_pretrained` format (tokenizer.json + tokenizer_config.json).

Byte-level means every string is encodable (no unknown token); `<|endoftext|>` is the EOS (and BOS) token
behemoth puts between documents when packing.
"""

from __future__ import annotations

from pathlib import Path

from behemoth.data.text import TextData, plan_units, read_unit_documents
from behemoth.progress import watching

EOS = "<|endoftext|>"


def iter_documents(files: list[str], text_field: str = "text", document: str = "line"):
    """The documents of txt/jsonl/parquet files, as training reads them (same checks, same errors)."""
    cfg = TextData(kind="text", train_files=list(files), text_field=text_field, document=document)
    for unit in plan_units(cfg):
        yield from read_unit_documents(unit, text_field)


def train_tokenizer(files: list[str], out: str | Path, vocab_size: int = 4096, text_field: str = "text",
                    document: str = "line", min_frequency: int = 2):
    """Train byte-level BPE on `files` and save it to `out`. Returns the transformers tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(iter_documents(files, text_field, document), vocab_size=vocab_size,
                            min_frequency=min_frequency, special_tokens=[EOS], show_progress=watching())
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, unk_token=None)
    tok.save_pretrained(str(out))
    return tok
