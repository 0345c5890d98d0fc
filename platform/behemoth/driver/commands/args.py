"""The command line's shared pieces: argument types and the argument groups several commands take (each command's
module adds its own parser with them; cli.py lists the commands)."""

from __future__ import annotations

import argparse
import math


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job YAML, e.g. jobs/configs/demo_images.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=0.05 (repeatable)")


def add_trusted_code_args(p: argparse.ArgumentParser) -> None:
    """A checkpoint's job.yaml is data from whoever wrote it: code it names runs only when named here too, and
    no file it names is read (the tokenizer: the one the checkpoint keeps, or --tokenizer)."""
    p.add_argument("--model-code", type=import_path("function"), metavar="MODULE:FUNCTION",
                   help="import this model builder (a checkpoint whose model.name is one by import path: behemoth "
                   "imports no code that only the checkpoint names)")
    p.add_argument("--task-code", type=import_path("Class"), metavar="MODULE:CLASS",
                   help="import this task (a checkpoint whose data.kind is one by import path)")
    p.add_argument("--trust-remote-code", action="store_true", help="run the code of the checkpoint's "
                   "model.pretrained repository (its job.yaml's model.trust_remote_code is never honoured alone)")
    p.add_argument("--tokenizer", metavar="FOLDER", help="a tokenizer to use instead of the one the checkpoint "
                   "keeps (the run's); needed for a checkpoint written before behemoth kept it: behemoth reads no "
                   "file a checkpoint's job.yaml names")


def image_size(text: str):
    """`32` (a side) or `500x375` (width x height)."""
    parts = text.lower().split("x")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 8:
        raise argparse.ArgumentTypeError(f"{text!r}: give a side (32) or WIDTHxHEIGHT (500x375), each >= 8")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)


def int_between(low: int, high: int):
    """An integer from `low` to `high`; anything else refused in one line that names the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give one between {low} and {high}") \
                from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not between {low} and {high}")
        return value

    # argparse names the type by this in its own messages ("invalid parse value" otherwise)
    parse.__name__ = f"integer between {low} and {high}"
    return parse


def positive(what: str, high: float):
    """A number more than 0 and at most `high` (nan, inf, 0 and negatives refused in one line)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}, more than 0 and at most {high:g}")
        return value

    return parse


def import_path(what: str):
    def parse(text: str) -> str:
        module, _, attr = text.partition(":")
        if not (module and attr):
            raise argparse.ArgumentTypeError(f"{text!r} is not an import path: give module:{what}")
        return text

    return parse
