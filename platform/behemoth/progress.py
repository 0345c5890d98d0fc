"""Progress bars for the long preparation steps (writing demo data, indexing an image folder, tokenising a
corpus, training a tokenizer), shown only when a person watches: stderr is a terminal. In logs, CI and Ray
jobs nothing is printed. tqdm comes with transformers and datasets."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def watching() -> bool:
    return sys.stderr.isatty()


def progress(iterable: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    if not watching():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=f"[behemoth] {desc}", total=total, unit=unit, leave=False, dynamic_ncols=True)
